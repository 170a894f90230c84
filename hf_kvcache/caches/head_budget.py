"""The `head_budget` / `safeguard` settings shared by the caches that can allot their budget by head (AdaKV: see
hf_kvcache.policies.head_budgets): "uniform" keeps `budget` tokens in every KV head; "adaptive" keeps
`budget x kv_heads` per layer in one slot pool, each head at least `safeguard x budget`."""

from __future__ import annotations

from ..common.validation import require_choice
from ..stores import FullPrecisionStore
from ..stores.head_pool import HeadPooledStore

HEAD_BUDGETS = ("uniform", "adaptive")


def check_head_budget(head_budget, safeguard) -> tuple[str, float]:
    head_budget = require_choice("head_budget", head_budget, HEAD_BUDGETS)
    if isinstance(safeguard, bool) or not isinstance(safeguard, (int, float)) or not 0.0 <= safeguard <= 1.0:
        raise ValueError(
            f"`safeguard` (the share of the budget every head keeps) must be in [0, 1], got {safeguard!r}."
        )
    return head_budget, float(safeguard)


def with_head_budget(policy, head_budget: str, safeguard: float):
    """(policy, store) for a heavy-hitter policy: a pool shared by the heads when the budget is adaptive."""
    policy.adaptive, policy.safeguard = head_budget == "adaptive", safeguard
    return policy, HeadPooledStore() if policy.adaptive else FullPrecisionStore()
