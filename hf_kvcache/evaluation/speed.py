"""Speed relative to `DynamicCache`: prefill time and decode ms/token, measured interleaved in one run.

Each round runs every cache once, in a rotated order (so slow drift of a shared machine, thermal state or other
processes spreads over all caches instead of biasing one); a cache's figure is the median over rounds, and the
ratios are taken against the `DynamicCache` figures of the same run. A warm-up round is run and discarded.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ..integration.cache_argument import cache_kwargs

__all__ = ["measure_speed"]


@torch.inference_mode()
def _one(model, ids, factory, prompt_len: int, decode_tokens: int) -> tuple[float, float]:
    cache = factory()
    x = ids[:, :prompt_len]
    t0 = time.perf_counter()
    model(input_ids=x, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in range(prompt_len, prompt_len + decode_tokens):
        model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
    decode_ms = (time.perf_counter() - t0) * 1000 / decode_tokens
    return prefill_s, decode_ms


def measure_speed(
    model,
    input_ids: torch.Tensor,
    caches: dict[str, Callable[[], object]],
    prompt_len: int,
    decode_tokens: int = 32,
    rounds: int = 3,
    reference: str | None = None,
    progress: bool = False,
) -> list[dict]:
    """`caches`: {label: factory}. Returns one row per cache: prefill_s, decode_ms_per_token (medians) and their
    ratios to the reference (`reference` label, default: a "dynamic" DynamicCache added if absent)."""
    ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    if ids.shape[1] < prompt_len + decode_tokens:
        raise ValueError(f"Need {prompt_len + decode_tokens} tokens, got {ids.shape[1]}.")
    caches = dict(caches)
    if reference is None:
        reference = "dynamic"
        if reference not in caches:
            from transformers import DynamicCache

            caches = {reference: lambda: DynamicCache(config=model.config), **caches}
    if reference not in caches:
        raise ValueError(f"`reference` {reference!r} is not one of {list(caches)}.")
    labels = list(caches)
    times = {label: ([], []) for label in labels}
    warm = labels[0]
    _one(model, ids, caches[warm], min(prompt_len, 64), min(decode_tokens, 4))
    schedule = range(rounds)
    if progress:
        from tqdm.auto import tqdm

        schedule = tqdm(schedule, desc="speed rounds", leave=False)
    for r in schedule:
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for label in order:
            p, d = _one(model, ids, caches[label], prompt_len, decode_tokens)
            times[label][0].append(p)
            times[label][1].append(d)
    ref_p = statistics.median(times[reference][0])
    ref_d = statistics.median(times[reference][1])
    rows = []
    for label in labels:
        p, d = statistics.median(times[label][0]), statistics.median(times[label][1])
        rows.append(
            {
                "cache": label,
                "prefill_s": p,
                "decode_ms_per_token": d,
                "prefill_ratio": p / ref_p,
                "decode_ratio": d / ref_d,
                "rounds": rounds,
                "prompt_tokens": prompt_len,
                "decode_tokens": decode_tokens,
            }
        )
    return rows
