"""Stores hold the kept tokens' keys and values at some precision, in preallocated slots."""

from .full import FullPrecisionStore

__all__ = ["FullPrecisionStore"]
