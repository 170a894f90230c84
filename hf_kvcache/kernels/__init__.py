"""Attention kernels that read quantized keys and values directly (see `blockwise.py` for the contract).

The lowest layer of the library but the transformers boundary: kernels import nothing else of hf_kvcache (a store
describes its codes as `QuantizedKV` runs: hf_kvcache.stores.code_views)."""

from . import cpu_blockwise
from .blockwise import BACKENDS, blockwise_attention
from .codes import QuantizedKV, dequantize, dequantize_block

__all__ = ["BACKENDS", "cpu_blockwise", "QuantizedKV", "blockwise_attention", "dequantize", "dequantize_block"]
