"""Policies decide which tokens stay in the cache and in which slot."""

from .base import Placement, Policy
from .keep_all import KeepAllPolicy
from .sink_window import SinkWindowPolicy

__all__ = ["Placement", "Policy", "KeepAllPolicy", "SinkWindowPolicy"]
