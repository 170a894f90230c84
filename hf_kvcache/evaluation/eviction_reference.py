"""Prompt eviction as `generate` would run it, one request alone: the reference the paged eviction
(hf_kvcache.paged.eviction) is checked against, in the tests (token for token) and on the needle tasks (the server's
accuracy against the same method through `generate`, eval/ruler_http.py --through generate).

The prompt is prefilled into a DynamicCache (every `chunk` tokens, then compressed, when the spec has a chunk); each
layer then keeps the tokens `kept_positions` chooses from the same scorer's scores (hf_kvcache.paged.prompt_scores),
and greedy decoding continues at the original positions (position ids from the prompt's length, the cache holding only
the kept tokens). Methods whose scorer reads the keys (keydiff, knorm), nothing (sink_window) or the attention inputs
(kvzap: "arrived"); the queries (SnapKV) would need the model's own query projection and rotation, so those are not
offered here (the tests rebuild them for Llama).
"""

from __future__ import annotations

import torch

from ..integration.attention_inputs import capture_attention_inputs
from ..integration.cache_argument import cache_kwargs
from ..paged.compress_spec import METHODS as SPEC_METHODS
from ..paged.compress_spec import CompressSpec
from ..paged.eviction_checks import for_model, surrogate_for
from ..paged.prompt_scores import kept_positions, prompt_scorer, reads, token_scores
from ..scorers.base import Prompt

#: the methods whose scorer reads no queries
METHODS = tuple(m for m in SPEC_METHODS if "queries" not in reads(m))


@torch.inference_mode()
def generate_with_eviction(
    model, prompt: list[int], spec: CompressSpec | None, max_new_tokens: int, eos=None
) -> list[int]:
    """Greedy tokens of `prompt` when each layer keeps what `spec` keeps of it (None: everything; see the module
    docstring); stops after `eos` (an id or a collection of ids) or `max_new_tokens` tokens."""
    from transformers import DynamicCache

    spec = for_model(spec, model.config.get_text_config())
    if spec is not None and spec.method not in METHODS:
        raise ValueError(f"`spec.method` must be one of {METHODS} for the reference, got {spec.method!r}.")
    device = next(model.parameters()).device
    stops = set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
    cache = DynamicCache()
    wanted = spec is not None and "arrived" in reads(spec.method)
    config = model.config.get_text_config()
    arrived: dict[int, torch.Tensor] = {}  # "arrived" (kvzap): the scores of the rows held, per layer
    length = len(prompt)
    step = (spec and spec.every()) or length
    seen = held = 0
    hidden: dict[int, torch.Tensor] = {}  # "arrived": each layer's attention inputs of the latest piece
    for start in range(0, length, step):
        piece = prompt[start : start + step]
        with capture_attention_inputs(model, lambda i, h: hidden.__setitem__(i, h) if wanted else None):
            logits = model(
                torch.tensor([piece], device=device),
                position_ids=torch.arange(seen, seen + len(piece), device=device)[None],
                cache_position=torch.arange(held, held + len(piece), device=device),
                use_cache=True,
                logits_to_keep=1,
                **cache_kwargs(cache),
            ).logits
        seen, held = seen + len(piece), held + len(piece)
        if spec is not None:
            held = _compress(cache, spec, spec.kept_so_far(seen, length), held, hidden, arrived, config, device)
    token = int(logits[0, -1].argmax())
    tokens = [token]
    for index in range(max_new_tokens - 1):
        if token in stops:
            break
        out = model(
            torch.tensor([[token]], device=device),
            position_ids=torch.tensor([[length + index]], device=device),
            cache_position=torch.tensor([held + index], device=device),
            use_cache=True,
            **cache_kwargs(cache),
        )
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
    return tokens


def _compress(cache, spec: CompressSpec, budget: int, held: int, hidden, arrived, config, device) -> int:
    """Each layer of `cache` keeps `budget` of its `held` rows (spec.kept_so_far: the whole prompt's budget, or all
    while fewer are held); returns the rows held after."""
    kept = min(budget, held)
    wanted = reads(spec.method)
    surrogate = surrogate_for(spec, config) if "arrived" in wanted else None
    for i, layer in enumerate(cache.layers):
        scorer = prompt_scorer(spec, i, surrogate)
        if "arrived" in wanted:
            new = scorer.score_arrivals(hidden[i])[0]
            arrived[i] = new if i not in arrived else torch.cat((arrived[i], new), -1)
        prompt = Prompt(keys=layer.keys[0] if "keys" in wanted else None, arrived=arrived.get(i))
        positions = kept_positions(spec, held, token_scores(scorer, prompt), device=device, kept=kept)
        layer.keys, layer.values = layer.keys[:, :, positions], layer.values[:, :, positions]
        if i in arrived:
            arrived[i] = arrived[i][:, positions]
    return kept


# -- head pages (kv_compress_layout "head"): every (layer, KV head) keeps its own tokens ------------------------------
#: the attention implementation the head-pages reference runs: sdpa, with the prompt tokens each (layer, KV head)
#: evicted masked for its query heads (registered through transformers' public AttentionInterface)
HEAD_MASKED = "hf_kvcache_head_mask_reference"
_head_masks: dict[int, torch.Tensor] = {}  # layer -> [Hkv, P] the prompt tokens each head keeps


