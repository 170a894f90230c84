"""The StreamingLLM perplexity protocol (arXiv 2309.17453, section 4.1): one token per forward, NLL of the next.

Why one token per forward: an evicting cache is only ever exercised the way it runs in decoding, i.e. each token
sees exactly the cache state that decoding would give it. Chunked or sliding-window-recompute evaluation would
score a different model (recompute is the upper bound StreamingLLM compares against, not the thing measured).

Why float64: the NLL of each token comes from a float64 log-softmax of the model's logits and is stored as
float64, so perplexities over tens of thousands of tokens do not carry float32 summation error.

Why checkpoints hold the cache itself: a run over 32K tokens takes tens of minutes on a CPU. The scores so far are
cheap to save, but the state that produced them is not recomputable cheaply or exactly: a sinks + window cache holds
a specific subset of tokens, and re-feeding the prefix in chunks would produce different keys/values than the
one-token-at-a-time run (chunked prefill lets tokens that will later be evicted be attended by the chunk). So a
checkpoint is `torch.save` of {NLLs so far, the whole cache object, metadata}; resuming loads it back with
`torch.load(weights_only=False)` and continues with bit-identical results. Checkpoints are written atomically at
step boundaries only (never from an exception handler: a forward interrupted half-way leaves some layers updated
and others not). A pickle is only valid for the code that wrote it (it stores attributes, not a versioned format),
so the checkpoint records a digest of the source of the hf_kvcache modules the cache is made of, and resuming under
changed code is refused unless explicitly allowed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import Cache

from ..integration.cache_argument import cache_kwargs

__all__ = ["bucket_perplexity", "load_checkpoint", "perplexity", "read_progress", "stream_nll"]


def _tokens_digest(ids: torch.Tensor) -> str:
    return hashlib.sha1(ids.detach().cpu().to(torch.int64).numpy().tobytes()).hexdigest()


def _code_digest(cache) -> str:
    """sha1 of the source files of the hf_kvcache modules whose classes (and base classes) make up `cache`."""
    modules: set[str] = set()
    seen: set[int] = set()

    def walk(obj, depth: int) -> None:
        if depth > 8 or id(obj) in seen or isinstance(obj, torch.Tensor):
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, depth + 1)
            return
        if isinstance(obj, dict):
            for item in obj.values():
                walk(item, depth + 1)
            return
        ours = [c.__module__ for c in type(obj).__mro__ if c.__module__.startswith("hf_kvcache")]
        modules.update(ours)
        if ours and hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                walk(item, depth + 1)

    walk(cache, 0)
    digest = hashlib.sha1()
    for name in sorted(modules):
        module = sys.modules.get(name)
        source = getattr(module, "__file__", None)
        digest.update(name.encode())
        if source and os.path.isfile(source):
            digest.update(Path(source).read_bytes())
    return digest.hexdigest()


def _atomic(path: Path, write: Callable[[str], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(str(tmp))
    os.replace(tmp, path)


def _save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object: np.save would append ".npy" to the temporary name
        np.save(f, array)


def _save(path: Path, nlls: np.ndarray, cache: Cache, meta: dict) -> None:
    """The .pt file is authoritative; the .nlls.npy and .json sidecars let reports read progress without loading
    the cache (hundreds of MB for a dense cache at 12K tokens)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic(path, lambda p: torch.save({"nlls": nlls, "cache": cache, "meta": meta}, p))
    _atomic(Path(str(path) + ".nlls.npy"), lambda p: _save_npy(p, nlls))
    _atomic(Path(str(path) + ".json"), lambda p: Path(p).write_text(json.dumps(meta, indent=1)))


def load_checkpoint(path: str | os.PathLike) -> dict:
    """{"nlls": float64 array, "cache": the cache object, "meta": dict}. Checkpoints are our own pickles, hence
    `weights_only=False`: only load checkpoints you wrote."""
    return torch.load(path, weights_only=False, map_location="cpu")


def read_progress(path: str | os.PathLike) -> tuple[np.ndarray, dict] | None:
    """(NLLs so far, metadata) of a checkpoint from its sidecars, or None when there is none yet."""
    path = Path(path)
    npy, meta = Path(str(path) + ".nlls.npy"), Path(str(path) + ".json")
    if not (npy.is_file() and meta.is_file()):
        return None
    return np.load(npy), json.loads(meta.read_text())


