"""Attention kernels that read quantized keys and values directly (see `blockwise.py` for the contract)."""

from . import cpu_blockwise
from .blockwise import BACKENDS, blockwise_attention
from .codes import QuantizedKV, dequantize, dequantize_block, from_codec, store_segments

__all__ = ["BACKENDS", "cpu_blockwise", "QuantizedKV", "blockwise_attention", "dequantize", "dequantize_block",
           "from_codec", "store_segments"]
