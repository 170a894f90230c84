"""The scorer caches: a token budget kept by one scorer (see hf_kvcache.policies.scored and each scorer's module).

| name | keeps | needs |
|---|---|---|
| `knorm` | lowest key norms (arXiv 2406.11430) | keys |
| `keydiff` | keys least similar to the mean key (arXiv 2504.15364) | keys |
| `tova` | what the last query attends to, layer-wide (arXiv 2401.06104) | last query's attention |
| `snapkv` | what the last `window` queries attend to, pooled (arXiv 2404.14469) | window's attention |
| `expected_attention` | expected attention of future queries x value norm (arXiv 2510.00636) | queries |

Every one takes `budget` (tokens, or a ratio of the prompt in (0, 1]) and `compress` ("always": the budget holds
through decoding, the victim of each step chosen by the scorer; "prompt": see hf_kvcache.policies.prompt_mode).
Keys are kept at their original positions, in full precision, per batch row and KV head.

The newest tokens: `recent` tokens are never evicted. Left unset (None), it is the paper's protocol in prompt mode
(knorm, keydiff, expected_attention 0; tova 1) and, in "always" mode, at least `DECODE_RECENT_SHARE` of the budget
(Knorm: `KNORM_DECODE_RECENT_SHARE`): decode-time eviction by a key score alone drops the tokens the next queries need
most (without the window, Knorm at a 20% budget reaches KL 2.9 against the full cache and top-1 0.25:
eval/results/scorers, whose "always" rows use the papers' windows; with half the budget protected 0.38 and top-1
0.746, with three quarters 0.27 and 0.797: eval/results/scorers_decode; on held-out text, pydoc at token 60000,
0.120 with half and 0.099 with three quarters, top-1 0.887 / 0.883). SnapKV's `window`
is its recent window in both modes. `rescore_every` (keydiff, snapkv, expected_attention, whose decode steps
re-score the stored tokens before choosing the victim): re-score every N steps instead of every step.

The scorers without a class above (LagKV, and any scorer added to hf_kvcache.scorers.registry) share one plain
class, `ScorerCache`: the common settings above plus the scorer's own fields as keyword options. `LagKVCache` is
its subclass for `lagkv`; a scorer without a subclass gets `ScorerCache.of(scorer)` in the catalog.
"""

from __future__ import annotations

import dataclasses

from transformers import PreTrainedModel

from ..common.rope import KeyRotator, check_rotator_once
from ..common.validation import require_choice, require_int
from ..policies.prompt_mode import COMPRESS_MODES
from ..policies.scored import ScoredPolicy
from ..scorers.base import Scorer
from ..scorers.expected_attention import ExpectedAttention
from ..scorers.keydiff import KeyDiff
from ..scorers.knorm import Knorm
from ..scorers.lagkv import LagKV
from ..scorers.registry import options_of
from ..scorers.snapkv import SnapKV
from ..scorers.tova import TOVA
from .base import KVCache, _size_or_ratio
from .head_budget import check_head_budget, with_head_budget


def _budget(budget):
    if budget is None:
        raise ValueError("Give a `budget`: tokens (int >= 1) or a ratio of the prompt length (float in (0, 1]).")
    budget = _size_or_ratio("budget", budget)
    if budget == 0:
        raise ValueError("`budget` must be at least 1 token.")
    return budget


#: the least share of the budget that decode-time eviction ("always") keeps as a recent window when `recent` is unset
DECODE_RECENT_SHARE = 0.5
#: Knorm's: its key-norm score is the weakest signal of the scorers, so more of its budget goes to the newest tokens
KNORM_DECODE_RECENT_SHARE = 0.75


def _recent(recent, budget, name: str = "recent") -> int:
    recent = require_int(name, recent, 0)
    if not isinstance(budget, float) and recent > budget:
        raise ValueError(f"`{name}` ({recent}) must not exceed `budget` ({budget}).")
    return recent


class _ScorerCache(KVCache):
    size_keys = ("budget",)

    def _setup(
        self,
        config_or_model,
        budget,
        compress,
        make_scorer,
        layers,
        head_budget="uniform",
        safeguard=0.2,
        *,
        share: float,
        recent: int | None = None,
        sinks: int = 0,
        rescore_every: int = 1,
    ):
        """Build the layers: each a `ScoredPolicy` holding `budget` with `make_scorer(config)`'s scorer, `recent`
        (default `self.recent`) and `share` of the budget protected, `sinks` by position."""
        self.budget = _budget(budget)
        self.compress = require_choice("compress", compress, COMPRESS_MODES)
        self.head_budget, self.safeguard = check_head_budget(head_budget, safeguard)
        recent = self.recent if recent is None else recent

        def build(cfg):
            policy = ScoredPolicy(
                self.budget, recent, make_scorer(cfg), sinks=sinks, recent_share=share, rescore_every=rescore_every
            )
            return with_head_budget(policy, self.head_budget, self.safeguard, config=cfg)

        super().__init__(config_or_model, build, layers)

    def _window(
        self, recent, budget, compress, paper: int, decode_share: float = DECODE_RECENT_SHARE
    ) -> tuple[int, float]:
        """(`recent` tokens, share of the budget) the policy protects: as given, else the paper's window in prompt
        mode and at least `decode_share` of the budget in "always" mode."""
        if recent is not None:
            return _recent(recent, _budget(budget)), 0.0
        return paper, decode_share if require_choice("compress", compress, COMPRESS_MODES) == "always" else 0.0