def stream_nll(
    model,
    input_ids: torch.Tensor,
    cache_factory: Callable[[], Cache],
    *,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 1024,
    stop_after: int | None = None,
    tag: str = "",
    allow_code_change: bool = False,
    progress: bool = True,
    desc: str | None = None,
    progress_interval: float = 10.0,
) -> np.ndarray:
    """Feed `input_ids` ([1, n] or [n]) one token per forward through the cache from `cache_factory()` and return
    the float64 NLLs: `nlls[t] = -log p(ids[t + 1] | ids[: t + 1])`, t = 0 .. n - 2 (computed by the forward that
    fed token t, at query position t).

    `checkpoint`: file path. If it exists the run resumes from it (after checking that the tokens scored so far are
    the same and that `tag` matches); the NLLs and the cache are saved there every `checkpoint_every` scored tokens
    and when the run ends. Extending a finished run to more tokens just continues it.
    `stop_after`: stop once this many NLLs exist in total (for short timing runs and tests); the partial array is
    returned (and checkpointed).
    `tag`: describes the configuration (cache type and parameters); a checkpoint of another tag is refused.
    `allow_code_change`: resume even if the source of the cache's hf_kvcache modules changed since the checkpoint
    was written (only safe for changes that keep the objects' attributes and behaviour).
    """
    ids = input_ids.reshape(-1)
    total = ids.numel() - 1
    if total < 1:
        raise ValueError(f"Need at least 2 tokens to score one, got {ids.numel()}.")
    end = total if stop_after is None else min(total, stop_after)
    device = next(model.parameters()).device
    path = Path(checkpoint) if checkpoint is not None else None

    nlls = np.full(total, np.nan, dtype=np.float64)
    done, elapsed = 0, 0.0
    if path is not None and path.is_file():
        state = load_checkpoint(path)
        meta = state["meta"]
        if meta.get("tag", "") != tag:
            raise ValueError(f"Checkpoint {path} is for {meta.get('tag')!r}, not {tag!r}; delete it or change path.")
        prev = np.asarray(state["nlls"], dtype=np.float64)
        done = min(len(prev), total)
        if meta["tokens_sha1"] != _tokens_digest(ids[: len(prev) + 1]):
            raise ValueError(f"Checkpoint {path} was computed on different tokens; delete it to start over.")
        if len(prev) > total:
            raise ValueError(f"Checkpoint {path} already holds {len(prev)} NLLs, more than the {total} asked.")
        nlls[:done] = prev
        elapsed = float(meta.get("elapsed_s", 0.0))
        cache = state["cache"]
        if not allow_code_change and meta.get("code_digest") not in (None, _code_digest(cache)):
            raise ValueError(
                f"Checkpoint {path} was written by other hf_kvcache code (the modules of {type(cache).__name__} "
                "changed since): a pickled cache may not match the new classes. Delete it to start over, or pass "
                "allow_code_change=True if the change keeps the state layout and behaviour."
            )
        from ..caches.base import KVCache

        if isinstance(cache, KVCache):  # a fresh process: the model needs the attention bridge again
            from ..attention.bridge import enable

            enable(model)
    else:
        cache = cache_factory()

    def save(n: int) -> None:
        meta = {
            "tag": tag,
            "done": n,
            "total": total,
            "elapsed_s": elapsed,
            "tokens_sha1": _tokens_digest(ids[: n + 1]),
            "cache_class": type(cache).__name__,
            "code_digest": _code_digest(cache),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        _save(path, nlls[:n].copy(), cache, meta)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=end,
            initial=done,
            desc=desc or tag or "stream",
            unit="tok",
            mininterval=progress_interval,
            smoothing=0.05,
        )
    since_save = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for t in range(done, end):
            out = model(input_ids=ids[t : t + 1].view(1, 1).to(device), **cache_kwargs(cache), use_cache=True)
            logits = out.logits[0, -1].to(torch.float64)
            nlls[t] = (torch.logsumexp(logits, -1) - logits[ids[t + 1]]).item()
            since_save += 1
            if bar is not None:
                bar.update(1)
                if (t + 1) % 256 == 0:
                    bar.set_postfix(ppl=f"{math.exp(nlls[max(0, t - 1023) : t + 1].mean()):.2f}", refresh=False)
            if path is not None and since_save >= checkpoint_every and t + 1 < end:
                elapsed += time.perf_counter() - t0
                t0 = time.perf_counter()
                save(t + 1)
                since_save = 0
    elapsed += time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if path is not None and (since_save or not path.is_file()):
        save(end)
    return nlls[:end]


def perplexity(nlls) -> float:
    """exp(mean NLL) in float64."""
    nlls = np.asarray(nlls, dtype=np.float64)
    return float(np.exp(nlls.mean())) if nlls.size else float("nan")


def bucket_perplexity(nlls, bucket: int = 1024) -> list[dict]:
    """Per-bucket perplexities of NLLs indexed by query position (see `stream_nll`): one dict per bucket
    {"bucket_start", "bucket_end" (exclusive), "tokens" (NLLs in it; the last bucket may be short), "ppl"}."""
    nlls = np.asarray(nlls, dtype=np.float64)
    if bucket < 1:
        raise ValueError(f"`bucket` must be >= 1, got {bucket}.")
    rows = []
    for start in range(0, nlls.size, bucket):
        part = nlls[start : start + bucket]
        rows.append(
            {"bucket_start": start, "bucket_end": start + part.size, "tokens": int(part.size), "ppl": perplexity(part)}
        )
    return rows