def _head_masked_sdpa(module, query, key, value, attention_mask, **kwargs):
    from ..integration.attention import sdpa_attention_forward

    keep = _head_masks.get(module.layer_idx)
    if keep is not None:  # (one request, no padding: the causal mask of the new tokens is all the rest)
        heads, prompt = keep.shape
        q, k = query.shape[2], key.shape[2]
        bias = torch.zeros(1, query.shape[1], q, k, dtype=query.dtype, device=query.device)
        hidden = torch.where(keep, 0.0, float("-inf")).to(query.dtype).repeat_interleave(query.shape[1] // heads, 0)
        bias[..., :prompt] = hidden[None, :, None, :]
        positions = torch.arange(k, device=query.device)
        causal = positions[None, :] <= (k - q + torch.arange(q, device=query.device))[:, None]
        attention_mask = bias.masked_fill(~causal, float("-inf"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_head_masked() -> None:
    """Our own name in transformers' public attention registries (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    from ..integration.attention import sdpa_mask

    AttentionInterface.register(HEAD_MASKED, _head_masked_sdpa)
    AttentionMaskInterface.register(HEAD_MASKED, sdpa_mask)


@torch.inference_mode()
def generate_with_head_eviction(
    model, prompt: list[int], spec: CompressSpec, max_new_tokens: int, eos=None
) -> list[int]:
    """Greedy tokens of `prompt` when every (layer, KV head) keeps what head pages keep of it
    (hf_kvcache.paged.head_allotment: KVzipCache's allotment over the layers and heads), the evicted tokens masked
    for that head rather than moved (so positions are the original ones). Chunk by chunk (`spec.chunk`), each piece
    attends to what the heads kept of the pieces before it, and every head then keeps its share of what it holds.
    Methods: those of `generate_with_eviction`."""
    from transformers import DynamicCache

    from ..paged.head_allotment import kept_positions_per_head

    spec = for_model(spec, model.config.get_text_config())
    if spec.method not in METHODS:
        raise ValueError(f"`spec.method` must be one of {METHODS} for the reference, got {spec.method!r}.")
    _register_head_masked()
    device = next(model.parameters()).device
    config = model.config.get_text_config()
    surrogate = surrogate_for(spec, config) if "arrived" in reads(spec.method) else None
    stops = set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
    cache, length, seen, held = DynamicCache(), len(prompt), 0, 0
    keep: dict[int, torch.Tensor] = {}  # layer -> [Hkv, seen]
    arrivals: dict[int, torch.Tensor] = {}  # layer -> [Hkv, seen]: "arrived" scores
    configs = {id(c): c for c in (model.config, config)}.values()
    saved = [(c, c._attn_implementation) for c in configs]
    for c, _ in saved:
        c._attn_implementation = HEAD_MASKED
    hidden: dict[int, torch.Tensor] = {}  # "arrived": each layer's attention inputs of the latest piece

    def record(i: int, h: torch.Tensor) -> None:
        if surrogate is not None:
            hidden[i] = h

    try:
        step = spec.every() or length
        for start in range(0, length, step):
            piece = prompt[start : start + step]
            _head_masks.clear()
            _head_masks.update(keep)
            with capture_attention_inputs(model, record):
                logits = model(
                    torch.tensor([piece], device=device),
                    position_ids=torch.arange(seen, seen + len(piece), device=device)[None],
                    use_cache=True,
                    logits_to_keep=1,
                    **cache_kwargs(cache),
                ).logits
            seen, held = seen + len(piece), held + len(piece)
            heads = cache.layers[0].keys.shape[1]
            for i in range(len(cache.layers)):
                new = torch.ones(heads, len(piece), dtype=torch.bool, device=device)
                keep[i] = new if i not in keep else torch.cat([keep[i], new], 1)
                if surrogate is not None:
                    scored = prompt_scorer(spec, i, surrogate).score_arrivals(hidden[i])[0]
                    arrivals[i] = scored if i not in arrivals else torch.cat([arrivals[i], scored], 1)
            kept = min(spec.kept_so_far(seen, length), held)
            if kept < held:
                scores = [
                    _held_scores(prompt_scorer(spec, i, surrogate), layer.keys[0], keep[i], arrivals.get(i))
                    for i, layer in enumerate(cache.layers)
                ]
                local = kept_positions_per_head(spec, scores, kept)
                for i in range(len(cache.layers)):
                    for h in range(heads):
                        positions = keep[i][h].nonzero()[:, 0]
                        keep[i][h] = False
                        keep[i][h, positions[local[i * heads + h]]] = True
                held = -(-sum(p.numel() for p in local) // len(local))  # (the request's length in head pages)
        token = int(logits[0, -1].argmax())
        tokens = [token]
        _head_masks.clear()
        _head_masks.update(keep)
        for index in range(max_new_tokens - 1):
            if token in stops:
                break
            out = model(
                torch.tensor([[token]], device=device),
                position_ids=torch.tensor([[length + index]], device=device),
                use_cache=True,
                **cache_kwargs(cache),
            )
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
    finally:
        for c, implementation in saved:
            c._attn_implementation = implementation
        _head_masks.clear()
    return tokens


def _held_scores(scorer, keys, keep, arrivals) -> list[torch.Tensor]:
    """Each head's scores over the tokens it holds (keys [Hkv, seen, D], keep [Hkv, seen]): scored as the layer's
    whole when the heads hold as many tokens, else head by head, as head pages score them."""
    heads = keys.shape[0]
    if scorer is None:  # sink_window
        return [torch.zeros(int(keep[h].sum()), device=keys.device) for h in range(heads)]
    if arrivals is not None:
        own = [arrivals[h][keep[h]] for h in range(heads)]
        if len({a.numel() for a in own}) == 1:
            return list(scorer.score(Prompt(arrived=torch.stack(own))).float())
        return [scorer.score(Prompt(arrived=a[None]))[0].float() for a in own]
    held = [keys[h][keep[h]] for h in range(heads)]
    if len({k.shape[0] for k in held}) == 1:
        return list(scorer.score(Prompt(keys=torch.stack(held))).float())
    return [scorer.score(Prompt(keys=k[None]))[0].float() for k in held]
