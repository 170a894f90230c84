"""KVzip (arXiv 2505.23416): compress the prompt once, by what the model needs to reconstruct it (query-agnostic).

    cache = KVzipCache(model, budget=0.2)            # keep 20% of the prompt's tokens per KV head
    out = model.generate(**inputs, cache=cache)      # or cache_implementation="kvzip", cache_config={"budget": 0.2}

What happens (hf_kvcache.policies.kvzip for the scores):
1. The prompt (the context) is prefilled into full-precision layers that keep every token; its token ids, padding and
   positions are recorded.
2. At the end of the prompt - before the first one-token forward (the first decode step of `generate`), before the
   next forward after `cache.end_prompt()`, or when the caller runs `cache.compress_context(model)` - the cache runs the
   model's base model on the reconstruction request followed by the context, `chunk_size` context tokens per
   forward, against the stored context: each context token scores the largest attention it gets. The request's
   tokens are then removed again (the other layers of the model - sliding windows, layers of other caches - are
   restored as they were). `cache.score_context(model)` does this step alone and returns the scores, leaving the
   context unplaced (KVzap, hf_kvcache.evaluation.kvzap_training, learns to predict them).
3. Each layer places the context at its budget by those scores and frees the full-precision copy; later tokens are
   appended uncompressed (`compress="prompt"`). By default the budget is model-wide, as the KVzip paper and kvpress
   allot it: the best `budget x kv_heads x layers` (head, token) pairs over the whole model are kept
   (`layer_budget="adaptive"`), each layer's share in one slot pool allotted to its heads by score
   (`head_budget="adaptive"`, every head at least `safeguard x budget`). `layer_budget="uniform"` gives every layer
   the same share; `head_budget="uniform"` every KV head `budget` tokens (both measured far worse: docs/defaults.md).

Cost: the reconstruction forwards process about the context's length again (plus the request), attending to the
context too: on SmolLM2 with a 2K prompt, prefill plus reconstruction took 4.0x a plain prefill on CPU
(eval/results/kvzip/prefill_cost.json). Peak memory is the full context's KV plus one chunk's.

The request is text, tokenized with `tokenizer` (a name, a path or a tokenizer object; default the model's own
`name_or_path`, loaded at the first forward so a missing tokenizer fails before any token is generated) or given
as ids (`request_ids`: {"first": [...], "next": [...], "suffix": [...]}, e.g. for a model without one). As
kvpress's KVzipPress: "\\n\\nRepeat the previous context exactly." for the first chunk, "\\n\\nRepeat the part of the
previous context exactly, starting with" plus the previous chunk's last 8 tokens for the others, then the chat
template's assistant prefix (a newline without a template), then the chunk.
"""

from __future__ import annotations

import copy
import math

import torch

from ..common.validation import require_choice, require_int
from ..integration.cache_argument import cache_kwargs
from ..layers.layer import CompressedLayer
from ..policies.heavy_hitter import resolve_size
from ..policies.kvzip import ReconstructionScoringPolicy, layer_budgets
from ..policies.prompt_mode import PromptCompressionPolicy
from ..policies.scored import ScoredPolicy
from ..scorers.kvzip import KVzip
from ..stores import FullPrecisionStore
from ..stores.workspace import DequantWorkspace
from .base import KVCache
from .head_budget import check_head_budget, check_pool_fits, check_precision, quantized_key_rotation, with_head_budget
from .kvzip_request import (
    PREVIOUS_TAIL,
    _check_request_ids,
    check_request_vocabulary,
    request_ids_for_model,
)
from .scorers import _budget, _recent

LAYER_BUDGETS = ("uniform", "adaptive")


