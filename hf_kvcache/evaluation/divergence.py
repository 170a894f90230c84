"""Divergence of a compressed cache from the full cache, on the same positions.

Protocol (`cache_logprobs`): the first `prompt_len` tokens are prefilled into the cache (one forward, or chunks of
`prefill_chunk`), then the following tokens are fed one per forward, teacher-forced: every scored position sees
exactly the cache state that decoding would give it. The log-probabilities of the next token at the last prompt
position and at each fed token are kept (float32, [n - prompt_len, vocab]).

The reference is the same protocol with the full cache (`DynamicCache`), or one forward over the whole sequence
without a cache (`full_sequence_logprobs`); both agree to float32 rounding (tested).

Metrics (`divergence_metrics`), per scored position, then aggregated:
- KL(p_ref || p_cache) = sum_v p_ref(v) (log p_ref(v) - log p_cache(v)), computed in float64: mean, p99, max;
- top-1 agreement: argmax equal; top-k agreement: |top-k(ref) & top-k(cache)| / k;
- NLL of the true next token under both, and the perplexities.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..integration.cache_argument import cache_kwargs

__all__ = ["cache_logprobs", "divergence", "divergence_metrics", "full_sequence_logprobs"]


def _device(model):
    return next(model.parameters()).device


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


@torch.inference_mode()
def prefill(model, ids: torch.Tensor, cache, chunk: int | None = None) -> torch.Tensor:
    """Feed `ids` [1, n] into `cache` (one forward or chunks of `chunk`); return the last position's logits [V]."""
    n = ids.shape[1]
    step = chunk if chunk else n
    logits = None
    for start in range(0, n, step):
        out = model(input_ids=ids[:, start : start + step], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
    return logits


@torch.inference_mode()
def cache_logprobs(
    model,
    input_ids: torch.Tensor,
    cache,
    prompt_len: int,
    prefill_chunk: int | None = None,
    progress: bool = False,
    desc: str = "score",
    after_prefill=None,
) -> torch.Tensor:
    """Log-probs [n - prompt_len, V] (float32) of the tokens after the prompt, through `cache`: row i predicts
    token `prompt_len + i`. The prompt is prefilled, then tokens are fed one per forward (teacher-forced).
    `after_prefill(cache)` is called once the prompt is prefilled, before the first one-token forward."""
    ids = input_ids.reshape(1, -1).to(_device(model))
    n = ids.shape[1]
    if not 1 <= prompt_len < n:
        raise ValueError(f"`prompt_len` must be in [1, {n - 1}] for {n} tokens, got {prompt_len}.")
    rows = [_log_softmax(prefill(model, ids[:, :prompt_len], cache, prefill_chunk))]
    if after_prefill is not None:
        after_prefill(cache)
    steps = range(prompt_len, n - 1)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc=desc, unit="tok", leave=False)
    for t in steps:
        out = model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
        rows.append(_log_softmax(out.logits[0, -1]))
    return torch.stack(rows).cpu()


@torch.inference_mode()
def full_sequence_logprobs(model, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The same rows as `cache_logprobs` from one forward over the whole sequence, no cache."""
    ids = input_ids.reshape(1, -1).to(_device(model))
    n = ids.shape[1]
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=n - prompt_len + 1).logits[0, :-1]
    return _log_softmax(logits).cpu()


def divergence_metrics(
    ref: torch.Tensor,
    test: torch.Tensor,
    targets: torch.Tensor | None = None,
    k: int = 5,
    return_per_position: bool = False,
) -> dict:
    """Compare log-prob rows [m, V] of the reference and of a cache. `targets` [m]: the true next tokens (for
    NLL/perplexity). KL is computed in float64."""
    if ref.shape != test.shape:
        raise ValueError(f"Shapes differ: reference {tuple(ref.shape)} vs cache {tuple(test.shape)}.")
    ref64, test64 = ref.double(), test.double()
    kl = (ref64.exp() * (ref64 - test64)).sum(-1).clamp_min(0.0)
    top1 = (ref.argmax(-1) == test.argmax(-1)).double()
    k = min(k, ref.shape[-1])
    ref_top = ref.topk(k, dim=-1).indices
    test_top = test.topk(k, dim=-1).indices
    overlap = (ref_top[:, :, None] == test_top[:, None, :]).any(-1).double().sum(-1) / k
    kl_np = kl.numpy()
    out = {
        "positions": int(ref.shape[0]),
        "kl_mean": float(kl_np.mean()),
        "kl_p99": float(np.percentile(kl_np, 99)),
        "kl_max": float(kl_np.max()),
        "top1_agreement": float(top1.mean()),
        f"top{k}_agreement": float(overlap.mean()),
    }
    if targets is not None:
        targets = targets.reshape(-1, 1).to(ref.device)
        nll_ref = -ref64.gather(-1, targets)[:, 0]
        nll_test = -test64.gather(-1, targets)[:, 0]
        out.update(
            nll_ref=float(nll_ref.mean()),
            nll=float(nll_test.mean()),
            ppl_ref=float(nll_ref.mean().exp()),
            ppl=float(nll_test.mean().exp()),
        )
    if return_per_position:
        out["kl"] = kl_np
    return out


def divergence(
    model,
    input_ids: torch.Tensor,
    cache_factory: Callable[[], object],
    prompt_len: int,
    reference: torch.Tensor | Callable[[], object] | None = None,
    prefill_chunk: int | None = None,
    k: int = 5,
) -> dict:
    """Divergence of the cache from `cache_factory()` from the reference on the tokens after the prompt.
    `reference`: precomputed reference log-probs, a cache factory, or None for `DynamicCache`."""
    ids = input_ids.reshape(1, -1)
    if reference is None:
        from transformers import DynamicCache

        reference = lambda: DynamicCache(config=model.config)  # noqa: E731
    if callable(reference):
        reference = cache_logprobs(model, ids, reference(), prompt_len, prefill_chunk)
    test = cache_logprobs(model, ids, cache_factory(), prompt_len, prefill_chunk)
    return divergence_metrics(reference, test, ids[0, prompt_len:].cpu(), k=k)
