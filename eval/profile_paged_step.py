"""Where a continuous-batching run's time goes, model-dtype pages against quantized pages (issue 49).

Runs `serve-bench`'s workload (hf_kvcache.evaluation.serve_workload: the same requests, the same KV memory for every
format) through `model.generate_batch` once per format, with timers around three parts of every forward:
- *attention*: transformers' attention function of the run (SDPA with continuous batching's packed mask: each
  forward attends [all queries of the batch] x [all keys read for the batch], masked block-diagonally, so its cost
  grows with the product of the two and not with each request's own length); for quantized pages that attend from
  their codes (the default on CPU: hf_kvcache.paged.codes_attention) the paged kernel, request by request;
- *cache update*: the pages' `update` (write the new tokens; read the batch's keys and values back: a gather, and
  for quantized pages the dequantization; with attention from the codes, the write alone);
  (quantized pages: split into quantize + write and gather + dequantize);
- *rest*: everything else of the forward and the scheduler (linear layers, norms, sampling, bookkeeping).
It also records each forward's attention shape (queries, keys read), whose product is the packed mask's size on
transformers' path.

Formats as serve-bench's: `fp8_e4m3:dequantize` is FP8 pages on the gather-and-dequantize path (the "before").

    OMP_NUM_THREADS=2 python eval/profile_paged_step.py [--requests 96] [--formats model,fp8_e4m3]
        [--prompt-lengths 8-32] [--new-tokens 24] [--budget-tokens 1024] [--out PATH]

An untimed warm-up of each format runs first (the native kernels' first load is not a step's cost).

Shares are from one process, run after run, on a shared machine: compare them within a run, not across machines.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from hf_kvcache.cli.serve_bench_command import parse_range
from hf_kvcache.paged.codes_attention import KWARG

ROOT = Path(__file__).resolve().parents[1]


class Timers:
    """Seconds per part, and the attention shapes seen, while `timed` wrappers are installed."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.attention_shapes: list[tuple[int, int]] = []

    def wrap(self, part: str, fn, shapes: bool = False):
        @functools.wraps(fn)  # (keeps the marker of hf_kvcache's attention wrapper: the codes path stays on)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.calls[part] += 1
                if shapes:  # (module, query [B, H, q, D], key [B, H, k, D], ...)
                    codes = kwargs.get(KWARG)  # attention from the codes: the keys it read
                    keys = int(codes.cu_seq_lens_k[-1]) if codes is not None else int(args[2].shape[-2])
                    self.attention_shapes.append((int(args[1].shape[-2]), keys))

        return timed


