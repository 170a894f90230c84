"""The attention bridge between transformers and our cache layers (`bridge`: the forward hook and the attention
functions registered with transformers' AttentionInterface), and the attention paths it chooses per layer: output
and column scores in one pass (`scored`), one-token GQA decode (`gqa_decode`), attention from quantized codes
(`codes`).

May import: layers, policies, stores, kernels, common, integration.
"""

from .bridge import (
    BRIDGE_NAMES,
    active_cache,
    attention_column_scores,
    build_validity_mask,
    disable,
    enable,
    is_enabled,
    register_attention_functions,
)

__all__ = [
    "BRIDGE_NAMES",
    "active_cache",
    "attention_column_scores",
    "build_validity_mask",
    "disable",
    "enable",
    "is_enabled",
    "register_attention_functions",
]
