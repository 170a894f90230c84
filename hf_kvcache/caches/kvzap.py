"""KVzap (kvpress, arXiv 2601.07891): KVzip's placement with its scores predicted, not measured.

    cache = KVzapCache(model, budget=0.2)                     # the surrogate shipped for the offline SmolLM2
    cache = KVzapCache(model, budget=0.2, surrogate="DIR")    # one trained by `hf-kvcache train-kvzap`, or a Hub repo
    hf_kvcache.publish(model_dir, "kvzap", {"budget": 0.2, "surrogate": "DIR"})  # copied in: "model:kvzap_surrogate"
    out = model.generate(**inputs, cache=cache)               # or cache_implementation="kvzap"

KVzip scores each context token by the attention it gets while the model reconstructs the context: extra forwards
of about the context's length. KVzap trains a small per-layer model (hf_kvcache.scorers.kvzap_surrogate) to predict
those scores from the layer's attention input hidden states, so each token is scored once, as it enters the cache,
by a [hidden -> KV heads] map: no reconstruction, and decode tokens can be scored too.

What happens:
1. The prompt is prefilled into full-precision layers (as KVzip's); hooks on the attention modules hand each
   layer's input hidden states to the surrogate, whose predicted log scores are kept per layer.
2. At the end of the prompt (the first one-token forward, `end_prompt()`, or `compress_context(model)`), the context
   is placed as KVzip's is: allotted over the model (`layer_budget="adaptive"`) and the layer's heads
   (`head_budget="adaptive"`) by the predicted scores, at `precision`.
   A window of the `recent` newest tokens per head (64, at most a quarter of the budget; a third of the budget with
   `compress="always"`) is kept in every layer, part of the budget: the allotment shares what it leaves.
3. `compress="prompt"` (default): later tokens are appended. `compress="always"`: each new token is scored by the
   surrogate when it arrives, and the lowest-scoring token outside the window is evicted from the layer's share.
"""

from __future__ import annotations

import os

import torch

from ..attention.bridge import active_cache
from ..common.validation import require_choice, require_int
from ..integration.attention_inputs import attention_modules, capture_attention_inputs
from ..policies.heavy_hitter import resolve_size
from ..scorers.kvzap import KVzap
from ..scorers.kvzap_surrogate import BUILTIN, Surrogate
from .kvzip import KVzipCache

#: the newest tokens per head always kept in prompt mode, part of the budget (the next token needs its neighbours,
#: which a query-agnostic score does not rank: KVzap keeps such a window), at most a quarter of the budget
RECENT = 64
#: the share of the budget kept as that window in "always" mode: decode-time eviction by a query-agnostic score
#: would otherwise drop the generated text's own recent context (docs/caches.md gives the measured sweep)
ALWAYS_RECENT_SHARE = 1 / 3


