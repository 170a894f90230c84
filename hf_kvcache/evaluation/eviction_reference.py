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
from ..paged.eviction_checks import surrogate_for
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

    if spec is not None and spec.method not in METHODS:
        raise ValueError(f"`spec.method` must be one of {METHODS} for the reference, got {spec.method!r}.")
    device = next(model.parameters()).device
    stops = set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
    cache = DynamicCache()
    wanted = spec is not None and "arrived" in reads(spec.method)
    config = model.config.get_text_config()
    arrived: dict[int, torch.Tensor] = {}  # "arrived" (kvzap): the scores of the rows held, per layer
    length = len(prompt)
    step = length if spec is None or spec.chunk is None else spec.chunk
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
            held = _compress(cache, spec, seen, held, hidden, arrived, config, device)
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


def _compress(cache, spec: CompressSpec, seen: int, held: int, hidden, arrived, config, device) -> int:
    """Each layer of `cache` keeps spec.kept(seen) of its `held` rows (the prompt's `seen` tokens so far); returns
    the rows held after."""
    kept = min(spec.kept(seen), held)
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