class KVzipCache(KVCache):
    """KVzip (arXiv 2505.23416): per row and KV head, the `budget` context tokens that receive the most attention
    while the model reconstructs the context (the first `sinks` always kept); prompt compression only (see the
    module docstring for how, and what it costs). `precision`: the placed tokens' format, "full" (the model's dtype)
    or a per-token quantized format ("fp8_e4m3", "int8", "int4" ... or a spec dict: hf_kvcache.stores.quantization),
    so eviction and quantization multiply: at FP8, twice the tokens in the same bytes."""

    cache_name = "kvzip"
    size_keys = ("budget",)

    def __init__(
        self,
        config_or_model,
        budget: int | float | None = None,
        sinks: int = 4,
        recent: int = 0,
        chunk_size: int = 2048,
        head_budget: str = "adaptive",
        safeguard: float = 0.2,
        layer_budget: str = "adaptive",
        tokenizer=None,
        request_ids: dict | None = None,
        precision: str | dict = "full",
        compress: str = "prompt",
        layers: dict | list | None = None,
    ):
        require_choice("compress", compress, ("prompt",))  # (scores need model forwards: never at decode time)
        self.budget = _budget(budget)
        self.sinks = require_int("sinks", sinks, 0)
        self.recent = _recent(recent, self.budget)
        self.chunk_size = require_int("chunk_size", chunk_size, 1)
        self.head_budget, self.safeguard = check_head_budget(head_budget, safeguard)
        self.layer_budget = require_choice("layer_budget", layer_budget, LAYER_BUDGETS)
        self.precision = precision
        check_precision(precision)
        self.workspace = DequantWorkspace()  # the quantized layers' shared read scratch (empty until one reads)
        encodes = callable(getattr(tokenizer, "encode", None))
        if tokenizer is not None and not isinstance(tokenizer, str) and not encodes:
            raise ValueError(
                f"`tokenizer` must be a name or path, or a tokenizer (with `encode`), got {type(tokenizer).__name__}."
            )
        self.tokenizer, self.request_ids = tokenizer, _check_request_ids(request_ids)
        # (set after the layers are built: KVCache wraps a "prompt" cache's policies for prompt mode, and these
        # layers collect the context instead; their placed successors are wrapped in `_placed_layer`)
        super().__init__(config_or_model, lambda cfg: (ReconstructionScoringPolicy(), FullPrecisionStore()), layers)
        self.compress = "prompt"
        self._scoring_layers = {
            layer.layer_idx: layer
            for layer in self.compressed_layers
            if isinstance(layer.policy, ReconstructionScoringPolicy)
        }
        check_pool_fits(self.head_budget, self.config)  # (now, not when the context is placed)
        self._forget_context()
        self._requests: dict[str, list[int]] | None = self.request_ids

    def _layer_from_settings(self, config, settings: dict, index: int) -> CompressedLayer:
        layer = super()._layer_from_settings(config, settings, index)
        if isinstance(layer.policy, ReconstructionScoringPolicy):  # this layer's own budget etc. when placed
            own = {k: v for k, v in settings.items() if k != "cache"}
            layer.placement_settings = own
        return layer

    # -- the context ------------------------------------------------------------------------------------------
    def _forget_context(self) -> None:
        self._ids, self._real, self._positions = [], [], []
        self._record_next = None  # the input ids of the forward being announced (recorded once, not per nested hook)
        self._last_ids = None
        self._compressed = False
        self._ended = False  # `end_prompt()`: the next forward compresses first
        self._reconstructing = False

    def before_forward(self, model, arguments: dict) -> None:
        if self._reconstructing or self._compressed or not self._scoring_layers:
            return
        ids = arguments.get("input_ids")
        x = ids if ids is not None else arguments.get("inputs_embeds")
        if self._ids and (x.shape[1] == 1 or self._ended):
            self.compress_context(model)
            return
        if ids is None:
            raise ValueError(
                "KVzipCache reconstructs the context from its token ids: call the model with "
                "`input_ids`, not `inputs_embeds`."
            )
        if ids is self._last_ids:  # the same forward announced again by a nested model (its base model)
            return
        self._requests_for(model)  # a missing tokenizer fails now, before any token is generated
        self._record_next = self._last_ids = ids

    def begin_forward(self, q_len, batch, device, attention_mask=None, position_ids=None) -> None:
        super().begin_forward(q_len, batch, device, attention_mask, position_ids)
        if self._record_next is not None:
            self._ids.append(self._record_next.to(device))
            self._real.append(self.forward_info.real.clone())
            self._positions.append(self.forward_info.positions.clone())
            self._record_next = None

    def end_prompt(self) -> None:
        """End the context here: the next forward first compresses it (call `compress_context(model)` to do it now)."""
        if self._compressed:
            super().end_prompt()
        elif self._ids:
            self._ended = True

    def _requests_for(self, model) -> dict[str, list[int]]:
        if self._requests is None:
            self._requests = request_ids_for_model(self.tokenizer, model)
        check_request_vocabulary(self._requests, getattr(self.config, "vocab_size", None))
        return self._requests

    # -- compression ------------------------------------------------------------------------------------------
    @property
    def scoring_layer_indices(self) -> list[int]:
        """The indices of the layers KVzip scores and places (full attention, not kept by `layers`), in order: the
        layers of `score_context`'s list."""
        return list(self._scoring_layers)

    @torch.no_grad()
    def score_context(self, model) -> list[torch.Tensor]:
        """Score the recorded context by reconstructing it with `model`, without placing it: per scoring layer
        (`scoring_layer_indices`, in layer order), the largest attention each context token gets, [B, Hkv, context]
        float32 (0 for padding). The layers keep holding the whole context uncompressed (the reconstruction's tokens
        are cropped again), so `compress_context` can place it afterwards; KVzap trains on these scores."""
        if self._compressed:
            raise RuntimeError("KVzipCache.score_context: the context is already placed; score before compressing.")
        if not self._ids:
            raise RuntimeError("KVzipCache.score_context: no context yet; run the prompt through the model first.")
        ids, real, positions = self._context()
        context = ids.shape[1]
        scoring = list(self._scoring_layers.values())
        if any(layer.seen != context for layer in scoring):
            raise RuntimeError(
                f"KVzipCache.score_context: the layers hold {scoring[0].seen} tokens but {context} "
                "context tokens were recorded; a forward bypassed the cache's announcement."
            )
        requests = self._requests_for(model)
        base = getattr(model, "base_model", model)
        self._reconstructing = True
        try:
            for repeat, repeat_real, repeat_pos, targets, columns in self._chunks(ids, real, positions, requests):
                others = self._snapshot_others()
                for layer in scoring:
                    layer.policy.begin_scoring(context, targets, columns)
                try:
                    base(
                        input_ids=repeat,
                        attention_mask=torch.cat((real, repeat_real), 1).long(),
                        position_ids=repeat_pos,
                        use_cache=True,
                        **cache_kwargs(self),
                    )
                finally:
                    for layer in scoring:
                        layer.policy.end_scoring()
                        layer.crop(context - layer.seen)
                    self._restore_others(others)
        finally:
            self._reconstructing = False
        return [layer.policy.context_scores for layer in scoring]

    @torch.no_grad()
    def compress_context(self, model) -> None:
        """Score the recorded context by reconstructing it with `model` and place every layer at its budget now."""
        if self._compressed:
            return
        if not self._ids:
            raise RuntimeError("KVzipCache.compress_context: no context yet; run the prompt through the model first.")
        self.score_context(model)
        ids, real, positions = self._context()
        context = ids.shape[1]
        scoring = list(self._scoring_layers.values())
        totals = self._layer_totals(scoring, real, positions) if self.layer_budget == "adaptive" else {}
        # the context is written into the placed layers as one announced forward (each layer reads its validity and
        # positions from it, on its own device)
        self.forward_info.begin(context, ids.shape[0], real.device, 0, attention_mask=real, position_ids=positions)
        for layer in scoring:
            self._place(layer, totals.get(layer.layer_idx))
        self._compressed = True
        self._ids, self._real, self._positions = [], [], []

    def _context(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The recorded context: (token ids, validity, position ids), each [B, context]."""
        return tuple(torch.cat(parts, 1) for parts in (self._ids, self._real, self._positions))

    def _chunks(self, ids, real, positions, requests):
        """Per chunk: (request + suffix + chunk ids [B, r] left-padded, their validity, position ids, the chunk's
        context columns [B, context], the columns its scores are normalised over [B, context + r])."""
        batch, _context = ids.shape
        rank = real.long().cumsum(1) - 1  # each real token's index among its row's real tokens
        counts = real.sum(1).tolist()
        last = torch.where(real, positions, -1).amax(1)
        rows = [ids[b][real[b]].tolist() for b in range(batch)]
        for k in range(max(1, math.ceil(max(counts) / self.chunk_size))):
            start, end = k * self.chunk_size, (k + 1) * self.chunk_size
            sequences = []
            for row in rows:
                request = requests["first"] if k == 0 else requests["next"] + row[max(0, start - PREVIOUS_TAIL) : start]
                sequences.append(request + requests["suffix"] + row[start:end])
            width = max(len(s) for s in sequences)
            repeat = torch.zeros(batch, width, dtype=ids.dtype, device=ids.device)
            repeat_real = torch.zeros(batch, width, dtype=torch.bool, device=ids.device)
            for b, sequence in enumerate(sequences):
                if sequence:
                    repeat[b, width - len(sequence) :] = torch.tensor(sequence, dtype=ids.dtype)
                    repeat_real[b, width - len(sequence) :] = True
            repeat_pos = (last[:, None] + repeat_real.long().cumsum(1)).masked_fill(~repeat_real, 1)
            targets = real & (rank >= start) & (rank < end)
            columns = torch.cat((real & ((rank < self.sinks) | targets), repeat_real), 1)
            yield repeat, repeat_real, repeat_pos, targets, columns

    def _snapshot_others(self) -> dict:
        """Copies of the layers the reconstruction must leave as they were (all but the scoring layers: sliding
        windows, other caches' layers), restored after each reconstruction forward."""
        memo = {id(self.forward_info): self.forward_info}
        return {i: copy.deepcopy(layer, memo) for i, layer in enumerate(self.layers) if i not in self._scoring_layers}

    def _restore_others(self, others: dict) -> None:
        for i, layer in others.items():
            self.layers[i] = layer

    def _settings(self, layer) -> dict:
        """The placement settings of `layer`: the cache's, with a per-layer setting (`layers`) winning."""
        return {
            "budget": self.budget,
            "sinks": self.sinks,
            "recent": self.recent,
            "head_budget": self.head_budget,
            "safeguard": self.safeguard,
            "precision": self.precision,
            **getattr(layer, "placement_settings", {}),
        }

    def _layer_totals(
        self, scoring: list[CompressedLayer], real: torch.Tensor, positions: torch.Tensor
    ) -> dict[int, int]:
        """Layer-adaptive budgets: each layer's share (tokens over its heads) of the model's budget, by score. The
        sinks count as the placing policy will keep them (ScoredPolicy.protect: position id below `sinks`)."""
        scores, budgets = [], []
        for layer in scoring:
            settings = self._settings(layer)
            budgets.append(self._scored_budget(settings, real.shape[1]))
            sink = real & (positions < settings["sinks"])
            ranked = layer.policy.context_scores.masked_fill(~real[:, None, :], float("-inf"))
            scores.append(ranked.masked_fill(sink[:, None, :], float("inf")))
        shares = layer_budgets(scores, budgets, scoring[0].policy.heads)
        return {layer.layer_idx: share for layer, share in zip(scoring, shares)}

    def _place(self, layer: CompressedLayer, total: int | None = None) -> None:
        """Replace `layer` (every context token in full precision) by the layer that keeps the context at its
        budget by the reconstruction scores (or at `total` tokens over its heads: layer-adaptive budgets); the
        full-precision copy is freed with the old layer."""
        if total is not None:  # the layer's allotment, plus its window (part of the model's budget)
            window, heads = self._settings(layer)["recent"], layer.policy.heads
            budget, total = max(1, total // heads) + window, total + window * heads  # (uniform heads: the average)
        else:
            budget = None
        placed = self._placed_layer(layer, layer.policy.context_scores, budget, total)
        keys, values = layer.store.read(layer.seen)
        placed.update(keys, values)
        if isinstance(placed.policy, PromptCompressionPolicy):
            placed.policy.end_prompt(placed.view)
        self.layers[layer.layer_idx] = placed
        layer.reset()  # (kept, empty, for `reset()`: a new context is collected by it again)

    def _placed_layer(self, layer: CompressedLayer, scores, budget: int | None, total: int | None) -> CompressedLayer:
        """The (empty) layer that holds `layer`'s context at its budget (`budget` per head and `total` for its pool
        when the model allots them), scored by `scores`."""
        settings = self._settings(layer)
        head_budget, safeguard = check_head_budget(settings["head_budget"], settings["safeguard"])
        scorer = self._placement_scorer(layer.layer_idx)
        scorer.context_scores = scores
        policy, store = with_head_budget(
            ScoredPolicy(
                budget or _budget(settings["budget"]),
                settings["recent"],
                scorer,
                sinks=settings["sinks"],
                total=total if head_budget == "adaptive" else None,
            ),
            head_budget,
            safeguard,
            check_precision(settings["precision"]),
            self.workspace,
            self.config,
        )
        if self.compress == "prompt":  # later tokens appended after the placed context
            policy = PromptCompressionPolicy(policy)
        placed = CompressedLayer(policy, store, self.forward_info, layer.layer_idx)
        placed.size_parameters = getattr(layer, "size_parameters", self.size_keys)
        if store is not None and hasattr(store, "key_spec") and store.key_spec.format != "none":
            # quantized keys are stored Hadamard-rotated, as QuantizedFP8Cache's (the bridge rotates the queries);
            # one matrix shared by the layers, as there
            if not hasattr(self, "_key_rotation"):
                self._key_rotation = quantized_key_rotation(self.config, layer.head_dim)
            placed.key_rotation = self._key_rotation
        return placed

    def _scored_budget(self, settings: dict, context: int) -> int:
        """The tokens per head a layer's scores allot: the budget less the `recent` window (the model-wide allotment
        shares what the windows leave)."""
        budget = resolve_size("budget", settings["budget"], context)
        if settings["recent"] >= budget:
            raise ValueError(
                f"`budget` ({budget} tokens of a {context}-token prompt) must be larger than `recent` "
                f"({settings['recent']}): the window is part of the budget."
            )
        return budget - settings["recent"]

    def _placement_scorer(self, layer_idx: int):
        """The scorer of a placed layer (handed the context's scores): KVzip's reconstruction scores."""
        return KVzip()

    # -- state files ------------------------------------------------------------------------------------------
    def state_phase(self) -> dict:
        if self._ids and not self._compressed:
            raise ValueError(
                "save_cache_state: this KVzipCache holds a context it has not compressed yet (a state "
                "file holds no token ids to reconstruct it from); save after the first decode step or "
                "`cache.compress_context(model)`."
            )
        return {"context_placed": self._compressed}

    def enter_state_phase(self, phase: dict, where: str) -> None:
        if phase.get("context_placed"):  # the placed layers, empty: the file's state is written into them
            for index, layer in self._scoring_layers.items():
                self.layers[index] = self._placed_layer(layer, None, None, None)
            self._compressed = True

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def reset(self):
        for index, layer in self._scoring_layers.items():  # back to the layers that collect a context
            self.layers[index] = layer
        super().reset()
        self._forget_context()

    def crop(self, tokens_to_remove: int) -> None:
        """After the context is placed, the appended tokens can be cropped; before, the context is not cropped: its
        end is where a one-token forward (or `end_prompt`) says, and assisted generation, which verifies candidate
        tokens in multi-token forwards and crops the rejected ones, would never let it end."""
        if self._ids and not self._compressed and tokens_to_remove:
            raise ValueError(
                "KVzipCache cannot crop the context it is collecting: it is compressed before the first one-token "
                "forward (or after `end_prompt()`), and assisted generation verifies candidates in multi-token "
                "forwards, so the context would never end. Use another cache for assisted generation, or call "
                "`cache.compress_context(model)` first."
            )
        super().crop(tokens_to_remove)

    def _map_context(self, fn) -> None:
        self._ids, self._real, self._positions = (
            [fn(t) for t in parts] for parts in (self._ids, self._real, self._positions)
        )

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self._map_context(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._map_context(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self._map_context(lambda t: t[indices])