class KnormCache(_ScorerCache):
    """Knorm (arXiv 2406.11430): per row and KV head, the `budget` tokens with the lowest key norms (of which the
    `recent` newest are always kept). No attention probabilities are computed."""

    cache_name = "knorm"

    def __init__(
        self,
        config_or_model,
        budget: int | float | None = None,
        recent: int | None = None,
        compress: str = "always",
        head_budget: str = "uniform",
        safeguard: float = 0.2,
        layers: dict | list | None = None,
    ):
        self.recent, share = self._window(recent, budget, compress, paper=0, decode_share=KNORM_DECODE_RECENT_SHARE)
        self._setup(config_or_model, budget, compress, lambda cfg: Knorm(), layers, head_budget, safeguard, share=share)


class KeyDiffCache(_ScorerCache):
    """KeyDiff (arXiv 2504.15364): per row and KV head, the `budget` tokens whose keys are least similar (cosine)
    to the mean normalised key (the `recent` newest always kept). No attention probabilities are computed."""

    cache_name = "keydiff"

    def __init__(
        self,
        config_or_model,
        budget: int | float | None = None,
        recent: int | None = None,
        compress: str = "always",
        rescore_every: int = 1,
        head_budget: str = "uniform",
        safeguard: float = 0.2,
        layers: dict | list | None = None,
    ):
        self.recent, share = self._window(recent, budget, compress, paper=0)
        self.rescore_every = require_int("rescore_every", rescore_every, 1)
        self._setup(
            config_or_model,
            budget,
            compress,
            lambda cfg: KeyDiff(),
            layers,
            head_budget,
            safeguard,
            share=share,
            rescore_every=self.rescore_every,
        )


class TOVACache(_ScorerCache):
    """TOVA (arXiv 2401.06104): the `budget` tokens the last query attends to most, attention averaged over all
    query heads of the layer (one token set per layer, as in the paper); the `recent` newest (1) always kept."""

    cache_name = "tova"

    def __init__(
        self,
        config_or_model,
        budget: int | float | None = None,
        recent: int | None = None,
        compress: str = "always",
        layers: dict | list | None = None,
    ):
        self.recent, share = self._window(recent, budget, compress, paper=1)
        # (one token set per layer: no head budgets)
        self._setup(config_or_model, budget, compress, lambda cfg: TOVA(), layers, share=share)


class SnapKVCache(_ScorerCache):
    """SnapKV (arXiv 2404.14469): the observation `window` (the last tokens, kept) plus the tokens the window's
    queries attend to most, scores mean-pooled along the sequence with `kernel`, per KV head (group mean). The
    protected recent window is the larger of `window` and `recent` (see the module docstring for its default)."""

    cache_name = "snapkv"

    def __init__(
        self,
        config_or_model,
        budget: int | float | None = None,
        window: int = 64,
        kernel: int = 5,
        recent: int | None = None,
        compress: str = "always",
        rescore_every: int = 1,
        head_budget: str = "uniform",
        safeguard: float = 0.2,
        layers: dict | list | None = None,
    ):
        SnapKV(window, kernel)  # (validates them)
        self.window, self.kernel = window, kernel
        _recent(window, _budget(budget), "window")
        self.rescore_every = require_int("rescore_every", rescore_every, 1)
        self.recent, share = self._window(recent, budget, compress, paper=window)
        self._setup(
            config_or_model,
            budget,
            compress,
            lambda cfg: SnapKV(self.window, self.kernel),
            layers,
            head_budget,
            safeguard,
            share=share,
            recent=max(self.window, self.recent),  # the observation window is kept
            rescore_every=self.rescore_every,
        )


