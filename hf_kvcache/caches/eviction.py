"""The evicting presets: a policy choosing which tokens stay, over full-precision stores (hf_kvcache.caches.base).

`SlidingWindowCache` (last `window` tokens), `SinkCache` (StreamingLLM: first `sinks` + last `window`), `H2OCache`
(heavy hitters by accumulated attention + a recent window) and its baseline `RandomEvictionCache`.
"""

from __future__ import annotations

from ..common.rope import KeyRotator
from ..common.validation import require_choice, require_int
from ..policies import SinkWindowPolicy
from ..policies.heavy_hitter import HeavyHitterPolicy
from ..policies.prompt_mode import COMPRESS_MODES
from ..scorers.h2o import AGGREGATIONS, H2O
from ..scorers.random_keys import RandomKeys
from ..stores import FullPrecisionStore
from .base import POSITION_MODES, KVCache, _size_or_ratio
from .head_budget import check_head_budget, with_head_budget

#: how H2O ranks tokens: the attention they accumulated (the paper), or its average over the queries that saw them
#: (kvpress's ObservedAttentionPress), which does not favour old tokens
ATTENTION_SCORES = ("accumulated", "average")


class SlidingWindowCache(KVCache):
    """The last `window` tokens of each row (window attention with a rolling buffer)."""

    cache_name = "sliding"
    size_keys = ("window",)

    def __init__(
        self, config_or_model, window: int = 1024, compress: str = "always", layers: dict | list | None = None
    ):
        window = require_int("window", window, 1)
        self.window = window
        self.compress = require_choice("compress", compress, COMPRESS_MODES)
        super().__init__(config_or_model, lambda cfg: (SinkWindowPolicy(0, window), FullPrecisionStore()), layers)


class SinkCache(KVCache):
    """StreamingLLM (arXiv 2309.17453): the first `sinks` tokens of each row plus the last `window` tokens.

    Give either `window` or the total `budget` (= sinks + window). `position_mode="cache"` (default) places the
    sinks just before the window, as StreamingLLM does; `"original"` keeps their original positions."""

    cache_name = "sink"
    size_keys = ("window", "budget")

    def __init__(
        self,
        config_or_model,
        sinks: int = 4,
        window: int | None = None,
        budget: int | None = None,
        position_mode: str = "cache",
        compress: str = "always",
        layers: dict | list | None = None,
    ):
        sinks = require_int("sinks", sinks, 0)
        self.compress = require_choice("compress", compress, COMPRESS_MODES)
        if (window is None) == (budget is None):
            raise ValueError(f"Give exactly one of `window` or `budget` (got window={window!r}, budget={budget!r}).")
        if budget is not None:
            budget = require_int("budget", budget, 1)
            if sinks >= budget:
                raise ValueError(
                    f"`sinks` ({sinks}) must be smaller than `budget` ({budget}): the window needs at least one slot."
                )
            window = budget - sinks
        window = require_int("window", window, 1)
        position_mode = require_choice("position_mode", position_mode, POSITION_MODES)
        self.sinks, self.window, self.position_mode = sinks, window, position_mode
        rotators = {}  # one per cache, built after the base class checked the architecture

        def layer_parts(cfg):
            if position_mode == "cache" and "rotator" not in rotators:
                rotators["rotator"] = KeyRotator(cfg)
            return SinkWindowPolicy(sinks, window, rotators.get("rotator")), FullPrecisionStore()

        super().__init__(config_or_model, layer_parts, layers)
        KeyRotator.check_cache(self, config_or_model)  # built with a model: its own RoPE must agree


