"""The runs of `hf-kvcache serve-bench`: continuous batching (`model.generate_batch`) per page format and KV memory
budget, in one interleaved sweep, and what each run measured.

Protocol (`run_serve_bench`): for every budget, the formats (each with every `kv_compress` setting: prompt eviction,
hf_kvcache.paged.eviction) run one after the other (model-dtype pages without eviction first: it is the reference),
and the budgets follow each other (`rounds` repeats the whole sweep). The reference run is greedy with
an end-of-sequence token forced at each request's generation length; the quantized runs are teacher-forced to the
reference tokens (hf_kvcache.evaluation.agreement), so every format processes the same tokens and KL / top-1 compare
the same positions (hf_kvcache.evaluation.serve_kl). A run that does not follow the reference tokens, or a request that
generate_batch failed, raises RuntimeError.

Concurrency (hf_kvcache.evaluation.concurrency): the requests holding pages at the forwards where the cache refused a
waiting request, in the run's memory-bound steady state (after every request of the initial fill has left, while
requests still wait): their mean (the benchmark's measure), their peak, and the pages each holds; the share of the
steady state's forwards at which memory (not the token budget) stopped admission says whether the run measured
memory-bound concurrency. The whole run's peak (requests holding pages at any forward; it is reached while the
empty cache fills, at `max_batch_tokens` per forward, and so depends on the fill speed as well as the memory) is
reported with the limit that stopped admission there and the requests still waiting. The default workload keeps
requests waiting for a steady state of dozens of forwards at every budget, and its token budget (1024 per
forward) refills the largest pool without being the limit (with 256 per forward, 320 requests and 8-24 new
tokens, FP8 pages at 28 MiB were stopped by the token budget at 24 of the 70 forwards after their fill with
requests waiting: their concurrency measured the scheduler as much as the memory).

Measured per run, too: output tokens/s (wall time of generate_batch), time to first token (first token timestamp -
request creation: includes queueing, as a server sees it), inter-token latency (per request, the time between its
first and last token over the tokens between: `itl_mean_s`, `itl_p50_s`), and for every run after the reference,
KL / top-1 against it (hf_kvcache.evaluation.serve_kl).

The result of `run_serve_bench` (written by hf_kvcache.evaluation.serve_report.write_results): settings (with `out`
reduced to its file name), transformers and torch versions, prompt and generation lengths, `runs` (one row per
round, budget and format, with the per-forward trace), `summary` (serve_report.summarize) and
`quantized_fp8_cache_kl_same_text` (serve_kl.quantized_cache_kl, None when `kl_requests` is 0).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .agreement import record_logits
from .concurrency import steady_state
from .serve_kl import agreement_metrics, quantized_cache_kl
from .serve_report import run_line, summarize
from .serve_workload import (
    ServeBenchSettings,
    configurations,
    continuous_batching_config,
    make_workload,
    parse_format,
    run_label,
)


def run_once(model, prompts, generation_config, cb_config, force) -> dict:
    """One generate_batch call; tokens, recorded log-probs, and the serving measurements."""
    with record_logits(model, force) as rec:
        start = time.perf_counter()
        outputs = model.generate_batch(
            prompts,
            generation_config=generation_config,
            continuous_batching_config=cb_config,
            warmup=False,
            record_timestamps=True,
        )
        wall = time.perf_counter() - start
    failed = [rid for rid, o in outputs.items() if o.error is not None]
    if failed or len(outputs) != len(prompts):
        raise RuntimeError(
            f"generate_batch failed for requests {failed or 'missing'}: "
            f"{next((o.error for o in outputs.values() if o.error), '')}"
        )
    tokens = {rid: list(o.generated_tokens) for rid, o in outputs.items()}
    ttft = [o.timestamps[0] - o.created_time for o in outputs.values() if o.timestamps]
    # inter-token latency per request: (last token - first token) / (tokens - 1), requests of two tokens or more
    itl = [
        (o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1)
        for o in outputs.values()
        if o.timestamps and len(o.timestamps) > 1
    ]
    generated = sum(len(t) for t in tokens.values())
    steady = steady_state(rec.steps)
    peak = max(range(len(rec.steps)), key=lambda i: rec.steps[i].resident_requests)  # first forward at the peak
    at_peak = rec.steps[peak]
    return {
        "tokens": tokens,
        "logprobs": rec.logprobs(),
        "trace": [r.as_row() for r in rec.steps],
        # concurrency in the memory-bound steady state (hf_kvcache.evaluation.concurrency): the benchmark's measure
        **{f"steady_{k}": v for k, v in steady.items()},
        # the whole run's peak, and what limited admission there
        "peak_concurrent_requests": at_peak.resident_requests,
        "peak_forward": peak,
        "peak_admission_limit": at_peak.admission_limit,
        "peak_waiting_requests": at_peak.waiting_requests,
        "peak_pages_per_request": at_peak.pages_in_use / at_peak.resident_requests,
        "queue_empty_forward": next((i for i, r in enumerate(rec.steps) if r.waiting_requests == 0), None),
        "mean_resident_requests": statistics.fmean(rec.resident),
        "peak_batch_requests": max(rec.batch_sizes),
        "forwards": len(rec.batch_sizes),
        "peak_kv_bytes_in_use": max(rec.bytes_in_use),
        "wall_s": wall,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
        "itl_mean_s": statistics.fmean(itl) if itl else None,
        "itl_p50_s": statistics.median(itl) if itl else None,
        **rec.cache_facts,
        **_eviction_facts(rec),
    }


def _eviction_facts(rec) -> dict:
    """What prompt eviction did in the run (hf_kvcache.paged.eviction.EvictionStats), empty without it."""
    stats = rec.eviction_stats
    return {} if stats is None else {f"eviction_{k}": v for k, v in stats.to_dict().items()}


def run_serve_bench(settings: ServeBenchSettings, progress=print) -> dict:
    """The whole sweep of `settings`: every run, its summary and the same-text QuantizedFP8Cache scores."""
    from transformers import GenerationConfig

    from ..paged.cache import install
    from ..sharing.models import load_model

    install()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    model, tokenizer = load_model(settings.model, dtype=getattr(torch, settings.dtype), device=settings.device)
    prompts, lengths = make_workload(tokenizer, settings)
    eos = tokenizer.eos_token_id
    generation_config = GenerationConfig(
        max_new_tokens=settings.new_max + 1, do_sample=False, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
    )
    # the reference run stops each request at its length by forcing the end-of-sequence token there
    end_forcing = {f"req_{i}": {n: eos} for i, n in enumerate(lengths)}
    runs, reference_tokens, reference_logprobs = [], None, None
    for round_index in range(settings.rounds):
        for scale in settings.budget_scales:
            budget = int(settings.budget_tokens * scale)
            for fmt, compress in configurations(settings):
                kv_dtype, options = parse_format(fmt)
                label = run_label(fmt, compress)
                cb = continuous_batching_config(settings, budget, kv_dtype, options, compress)
                if reference_tokens is None:
                    force = end_forcing
                else:
                    force = {rid: dict(enumerate(toks)) for rid, toks in reference_tokens.items()}
                result = run_once(model, prompts, generation_config, cb, force)
                first = reference_tokens is None
                if first:
                    reference_tokens, reference_logprobs = result["tokens"], result["logprobs"]
                elif result["tokens"] != reference_tokens:
                    raise RuntimeError(f"run {label}: the teacher-forced run did not follow the reference tokens")
                row = {
                    "round": round_index,
                    "budget_scale": scale,
                    "budget_tokens_model_dtype": budget,
                    "format": fmt,
                    "kv_compress": compress,
                    "run": label,
                }
                row.update({k: v for k, v in result.items() if k not in ("tokens", "logprobs")})
                if not first:  # model-dtype runs at other budgets batch differently: their KL is the noise floor
                    row.update(agreement_metrics(reference_logprobs, result["logprobs"], settings.kl_requests))
                runs.append(row)
                progress(run_line(row, settings.kl_requests))
    baseline = None
    if settings.kl_requests:
        progress(f"QuantizedFP8Cache KL on the same text ({settings.kl_requests} requests)...")
        baseline = quantized_cache_kl(model, prompts, reference_tokens, settings.kl_requests, reference_logprobs)
    recorded = asdict(settings)
    recorded["out"] = Path(settings.out).name  # the file names (OUT.json, ...), not this machine's path
    return {
        "settings": recorded,
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "prompt_lengths": [len(p) for p in prompts],
        "generation_lengths": lengths,
        "runs": runs,
        "summary": summarize(runs, settings),
        "quantized_fp8_cache_kl_same_text": baseline,
    }