def default_window(compress: str, budget_tokens: int) -> int:
    """The `recent` window when none is given: 64 tokens (at most a quarter of the budget) in prompt mode, a third
    of the budget in "always" mode."""
    if compress == "always":
        return int(budget_tokens * ALWAYS_RECENT_SHARE)
    return min(RECENT, budget_tokens // 4)


_HOOKED = "_hf_kvcache_attention_inputs"
#: a `surrogate` inside the model's own folder or Hub repo ("model:kvzap_surrogate"), as hf_kvcache.publish writes it
BESIDE_MODEL = "model:"
PUBLISHED_FOLDER = "kvzap_surrogate"


def _to_active_cache(layer_idx: int, hidden: torch.Tensor) -> None:
    """The attention-input hook's sink: hand the hidden states to the cache of the current forward, if it reads
    them (one hook set per model, whatever cache it runs with)."""
    cache = active_cache()
    receive = getattr(cache, "attention_input", None)
    if receive is not None:
        receive(layer_idx, hidden)


def shipped_surrogate(config) -> str | None:
    """The builtin surrogate trained for the model of `config` (hf_kvcache.scorers.kvzap_surrogate.BUILTIN), if
    one ships: by the name the model was loaded from."""
    return "smollm2" if "smollm2-135m" in str(getattr(config, "_name_or_path", "") or "").lower() else None


def _resolve_surrogate(surrogate, config) -> Surrogate:
    """A Surrogate from an object, a directory, a Hub repo id, a builtin name, or "model:FOLDER" (a folder of the
    model's own directory or Hub repo, as hf_kvcache.publish writes it); None: the builtin one trained for this
    model, if any."""
    if isinstance(surrogate, str) and surrogate.startswith(BESIDE_MODEL):
        model_path = str(getattr(config, "_name_or_path", "") or "")
        if not model_path:
            raise ValueError(
                f"`surrogate` {surrogate!r} is a folder of the model's directory or Hub repo, but this model was not "
                "loaded from one (its config has no `_name_or_path`); give the surrogate's directory or repo id."
            )
        revision = getattr(config, "_commit_hash", None)  # (a Hub model: the commit it was loaded from)
        surrogate = Surrogate.load(model_path, revision=revision, subfolder=surrogate[len(BESIDE_MODEL) :])
    if surrogate is None:
        surrogate = shipped_surrogate(config)
        if surrogate is None:
            raise ValueError(
                "KVzapCache needs a `surrogate` trained for this model: a directory or Hub repo id written by "
                "`hf-kvcache train-kvzap --model M --out DIR` (one is shipped for the offline SmolLM2-135M only)."
            )
    if not isinstance(surrogate, Surrogate):
        surrogate = Surrogate.load(surrogate)
    surrogate.check_model(config)
    return surrogate


class KVzapCache(KVzipCache):
    """KVzap (arXiv 2601.07891): KVzip's model-wide placement by scores a trained surrogate predicts from each layer's
    attention inputs (see the module docstring); `compress="always"` also evicts during decode."""

    cache_name = "kvzap"
    size_keys = ("budget",)

    def __init__(
        self,
        config_or_model,
        budget: int | float | None = None,
        surrogate=None,
        sinks: int = 4,
        recent: int | None = None,
        head_budget: str = "adaptive",
        safeguard: float = 0.2,
        layer_budget: str = "adaptive",
        precision: str | dict = "full",
        compress: str = "prompt",
        layers: dict | list | None = None,
    ):
        mode = require_choice("compress", compress, ("prompt", "always"))
        self._default_window = recent is None  # `default_window` (a ratio budget's: once the prompt is known)
        if recent is None:
            token_budget = isinstance(budget, int) and not isinstance(budget, bool)
            recent = default_window(mode, budget) if token_budget else RECENT
        recent = require_int("recent", recent, 0)
        if isinstance(surrogate, os.PathLike):
            surrogate = os.fspath(surrogate)
        if surrogate is not None and not isinstance(surrogate, (str, Surrogate)):
            raise ValueError(
                f"`surrogate` must be a Surrogate, a directory, a Hub repo id, '{BESIDE_MODEL}FOLDER' (inside the "
                f"model's own) or a builtin name ({', '.join(BUILTIN)}), got {type(surrogate).__name__}."
            )
        self.surrogate_spec, self.surrogate = surrogate, None
        if hasattr(config_or_model, "config"):  # a model: load and check the surrogate now (else at the first forward)
            self.surrogate = _resolve_surrogate(surrogate, config_or_model.config.get_text_config())
        self._predicted: dict[int, list[torch.Tensor]] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        super().__init__(
            config_or_model,
            budget=budget,
            sinks=sinks,
            recent=recent,
            head_budget=head_budget,
            safeguard=safeguard,
            layer_budget=layer_budget,
            request_ids={"first": [0], "next": [], "suffix": []},  # (no reconstruction: never sent)
            precision=precision,
            layers=layers,
        )
        self.compress = mode

    @classmethod
    def bundle(cls, cache_config: dict, model_dir: str) -> dict:
        """A `surrogate` given as an object or a local directory is saved into `model_dir/kvzap_surrogate` and
        published as "model:kvzap_surrogate" (a builtin name, a Hub repo id or None is published as given)."""
        surrogate = cache_config.get("surrogate")
        local = isinstance(surrogate, (str, os.PathLike)) and os.path.isdir(surrogate) and surrogate not in BUILTIN
        if not isinstance(surrogate, Surrogate) and not local:
            return cache_config
        if local:
            surrogate = Surrogate.load(surrogate)
        surrogate.save(os.path.join(model_dir, PUBLISHED_FOLDER))
        return {**cache_config, "surrogate": BESIDE_MODEL + PUBLISHED_FOLDER}

    # -- the attention inputs -------------------------------------------------------------------------------------
    def before_forward(self, model, arguments: dict) -> None:
        modules = [module for _, module in attention_modules(model)]
        if not all(getattr(module, _HOOKED, False) for module in modules):  # once per model (and its base model):
            capture_attention_inputs(model, _to_active_cache)  # the hooks hand inputs to whichever cache is active
            for module in modules:
                setattr(module, _HOOKED, True)
        if self.surrogate is None:  # (built from a config: load and check it before any token is generated)
            self.surrogate = _resolve_surrogate(self.surrogate_spec, model.config.get_text_config())
        self._hidden = {}
        super().before_forward(model, arguments)

    def attention_input(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """The attention input of layer `layer_idx` in the current forward: the context's are scored now (while it
        is collected); after it is placed, the placed layer's scorer reads them (`_hidden`)."""
        if layer_idx not in self._scoring_layers or self._reconstructing:
            return
        if self._compressed:
            self._hidden[layer_idx] = hidden
        else:
            self._predicted.setdefault(layer_idx, []).append(self.surrogate.predict(layer_idx, hidden))

    def _requests_for(self, model) -> dict[str, list[int]]:
        return {}  # (no reconstruction request)

    # -- scoring and placement --------------------------------------------------------------------------------------
    @torch.no_grad()
    def score_context(self, model) -> list[torch.Tensor]:
        """The context's predicted log scores per scoring layer [B, Hkv, context], as KVzip's `score_context` gives
        the measured ones (no forwards: predicted as the context was prefilled)."""
        if self._compressed:
            raise RuntimeError("KVzapCache.score_context: the context is already placed; score before compressing.")
        if self._default_window and isinstance(self.budget, float):  # the budget of this prompt is known now
            context = next(iter(self._scoring_layers.values())).seen
            self.recent = default_window(self.compress, resolve_size("budget", self.budget, context))
        scores = []
        for index, layer in self._scoring_layers.items():
            parts = self._predicted.get(index)
            if not parts or sum(p.shape[-1] for p in parts) != layer.seen:
                raise RuntimeError(
                    f"KVzapCache: layer {index} holds {layer.seen} context tokens but the surrogate scored "
                    f"{sum(p.shape[-1] for p in parts or [])}: its attention inputs were not all seen (a forward "
                    "ran without the model's hooks?)."
                )
            layer.policy.context_scores = torch.cat(parts, -1).to(layer.store.keys.device)
            scores.append(layer.policy.context_scores)
        self._predicted = {}
        return scores

    def _placement_scorer(self, layer_idx: int) -> KVzap:
        return KVzap(
            hidden=lambda: self._hidden[layer_idx],
            predict=lambda hidden: self.surrogate.predict(layer_idx, hidden),
        )

    def reset(self):
        super().reset()
        self._predicted, self._hidden = {}, {}

    def _map_context(self, fn) -> None:
        super()._map_context(fn)
        self._predicted = {index: [fn(p) for p in parts] for index, parts in self._predicted.items()}