class H2OCache(KVCache):
    """H2O (arXiv 2306.14048): per row and KV head, the `recent` last tokens plus the `heavy` older tokens that
    received the most attention. Sizes are token counts, or ratios of the prompt length (floats in (0, 1]).

    Give `heavy` and `recent`, or a `budget` (tokens) split evenly, or a budget and one of the two. Scores come from
    the attention bridge (see docs/design.md); `aggregation` combines the query heads of a GQA group ("sum" as in
    the paper's per-head scores added up, "mean", or "max"). For long prompts, `generate(prefill_chunk_size=N)`
    evicts between chunks so peak memory stays near the budget. `position_mode="compact"` places the kept tokens at
    contiguous positions ending at the newest (re-rotating from a copy of the keys as they arrived, which costs
    one more key buffer); "original" (default) leaves every key at its own position. `attention_score`: rank by the
    attention's "average" over the queries that saw each token (default: kvpress's ObservedAttentionPress, measured
    better at every budget, docs/defaults.md) or the attention "accumulated" (the paper, which favours old tokens).
    `head_budget="adaptive"`: AdaKV's allotment over the layer's heads (docs/scorers.md)."""

    cache_name = "h2o"
    size_keys = ("heavy", "recent", "budget")

    def __init__(
        self,
        config_or_model,
        heavy: int | float | None = None,
        recent: int | float | None = None,
        budget: int | None = None,
        aggregation: str = "sum",
        position_mode: str = "original",
        compress: str = "always",
        attention_score: str = "average",
        head_budget: str = "uniform",
        safeguard: float = 0.2,
        layers: dict | list | None = None,
    ):
        aggregation = require_choice("aggregation", aggregation, AGGREGATIONS)
        self.attention_score = require_choice("attention_score", attention_score, ATTENTION_SCORES)
        self.head_budget, self.safeguard = check_head_budget(head_budget, safeguard)
        self.compress = require_choice("compress", compress, COMPRESS_MODES)
        position_mode = require_choice("position_mode", position_mode, ("original", "compact"))
        if position_mode == "compact" and self.head_budget == "adaptive":
            raise ValueError(
                "`position_mode` 'compact' re-rotates each head's keys in place, which the heads' shared "
                "pool of `head_budget` 'adaptive' does not hold: use position_mode 'original'."
            )
        heavy = None if heavy is None else _size_or_ratio("heavy", heavy)
        recent = None if recent is None else _size_or_ratio("recent", recent)
        if budget is not None:
            budget = require_int("budget", budget, 1)
            if isinstance(heavy, float) or isinstance(recent, float):
                raise ValueError(
                    "`budget` is a token count; give `heavy`/`recent` as token counts with it, not ratios."
                )
            if heavy is None and recent is None:
                heavy = budget // 2
                recent = budget - heavy
            elif heavy is None:
                heavy = budget - recent
            elif recent is None:
                recent = budget - heavy
            if heavy < 0 or recent < 0 or heavy + recent > budget:
                raise ValueError(f"`heavy` + `recent` ({heavy} + {recent}) must fit in `budget` ({budget}), each >= 0.")
        elif heavy is None or recent is None:
            raise ValueError("Give `heavy` and `recent` (tokens or prompt ratios), or a `budget` in tokens.")
        if not isinstance(heavy, float) and not isinstance(recent, float) and heavy + recent < 1:
            raise ValueError("`heavy` + `recent` must be at least 1 token.")
        self.heavy, self.recent, self.aggregation, self.position_mode = heavy, recent, aggregation, position_mode
        make_scorer = getattr(self, "_scorer_factory", lambda: H2O(aggregation))
        rotators = {}

        def layer_parts(cfg):
            if position_mode == "compact" and "rotator" not in rotators:
                rotators["rotator"] = KeyRotator(cfg)
            policy = HeavyHitterPolicy(heavy, recent, make_scorer(), rotators.get("rotator"))
            policy.average = self.attention_score == "average"
            return with_head_budget(policy, self.head_budget, self.safeguard, config=cfg)

        super().__init__(config_or_model, layer_parts, layers)
        KeyRotator.check_cache(self, config_or_model)  # built with a model: its own RoPE must agree


class RandomEvictionCache(H2OCache):
    """Baseline: the `recent` last tokens plus `heavy` older tokens chosen uniformly at random (seeded), per row
    and KV head. Same budget arguments as H2OCache; what H2O must beat at the same budget."""

    cache_name = "random_eviction"

    def __init__(
        self,
        config_or_model,
        heavy: int | float | None = None,
        recent: int | float | None = None,
        budget: int | None = None,
        seed: int = 0,
        compress: str = "always",
        layers: dict | list | None = None,
    ):
        seed = require_int("seed", seed, 0)
        self.seed = seed
        # draws keyed by global KV head under tensor parallelism
        self._scorer_factory = lambda: RandomKeys(seed, self.tensor_parallel)
        super().__init__(  # (random scores ranked as drawn: no averaging over the queries that saw a token)
            config_or_model,
            heavy=heavy,
            recent=recent,
            budget=budget,
            compress=compress,
            attention_score="accumulated",
            layers=layers,
        )
