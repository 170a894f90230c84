"""Stores hold the kept tokens' keys and values at some precision, in preallocated slots."""

from .full import FullPrecisionStore
from .quantization import NonFiniteError, QuantSpec
from .quantized import QuantizedStore
from .workspace import DequantWorkspace

__all__ = ["DequantWorkspace", "FullPrecisionStore", "NonFiniteError", "QuantSpec", "QuantizedStore"]
