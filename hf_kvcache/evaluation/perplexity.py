"""Perplexity of a long stream through a cache, in two modes.

- "stream" (exact): the StreamingLLM protocol of `hf_kvcache.evaluation.streaming.stream_nll`: one token per
  forward, each token scored with exactly the cache state decoding would give it.
- "chunked" (faster, approximate): tokens are fed `chunk` at a time and every token of a chunk is scored by that
  forward. The approximation: inside a chunk, tokens attend to each other and to the cache as it was *before* the
  chunk; the cache evicts only after the chunk is written. So a token can see up to `chunk - 1` more recent tokens
  than one-token decoding would keep (a window-W cache behaves like a window between W and W + chunk - 1), and
  score-based policies (H2O) update their scores once per chunk. With a cache that never evicts both modes give the
  same NLLs (tested). Use it for quick sweeps; report "stream" numbers.

NLLs are float64 and indexed like `stream_nll`: `nlls[t] = -log p(ids[t + 1] | ids[: t + 1])`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..integration.cache_argument import cache_kwargs
from .streaming import bucket_perplexity, perplexity, stream_nll

__all__ = ["MODES", "chunked_nll", "run_perplexity"]

MODES = ("stream", "chunked")


@torch.inference_mode()
def chunked_nll(
    model,
    input_ids: torch.Tensor,
    cache_factory: Callable[[], object],
    chunk: int = 64,
    progress: bool = False,
    desc: str = "chunked",
) -> np.ndarray:
    """NLLs of `input_ids` fed `chunk` tokens per forward through `cache_factory()` (see the module docstring for
    the approximation)."""
    if chunk < 1:
        raise ValueError(f"`chunk` must be >= 1, got {chunk}.")
    ids = input_ids.reshape(-1)
    n = ids.numel()
    if n < 2:
        raise ValueError(f"Need at least 2 tokens to score one, got {n}.")
    device = next(model.parameters()).device
    cache = cache_factory()
    nlls = np.empty(n - 1, dtype=np.float64)
    starts = range(0, n - 1, chunk)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=desc, unit="chunk", leave=False)
    for start in starts:
        end = min(start + chunk, n - 1)
        x = ids[start:end].view(1, -1).to(device)
        logits = model(input_ids=x, **cache_kwargs(cache), use_cache=True).logits[0].double()
        target = ids[start + 1 : end + 1].to(device)
        nll = torch.logsumexp(logits, -1) - logits.gather(-1, target[:, None])[:, 0]
        nlls[start:end] = nll.cpu().numpy()
    return nlls


def run_perplexity(
    model,
    input_ids: torch.Tensor,
    cache_factory: Callable[[], object],
    mode: str = "stream",
    chunk: int = 64,
    bucket: int = 1024,
    progress: bool = False,
    **stream_kwargs,
) -> dict:
    """{"ppl", "tokens", "protocol", "buckets": [per-bucket rows], "nlls"} for one cache.
    `stream_kwargs` go to `stream_nll` (checkpoint, tag, ...) in "stream" mode."""
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
    if mode == "stream":
        nlls = stream_nll(model, input_ids, cache_factory, progress=progress, **stream_kwargs)
        protocol = "stream (one token per forward, exact)"
    else:
        nlls = chunked_nll(model, input_ids, cache_factory, chunk=chunk, progress=progress)
        protocol = f"chunked ({chunk} tokens per forward; a token may see up to {chunk - 1} tokens past the budget)"
    return {
        "ppl": perplexity(nlls),
        "tokens": int(nlls.size),
        "protocol": protocol,
        "buckets": bucket_perplexity(nlls, bucket),
        "nlls": nlls,
    }
