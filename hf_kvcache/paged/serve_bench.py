"""`hf-kvcache serve-bench`: continuous batching (`model.generate_batch`) under a fixed KV memory budget, with
model-dtype pages vs quantized pages, in one interleaved run.

Workload: `requests` prompts cut from the offline corpus (pydoc topics) at distinct offsets, with prompt lengths
and generation lengths drawn (seeded) from [prompt_min, prompt_max] and [new_min, new_max]. All requests are
submitted at once; the KV memory budget is `budget_tokens` tokens of the whole model in the model's dtype
(`num_blocks = budget_tokens / page_size`, so every format gets the same bytes: quantized pages hold more tokens).

Protocol: for every budget, the formats run one after the other (model-dtype first: it is the reference), and
the budgets follow each other (`rounds` repeats the whole sweep). The reference run is greedy with an
end-of-sequence token forced at each request's generation length; the quantized runs are teacher-forced to the
reference tokens (hf_kvcache.paged.agreement), so every format processes the same tokens and KL / top-1 compare
the same positions.

Concurrency (hf_kvcache.paged.concurrency): the requests holding pages at the forwards where the cache refused a
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
request creation: includes queueing, as a server sees it), and for quantized formats KL(model-dtype pages ||
quantized pages) and top-1 agreement over all generated positions (model-dtype runs at the other budgets batch the
requests differently: their KL against the reference run is the noise floor of batching in the model's dtype). On
the same text (the first `kl_requests` requests, prompt + reference tokens), our QuantizedFP8Cache (token scales,
no rotation, and its default Hadamard key rotation) is scored against DynamicCache and the model-dtype paged run
with the teacher-forced protocol of hf_kvcache.evaluation.divergence, for comparison.

Results: JSON (everything, with the per-forward trace of every run), CSV (one row per run) and a PNG (concurrency
vs budget), `out` + suffixes.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .agreement import record_logits
from .concurrency import steady_state
from ..rotation import ROTATIONS
from .spec import KV_DTYPES, PagedKVSpec

SCALE_DTYPE_NAMES = ("bfloat16", "float16", "float32", "e8m0")

DEFAULT_FORMATS = ("model", "fp8_e4m3", "int8")


@dataclass
class ServeBenchSettings:
    model: str = "smollm2"
    dtype: str = "bfloat16"
    # default sweep: memory-bound at every budget, with requests waiting for a steady state of dozens of forwards
    # (model-dtype pages hold ~20-35 requests, FP8 pages ~40-65)
    requests: int = 384
    prompt_min: int = 8
    prompt_max: int = 32
    new_min: int = 8
    new_max: int = 24
    budget_tokens: int = 1024
    budget_scales: tuple[float, ...] = (0.75, 1.0, 1.25)
    page_size: int = 16
    max_batch_tokens: int = 1024
    formats: tuple[str, ...] = DEFAULT_FORMATS
    kl_requests: int = 8
    rounds: int = 1
    seed: int = 0
    threads: int | None = None
    out: str = "eval/results/serve_bench"

    def __post_init__(self):
        for name in ("requests", "prompt_min", "prompt_max", "new_min", "new_max", "budget_tokens", "page_size",
                     "max_batch_tokens", "rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.prompt_min > self.prompt_max:
            raise ValueError(f"`prompt_min` ({self.prompt_min}) must be <= `prompt_max` ({self.prompt_max}).")
        if self.new_min > self.new_max:
            raise ValueError(f"`new_min` ({self.new_min}) must be <= `new_max` ({self.new_max}).")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"`dtype` must be one of ('bfloat16', 'float16', 'float32'), got {self.dtype!r}.")
        if not self.formats or self.formats[0] != "model":
            raise ValueError(f"`formats` must start with 'model' (the reference run), got {self.formats!r}.")
        for fmt in self.formats:
            parse_format(fmt)
        if not self.budget_scales or any(not s > 0 for s in self.budget_scales) or 1.0 not in self.budget_scales:
            raise ValueError(f"`budget_scales` must be positive and include 1.0, got {self.budget_scales!r}.")
        if self.kl_requests < 0 or self.kl_requests > self.requests:
            raise ValueError(f"`kl_requests` must be in [0, requests={self.requests}], got {self.kl_requests}.")


def parse_format(name: str) -> tuple[str, dict]:
    """"model", "fp8_e4m3", "int8", "fp8_e4m3:hadamard" (key rotation), "fp8_e4m3:e8m0" (scale dtype),
    "fp8_e4m3:hadamard:e8m0" ... -> (kv_dtype, options)."""
    kv_dtype, *extras = name.split(":")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"format {name!r}: the page dtype must be one of {KV_DTYPES}.")
    options = {}
    for extra in extras:
        if extra in ROTATIONS:
            options["key_rotation"] = extra
        elif extra in SCALE_DTYPE_NAMES:
            options["scale_dtype"] = extra
        else:
            raise ValueError(f"format {name!r}: {extra!r} is neither a key rotation {ROTATIONS} nor a scale dtype "
                             f"{SCALE_DTYPE_NAMES}.")
    if kv_dtype == "model":
        if options:
            raise ValueError(f"format {name!r}: model-dtype pages take no options.")
        return kv_dtype, {}
    PagedKVSpec(kv_dtype=kv_dtype, **options)
    return kv_dtype, options


def make_workload(tokenizer, settings: ServeBenchSettings) -> tuple[list[list[int]], list[int]]:
    """(prompts, generation lengths): distinct corpus offsets, seeded lengths."""
    from ..text import load_tokens

    rng = random.Random(settings.seed)
    stride = settings.prompt_max + 64
    ids = load_tokens(tokenizer, max_tokens=stride * settings.requests)[0].tolist()
    prompts, lengths = [], []
    for i in range(settings.requests):
        n = rng.randint(settings.prompt_min, settings.prompt_max)
        prompts.append(ids[i * stride : i * stride + n])
        lengths.append(rng.randint(settings.new_min, settings.new_max))
    return prompts, lengths


def _cb_config(settings: ServeBenchSettings, budget_tokens: int, kv_dtype: str, options: dict):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cb = ContinuousBatchingConfig(
        num_blocks=max(1, budget_tokens // settings.page_size), page_size=settings.page_size,
        max_batch_tokens=settings.max_batch_tokens, allow_block_sharing=False, use_async_batching=False,
        max_blocks_per_request=0,
    )
    cb.kv_cache_dtype = kv_dtype
    cb.kv_cache_quantization = options or None
    return cb


def run_once(model, prompts, generation_config, cb_config, force) -> dict:
    """One generate_batch call; tokens, recorded log-probs, and the serving measurements."""
    with record_logits(model, force) as rec:
        start = time.perf_counter()
        outputs = model.generate_batch(prompts, generation_config=generation_config,
                                       continuous_batching_config=cb_config, warmup=False, record_timestamps=True)
        wall = time.perf_counter() - start
    failed = [rid for rid, o in outputs.items() if o.error is not None]
    if failed or len(outputs) != len(prompts):
        raise RuntimeError(f"generate_batch failed for requests {failed or 'missing'}: "
                           f"{next((o.error for o in outputs.values() if o.error), '')}")
    tokens = {rid: list(o.generated_tokens) for rid, o in outputs.items()}
    ttft = [o.timestamps[0] - o.created_time for o in outputs.values() if o.timestamps]
    generated = sum(len(t) for t in tokens.values())
    steady = steady_state(rec.steps)
    peak = max(range(len(rec.steps)), key=lambda i: rec.steps[i].resident_requests)  # first forward at the peak
    at_peak = rec.steps[peak]
    return {
        "tokens": tokens,
        "logprobs": rec.logprobs(),
        "trace": [r.as_row() for r in rec.steps],
        # concurrency in the memory-bound steady state (hf_kvcache.paged.concurrency): the benchmark's measure
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
        **rec.cache_facts,
    }


def _agreement(reference: dict[str, torch.Tensor], test: dict[str, torch.Tensor], same_text: int) -> dict:
    """KL / top-1 over all requests, and KL over the first `same_text` requests (the text QuantizedFP8Cache is
    scored on)."""
    from ..evaluation.divergence import divergence_metrics

    ids = sorted(reference, key=lambda r: int(r.split("_")[-1]))
    ref = torch.cat([reference[rid] for rid in ids])
    got = torch.cat([test[rid] for rid in ids])
    metrics = divergence_metrics(ref, got)
    out = {"kl_mean": metrics["kl_mean"], "kl_p99": metrics["kl_p99"], "top1_agreement": metrics["top1_agreement"],
           "positions": metrics["positions"]}
    if same_text:
        subset = divergence_metrics(torch.cat([reference[r] for r in ids[:same_text]]),
                                    torch.cat([test[r] for r in ids[:same_text]]))
        out["kl_mean_same_text"] = subset["kl_mean"]
        out["top1_same_text"] = subset["top1_agreement"]
    return out


def quantized_cache_kl(model, prompts, tokens: dict[str, list[int]], count: int,
                       paged_reference: dict[str, torch.Tensor]) -> dict:
    """Our QuantizedFP8Cache on the same text: teacher-forced on prompt + reference tokens of the first `count`
    requests (hf_kvcache.evaluation.divergence), token scales without rotation (the paged quantizer) and the
    cache's default (Hadamard key rotation). Each is scored against DynamicCache (same protocol, one request at a
    time) and against the model-dtype paged run (the reference of the paged formats: same positions, and the same
    batching noise); DynamicCache against the paged run gives that noise alone."""
    from transformers import DynamicCache

    from ..evaluation.divergence import cache_logprobs, divergence_metrics
    from ..quantized import QuantizedFP8Cache

    factories = {
        "QuantizedFP8Cache(key_rotation='none')": lambda: QuantizedFP8Cache(model, key_rotation="none",
                                                                            attention="dequantize"),
        "QuantizedFP8Cache() [hadamard]": lambda: QuantizedFP8Cache(model, attention="dequantize"),
    }
    dynamic, paged, tests = [], [], {name: [] for name in factories}
    for i, rid in enumerate(sorted(tokens, key=lambda r: int(r.split("_")[-1]))[:count]):
        generated = tokens[rid]
        ids = torch.tensor(prompts[i] + generated)
        prompt_len = len(prompts[i])
        rows = len(generated)  # row g predicts generated token g, as in the paged runs
        dynamic.append(cache_logprobs(model, ids, DynamicCache(config=model.config), prompt_len)[:rows])
        paged.append(paged_reference[rid][:rows])
        for name, factory in factories.items():
            tests[name].append(cache_logprobs(model, ids, factory(), prompt_len)[:rows])
    dynamic, paged = torch.cat(dynamic), torch.cat(paged)

    def metrics(ref, got):
        m = divergence_metrics(ref, got)
        return {k: m[k] for k in ("kl_mean", "kl_p99", "top1_agreement", "positions")}

    out = {"DynamicCache vs model-dtype pages (batching noise)": metrics(paged, dynamic)}
    for name, rows in tests.items():
        got = torch.cat(rows)
        out[f"{name} vs DynamicCache"] = metrics(dynamic, got)
        out[f"{name} vs model-dtype pages"] = metrics(paged, got)
    return out


def run_serve_bench(settings: ServeBenchSettings, progress=print) -> dict:
    from transformers import GenerationConfig

    from ..models import load_model
    from .cache import install

    install()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    model, tokenizer = load_model(settings.model, dtype=getattr(torch, settings.dtype))
    prompts, lengths = make_workload(tokenizer, settings)
    eos = tokenizer.eos_token_id
    generation_config = GenerationConfig(max_new_tokens=settings.new_max + 1, do_sample=False, eos_token_id=eos,
                                         pad_token_id=tokenizer.pad_token_id)
    # the reference run stops each request at its length by forcing the end-of-sequence token there
    end_forcing = {f"req_{i}": {n: eos} for i, n in enumerate(lengths)}
    runs, reference_tokens, reference_logprobs = [], None, None
    for round_index in range(settings.rounds):
        for scale in settings.budget_scales:
            budget = int(settings.budget_tokens * scale)
            for fmt in settings.formats:
                kv_dtype, options = parse_format(fmt)
                cb = _cb_config(settings, budget, kv_dtype, options)
                if reference_tokens is None:
                    force = end_forcing
                else:
                    force = {rid: dict(enumerate(toks)) for rid, toks in reference_tokens.items()}
                result = run_once(model, prompts, generation_config, cb, force)
                first = reference_tokens is None
                if first:
                    reference_tokens, reference_logprobs = result["tokens"], result["logprobs"]
                elif result["tokens"] != reference_tokens:
                    raise RuntimeError(f"format {fmt}: the teacher-forced run did not follow the reference tokens")
                row = {"round": round_index, "budget_scale": scale, "budget_tokens_model_dtype": budget,
                       "format": fmt}
                row.update({k: v for k, v in result.items() if k not in ("tokens", "logprobs")})
                if not first:  # model-dtype runs at other budgets batch differently: their KL is the noise floor
                    row.update(_agreement(reference_logprobs, result["logprobs"], settings.kl_requests))
                runs.append(row)
                progress(f"round {round_index} budget x{scale} {fmt}: {_steady_text(row)}; whole-run peak "
                         f"{row['peak_concurrent_requests']} ({row['peak_admission_limit']} at the peak)"
                         f", {row['tokens_per_s']:.1f} tok/s, ttft {row['ttft_mean_s']:.2f}s"
                         + (f", KL {row['kl_mean']:.2e}, top-1 {row['top1_agreement']:.3f}" if "kl_mean" in row else "")
                         + (f", KL first {settings.kl_requests} {row['kl_mean_same_text']:.2e}"
                            if "kl_mean_same_text" in row else ""))
    baseline = None
    if settings.kl_requests:
        progress(f"QuantizedFP8Cache KL on the same text ({settings.kl_requests} requests)...")
        baseline = quantized_cache_kl(model, prompts, reference_tokens, settings.kl_requests, reference_logprobs)
    recorded = asdict(settings)
    recorded["out"] = Path(settings.out).name  # the file names (OUT.json, ...), not this machine's path
    return {"settings": recorded, "transformers": __import__("transformers").__version__,
            "torch": torch.__version__, "prompt_lengths": [len(p) for p in prompts], "generation_lengths": lengths,
            "runs": runs, "summary": summarize(runs, settings), "quantized_fp8_cache_kl_same_text": baseline}


def _steady_text(row: dict) -> str:
    if not row["steady_measured"]:
        return f"no memory-bound steady state ({row['steady_reason']})"
    return (f"steady state {row['steady_mean_concurrent_requests']:.1f} concurrent requests (peak "
            f"{row['steady_peak_concurrent_requests']}, {row['steady_pages_per_request']:.2f} pages each, "
            f"{row['steady_memory_bound_share']:.0%} of {row['steady_forwards']} forwards memory-bound)")


def summarize(runs: list[dict], settings: ServeBenchSettings) -> dict:
    """Ratios to model-dtype pages at the same budget and round, then medians over rounds. The concurrency ratio is
    that of the mean requests resident at the memory-bound forwards of the steady state (None unless both runs
    reached one in every round: `memory_bound`); the steady state's peak and the whole run's peak are given too."""
    by_key = {(r["round"], r["budget_scale"], r["format"]): r for r in runs}
    summary = {}
    for fmt in settings.formats[1:]:
        for scale in settings.budget_scales:
            pairs = [(by_key[(i, scale, "model")], by_key[(i, scale, fmt)]) for i in range(settings.rounds)]
            memory_bound = all(base["steady_measured"] and run["steady_measured"] for base, run in pairs)

            def ratio(key, require_steady=False):
                if require_steady and not memory_bound:
                    return None
                return statistics.median(run[key] / base[key] for base, run in pairs)

            summary[f"{fmt}@x{scale}"] = {
                "memory_bound": memory_bound,
                "concurrency_ratio": ratio("steady_mean_concurrent_requests", True),
                "steady_peak_ratio": ratio("steady_peak_concurrent_requests", True),
                "whole_run_peak_ratio": ratio("peak_concurrent_requests"),
                "pages_ratio": ratio("num_blocks"),
                "tokens_per_s_ratio": ratio("tokens_per_s"),
                "ttft_mean_ratio": ratio("ttft_mean_s"),
                "kl_mean": statistics.median(run["kl_mean"] for _, run in pairs),
            }
    return summary


def write_results(result: dict, out: str) -> list[str]:
    """JSON, CSV and PNG next to `out` (a path without suffix)."""
    import csv
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = Path(out)
    base.parent.mkdir(parents=True, exist_ok=True)
    paths = [base.parent / f"{base.name}.{suffix}" for suffix in ("json", "csv", "png")]  # keeps dots in the name
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    runs = [{k: v for k, v in r.items() if k != "trace"} for r in result["runs"]]  # the trace: JSON only
    columns = sorted({k for r in runs for k in r}, key=lambda k: list(runs[0]).index(k) if k in runs[0] else 99)
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(runs)
    settings = result["settings"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for fmt in settings["formats"]:
        rows = sorted((r for r in runs if r["format"] == fmt and r["round"] == 0), key=lambda r: r["kv_bytes"])
        mib = [r["kv_bytes"] / 2**20 for r in rows]
        line, = ax.plot(mib, [r["steady_mean_concurrent_requests"] for r in rows], marker="o",
                        label=f"{fmt} pages, memory-bound steady state (mean)")
        ax.plot(mib, [r["peak_concurrent_requests"] for r in rows], marker="x", ls="--", lw=0.8,
                color=line.get_color(), label=f"{fmt} pages, whole-run peak")
    ax.set_xlabel("KV memory budget (MiB)")
    ax.set_ylabel("concurrent requests")
    ax.set_title(f"Continuous batching, {settings['model']} ({settings['dtype']}), page {settings['page_size']}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=120)
    plt.close(fig)
    return [str(p) for p in paths]


def add_serve_bench_command(sub) -> None:
    """The `serve-bench` subcommand of `hf-kvcache` (hf_kvcache.cli)."""
    d = ServeBenchSettings()
    p = sub.add_parser(
        "serve-bench",
        help="continuous batching under a fixed KV memory budget: model-dtype vs FP8 / INT8 pages",
        description=__doc__.split("\n\n")[0] + " Writes OUT.json, OUT.csv and OUT.png.",
    )
    p.add_argument("--model", default=d.model, help="Hub id, local path, or 'smollm2' (offline; default)")
    p.add_argument("--dtype", default=d.dtype, help=f"model (and reference page) dtype (default {d.dtype})")
    p.add_argument("--requests", type=int, default=d.requests, help=f"number of requests (default {d.requests})")
    p.add_argument("--prompt-lengths", default=f"{d.prompt_min}-{d.prompt_max}", metavar="MIN-MAX",
                   help="prompt length range in tokens (default %(default)s)")
    p.add_argument("--new-tokens", default=f"{d.new_min}-{d.new_max}", metavar="MIN-MAX",
                   help="generation length range (default %(default)s)")
    p.add_argument("--budget-tokens", type=int, default=d.budget_tokens,
                   help=f"KV memory budget, in tokens of the whole model in model-dtype pages (default {d.budget_tokens})")
    p.add_argument("--budget-scales", default=",".join(map(str, d.budget_scales)),
                   help="budgets for the concurrency plot, as multiples of --budget-tokens (default %(default)s)")
    p.add_argument("--formats", default=",".join(d.formats),
                   help="page formats, 'model' first (default %(default)s); FORMAT:hadamard / FORMAT:none sets the "
                        "key rotation (default: hadamard for FP8 and INT4, none for INT8)")
    p.add_argument("--page-size", type=int, default=d.page_size, help=f"tokens per page (default {d.page_size})")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                   help=f"tokens per forward (default {d.max_batch_tokens})")
    p.add_argument("--kl-requests", type=int, default=d.kl_requests,
                   help=f"requests scored with QuantizedFP8Cache on the same text (default {d.kl_requests})")
    p.add_argument("--rounds", type=int, default=d.rounds, help="repeats of the interleaved sweep (default 1)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=d.out, help="output path without suffix (default %(default)s)")
    p.set_defaults(func=_serve_bench_cli)


def _range(text: str, name: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split("-"))
    except ValueError:
        raise ValueError(f"--{name} must be MIN-MAX (two integers), got {text!r}.") from None
    return low, high


def _serve_bench_cli(args) -> int:
    prompt_min, prompt_max = _range(args.prompt_lengths, "prompt-lengths")
    new_min, new_max = _range(args.new_tokens, "new-tokens")
    try:
        scales = tuple(float(x) for x in args.budget_scales.split(","))
    except ValueError:
        raise ValueError(f"--budget-scales must be comma-separated numbers, got {args.budget_scales!r}.") from None
    settings = ServeBenchSettings(
        model=args.model, dtype=args.dtype, requests=args.requests, prompt_min=prompt_min, prompt_max=prompt_max,
        new_min=new_min, new_max=new_max, budget_tokens=args.budget_tokens, budget_scales=scales,
        page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
        formats=tuple(f.strip() for f in args.formats.split(",")), kl_requests=args.kl_requests,
        rounds=args.rounds, seed=args.seed, threads=args.threads, out=args.out,
    )
    result = run_serve_bench(settings)
    for path in write_results(result, settings.out):
        print(f"wrote {path}")
    for key, row in result["summary"].items():
        if row["memory_bound"]:
            concurrency = (f"steady-state concurrency x{row['concurrency_ratio']:.2f} (its peak "
                           f"x{row['steady_peak_ratio']:.2f})")
        else:
            concurrency = "no memory-bound steady state in every run (see the JSON)"
        print(f"{key}: {concurrency}, whole-run peak x{row['whole_run_peak_ratio']:.2f}, pages "
              f"x{row['pages_ratio']:.2f}, tokens/s x{row['tokens_per_s_ratio']:.2f}, "
              f"TTFT x{row['ttft_mean_ratio']:.2f}, KL {row['kl_mean']:.2e}")
    for name, row in (result["quantized_fp8_cache_kl_same_text"] or {}).items():
        print(f"{name}, same text: KL {row['kl_mean']:.2e}, top-1 {row['top1_agreement']:.3f}")
    return 0