class ExpectedAttentionCache(_ScorerCache):
    """Expected attention (arXiv 2510.00636, kvpress ExpectedAttentionPress): the `budget` tokens with the largest
    expected attention from queries at the next `future` positions (Gaussian query statistics of the prompt, rotated
    with the model's RoPE), times their value norm; the first `sinks` tokens and the `recent` newest always kept."""

    cache_name = "expected_attention"

    def __init__(
        self,
        config_or_model,
        budget: int | float | None = None,
        recent: int | None = None,
        sinks: int = 4,
        future: int = 512,
        use_covariance: bool = True,
        use_value_norm: bool = True,
        compress: str = "always",
        rescore_every: int = 1,
        head_budget: str = "uniform",
        safeguard: float = 0.2,
        layers: dict | list | None = None,
    ):
        self.recent, share = self._window(recent, budget, compress, paper=0)
        self.rescore_every = require_int("rescore_every", rescore_every, 1)
        ExpectedAttention(sinks, future, use_covariance, use_value_norm)  # (validates them)
        self.sinks, self.future = sinks, future
        rotators = {}

        def make_scorer(cfg):
            if "rotator" not in rotators:
                rotators["rotator"] = KeyRotator(cfg, parameter="expected_attention")
            scorer = ExpectedAttention(self.sinks, self.future, use_covariance, use_value_norm)
            scorer.rotator = rotators["rotator"]
            return scorer

        self._setup(
            config_or_model,
            budget,
            compress,
            make_scorer,
            layers,
            head_budget,
            safeguard,
            share=share,
            sinks=self.sinks,
            rescore_every=self.rescore_every,
        )
        if isinstance(config_or_model, PreTrainedModel) and rotators:  # the model's own RoPE must agree
            indices = [layer.layer_idx for layer in self.compressed_layers]
            check_rotator_once(config_or_model, rotators["rotator"], indices)


class ScorerCache(_ScorerCache):
    """The cache of a registered scorer that has no hand-written cache: `budget`, `recent`, `compress`,
    `rescore_every`, `head_budget`, `safeguard` as the scorer caches above (no recent window by default in prompt
    mode, `DECODE_RECENT_SHARE` of the budget in "always" mode), and the scorer's own fields as keyword options
    (`**options`, each validated by the scorer; any other name is an error naming it).

    A subclass names its scorer (`scorer_class`, whose `name` is the `cache_implementation` name): `LagKVCache`
    below. A scorer added to hf_kvcache.scorers.registry without one gets `ScorerCache.of(scorer)` in the catalog
    (hf_kvcache.caches.registry), so the registry's line alone makes it a cache."""

    #: the scorer this cache keeps its budget with (set by each subclass)
    scorer_class: type[Scorer]
    #: the constructor's settings before the scorer's options (their order is that of `config_keys`)
    common_keys = ("budget", "recent", "compress", "rescore_every", "head_budget", "safeguard")

    def __init__(
        self,
        config_or_model,
        budget: int | float | None = None,
        recent: int | None = None,
        compress: str = "always",
        rescore_every: int = 1,
        head_budget: str = "uniform",
        safeguard: float = 0.2,
        *,
        layers: dict | list | None = None,
        **options,
    ):
        scorer_cls = self.scorer_class
        allowed = options_of(scorer_cls.name)
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(
                f"`{unknown[0]}` is not a parameter of cache {scorer_cls.name!r}; its scorer's parameters: "
                f"{', '.join(allowed) or 'none'}."
            )
        scorer_cls(**options)  # (validates them)
        self.options = dict(options)
        self.recent, share = self._window(recent, budget, compress, paper=0)
        self.rescore_every = require_int("rescore_every", rescore_every, 1)
        self._setup(
            config_or_model,
            budget,
            compress,
            lambda cfg: scorer_cls(**self.options),
            layers,
            head_budget,
            safeguard,
            share=share,
            rescore_every=self.rescore_every,
        )

    @classmethod
    def config_keys(cls) -> list[str]:
        """The common settings, the scorer's options (`**options` spelled out), then `layers`."""
        return [*cls.common_keys, *options_of(cls.scorer_class.name), "layers"]

    @classmethod
    def option_defaults(cls) -> dict:
        """The scorer's options with their defaults (the dataclass fields `**options` takes)."""
        allowed = options_of(cls.scorer_class.name)
        return {f.name: f.default for f in dataclasses.fields(cls.scorer_class) if f.name in allowed}

    @staticmethod
    def of(scorer_cls: type[Scorer]) -> type[ScorerCache]:
        """The cache class of a registered scorer that has no subclass below (hf_kvcache.caches.registry fills the
        catalog with it): ScorerCache driving `scorer_cls`, named after it."""

        class Cache(ScorerCache):
            __doc__ = ScorerCache.__doc__
            cache_name = scorer_cls.name
            scorer_class = scorer_cls

        Cache.__name__ = Cache.__qualname__ = f"{scorer_cls.__name__}Cache"
        return Cache


class LagKVCache(ScorerCache):
    """LagKV (arXiv 2504.04704, hf_kvcache.scorers.lagkv): the `budget` tokens whose keys and values vary most
    against the partition of `lag` tokens that follows them; the first `sinks` tokens always kept."""

    cache_name = "lagkv"
    scorer_class = LagKV


#: the hand-written scorer caches (hf_kvcache.caches.registry adds `ScorerCache.of` for any other scorer)
SCORER_CACHES = (KnormCache, KeyDiffCache, TOVACache, SnapKVCache, ExpectedAttentionCache, LagKVCache)
