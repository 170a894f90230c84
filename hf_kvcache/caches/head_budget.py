"""The `head_budget` / `safeguard` settings shared by the caches that can allot their budget by head (AdaKV: see
hf_kvcache.policies.head_budgets): "uniform" keeps `budget` tokens in every KV head; "adaptive" keeps
`budget x kv_heads` per layer in one slot pool, each head at least `safeguard x budget`."""

from __future__ import annotations

from typing import Any

from ..common.architecture import regroups_values
from ..common.validation import require_choice
from ..stores import FullPrecisionStore
from ..stores.head_pool import HeadPooledQuantizedStore, HeadPooledStore
from ..stores.quantization import QuantSpec
from ..stores.regions import slot_specs, store_for_precisions

HEAD_BUDGETS = ("uniform", "adaptive")


def check_head_budget(head_budget, safeguard) -> tuple[str, float]:
    head_budget = require_choice("head_budget", head_budget, HEAD_BUDGETS)
    if isinstance(safeguard, bool) or not isinstance(safeguard, (int, float)) or not 0.0 <= safeguard <= 1.0:
        raise ValueError(
            f"`safeguard` (the share of the budget every head keeps) must be in [0, 1], got {safeguard!r}."
        )
    return head_budget, float(safeguard)


def check_precision(precision: Any, where: str = "precision") -> tuple[QuantSpec, QuantSpec] | None:
    """None for the model's dtype ("full"), else the per-token (key, value) QuantSpecs: one format name or spec dict
    for both, or {"keys": ..., "values": ...} (e.g. FP8 keys, INT4 values). The error names `where`."""
    if isinstance(precision, dict) and set(precision) == {"keys", "values"}:
        keys, values = precision["keys"], precision["values"]
        names = (f"`{where}['keys']`", f"`{where}['values']`")
    else:
        keys = values = precision
        names = (f"`{where}`", f"`{where}`")
    specs = slot_specs(keys, values, names)
    return None if all(spec.format == "none" for spec in specs) else specs


def check_pool_fits(head_budget: str, config) -> None:
    """Refuse a head-adaptive pool for a model whose attention mixes the values of two heads at each slot."""
    if head_budget == "adaptive" and config is not None and regroups_values(config):
        raise ValueError(
            f"`head_budget`='adaptive' keeps each head's own tokens in one pool, but {type(config).__name__}'s "
            "attention mixes the values of two heads at each slot (DiffLlama); use `head_budget`='uniform'."
        )


def with_head_budget(
    policy,
    head_budget: str,
    safeguard: float,
    precision: tuple[QuantSpec, QuantSpec] | None = None,
    workspace=None,
    config=None,
):
    """(policy, store) for a heavy-hitter policy: a pool shared by the heads when the budget is adaptive, its tokens
    in the model's dtype or quantized per token at `precision` (`workspace`: the cache's shared dequantization
    scratch). `config`: the model's, to refuse a pool where the attention mixes heads' values."""
    check_pool_fits(head_budget, config)
    policy.adaptive, policy.safeguard = head_budget == "adaptive", safeguard
    if precision is None:
        return policy, HeadPooledStore() if policy.adaptive else FullPrecisionStore()
    if not policy.adaptive:
        return policy, store_for_precisions(*precision, "precision", workspace)
    return policy, HeadPooledQuantizedStore(*precision, append_only=False, workspace=workspace, name="precision")


def quantized_key_rotation(config, head_dim: int | None):
    """The rotation of quantized keys in an evicting cache: Hadamard (outliers spread over the channels, as
    QuantizedFP8Cache's default), none for latent attention or a head_dim Hadamard cannot take."""
    from ..common.architecture import is_latent_attention
    from ..common.rotation import rotation_matrix

    if head_dim is None or head_dim % 2 or is_latent_attention(config):
        return None
    return rotation_matrix("hadamard", head_dim)