@contextmanager
def installed(timers: Timers):
    """Time the attention function and every page allocator's `update` (transformers' and ours)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_kvcache.integration.continuous_batching import FullAttentionCacheAllocator, SlidingAttentionCacheAllocator
    from hf_kvcache.paged import codes_attention
    from hf_kvcache.paged.allocators import ALLOCATORS, _QuantizedPagesMixin

    codes_attention.install()  # the attention function timed is the one quantized pages' runs call
    attention = ALL_ATTENTION_FUNCTIONS["sdpa"]
    classes = {FullAttentionCacheAllocator, SlidingAttentionCacheAllocator, *ALLOCATORS.values()}
    saved = {cls: cls.__dict__["update"] for cls in classes if "update" in cls.__dict__}
    write, read = _QuantizedPagesMixin._write, _QuantizedPagesMixin._read
    ALL_ATTENTION_FUNCTIONS["sdpa"] = timers.wrap("attention", attention, shapes=True)
    for cls, update in saved.items():
        cls.update = timers.wrap("cache update", update)
    _QuantizedPagesMixin._write = timers.wrap("of which: quantize + write", write)
    _QuantizedPagesMixin._read = timers.wrap("of which: gather + dequantize", read)
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = attention
        for cls, update in saved.items():
            cls.update = update
        _QuantizedPagesMixin._write, _QuantizedPagesMixin._read = write, read


def profile(
    formats: list[str],
    requests: int,
    budget_tokens: int,
    threads: int | None,
    prompt_lengths: tuple[int, int] = (8, 32),
    new_tokens: int = 24,
) -> dict:
    from transformers import GenerationConfig

    from hf_kvcache.evaluation.serve_workload import (
        ServeBenchSettings,
        continuous_batching_config,
        make_workload,
        parse_format,
    )
    from hf_kvcache.paged.cache import install
    from hf_kvcache.sharing.models import load_model

    install()
    if threads:
        torch.set_num_threads(threads)
    settings = ServeBenchSettings(
        requests=requests,
        budget_tokens=budget_tokens,
        budget_scales=(1.0,),
        kl_requests=0,
        prompt_min=prompt_lengths[0],
        prompt_max=prompt_lengths[1],
        new_min=new_tokens,
        new_max=new_tokens,
        max_batch_tokens=max(1024, prompt_lengths[1]),
    )
    model, tokenizer = load_model(settings.model, dtype=getattr(torch, settings.dtype), device=settings.device)
    prompts, _ = make_workload(tokenizer, settings)  # (every request generates `new_tokens`)
    generation = GenerationConfig(max_new_tokens=settings.new_max, do_sample=False, eos_token_id=None)
    for fmt in formats:  # untimed warm-up: one-time costs (the native kernels' first load) out of the timings
        kv_dtype, options = parse_format(fmt)
        model.generate_batch(
            prompts[:2],
            generation_config=GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None),
            continuous_batching_config=continuous_batching_config(settings, budget_tokens, kv_dtype, options),
        )
    runs = []
    for fmt in formats:
        kv_dtype, options = parse_format(fmt)
        cb = continuous_batching_config(settings, budget_tokens, kv_dtype, options)
        timers = Timers()
        with installed(timers):
            start = time.perf_counter()
            outputs = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=cb)
            wall = time.perf_counter() - start
        generated = sum(len(o.generated_tokens) for o in outputs.values())
        parts = {part: timers.seconds[part] for part in ("attention", "cache update")}
        parts["rest"] = wall - sum(parts.values())
        for part in ("of which: quantize + write", "of which: gather + dequantize"):  # (inside "cache update")
            if part in timers.seconds:
                parts[part] = timers.seconds[part]
        layers = model.config.num_hidden_layers
        queries = [q for q, _ in timers.attention_shapes]
        mask = [q * k for q, k in timers.attention_shapes]
        runs.append(
            {
                "format": fmt,
                "wall_s": wall,
                "generated_tokens": generated,
                "tokens_per_s": generated / wall,
                "seconds": parts,
                "share": {part: s / wall for part, s in parts.items()},
                "forwards": len(timers.attention_shapes) // layers,
                "mean_queries_per_forward": statistics.fmean(queries),
                "mean_keys_per_forward": statistics.fmean(k for _, k in timers.attention_shapes),
                "mean_mask_elements_per_forward": statistics.fmean(mask),
            }
        )
        shares = ", ".join(f"{part} {s / wall:5.1%}" for part, s in parts.items())
        print(
            f"{fmt:>10}: {generated / wall:6.1f} tok/s | {shares} | per forward: "
            f"{runs[-1]['mean_queries_per_forward']:.0f} queries x {runs[-1]['mean_keys_per_forward']:.0f} keys",
            flush=True,
        )
    return {
        "settings": {
            "requests": requests,
            "budget_tokens_model_dtype": budget_tokens,
            "prompt_lengths": f"{settings.prompt_min}-{settings.prompt_max}",
            "new_tokens": settings.new_max,
            "page_size": settings.page_size,
            "max_batch_tokens": settings.max_batch_tokens,
            "threads": torch.get_num_threads(),
            "model": settings.model,
            "dtype": settings.dtype,
        },
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "runs": runs,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--budget-tokens", type=int, default=1024, help="KV memory in model-dtype tokens (pages)")
    parser.add_argument("--formats", default="model,fp8_e4m3", help="comma-separated page formats, 'model' first")
    parser.add_argument("--prompt-lengths", default="8-32", metavar="MIN-MAX", help="prompt tokens (serve-bench's)")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens generated by every request")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(ROOT / "eval" / "results" / "serve_profile.json"))
    args = parser.parse_args(argv)
    try:
        prompt_lengths = parse_range(args.prompt_lengths, "prompt-lengths")
    except ValueError as error:
        parser.error(str(error))
    result = profile(
        args.formats.split(","),
        args.requests,
        args.budget_tokens,
        args.threads,
        prompt_lengths,
        args.new_tokens,
    )
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
