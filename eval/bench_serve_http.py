"""Concurrency through the HTTP server at one KV memory: `hf-kvcache serve` with model-dtype vs FP8 vs INT8 pages,
the same workload from the `openai` client, in one interleaved run.

Every format gets its own server (a subprocess on 127.0.0.1, started once with the same --kv-memory, page size and
per-forward token budget); then, `--rounds` times, the formats take turns running the workload: `--requests`
streamed chat completions from `--clients` concurrent clients, prompts cut from the offline corpus at mixed lengths,
mixed max_tokens. The clients outnumber the requests the memory holds, so requests wait for pages and the server's
concurrency is set by its KV memory.

Measured per run:
- concurrency from GET /v1/kv_cache sampled every `--sample-ms`: requests holding pages, mean over the samples
  where requests were waiting (the memory-bound steady state; the benchmark's measure) and peak;
- output tokens/s (all completion tokens over the run's wall time), time to first token (request sent -> first
  content chunk, queueing included), inter-token latency ((last chunk - first chunk) / (tokens - 1) per request).
Ratios are to model-dtype pages of the same round, then the median over rounds.

    python eval/bench_serve_http.py                                  # the committed run (SmolLM2 bf16, CPU)
    python eval/bench_serve_http.py --formats model,model+keydiff:0.75,fp8_e4m3,fp8_e4m3+keydiff:0.75 \
        --prompt-tokens 1000-2000 --new-tokens 8-32 --out eval/results/serve_http.compress   # prompt eviction
    python eval/bench_serve_http.py --model Qwen/Qwen2.5-7B-Instruct --device cuda --kv-memory 2GiB \
        --requests 512 --clients 128 --prompt-tokens 500-3000 --new-tokens 64-256      # a GPU run

Writes OUT.json (settings, every run with its samples and per-request timings, the summary), OUT.csv (one row per
run) and OUT.png (concurrency and throughput per format).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_kvcache.cli.serve_bench_command import parse_range  # noqa: E402
from hf_kvcache.evaluation.serve_workload import parse_format, split_layout  # noqa: E402
from hf_kvcache.paged.serve_process import ServerProcess  # noqa: E402


def token_range(text: str, flag: str) -> tuple[int, int]:
    """(MIN, MAX) from the flag's 'MIN-MAX' (hf-kvcache serve-bench's parser), with 1 <= MIN <= MAX."""
    try:
        low, high = parse_range(text, flag.removeprefix("--"))
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if not 1 <= low <= high:
        raise SystemExit(f"{flag}: expected 1 <= MIN <= MAX, got {text!r}")
    return low, high


def make_prompts(tokenizer, count: int, lengths: tuple[int, int], new: tuple[int, int], seed: int) -> list[dict]:
    """`count` requests: a slice of the offline corpus of a random length in `lengths` tokens, and max_tokens in
    `new` (seeded)."""
    from hf_kvcache.sharing.corpus import load_text

    ids = tokenizer(load_text("pydoc")).input_ids
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        length = rng.randint(*lengths)
        start = rng.randrange(0, len(ids) - length)
        text = tokenizer.decode(ids[start : start + length])
        requests.append({"prompt": f"Summarize this text:\n{text}", "max_tokens": rng.randint(*new)})
    return requests


def one_request(client, model: str, request: dict) -> dict:
    sent = time.perf_counter()
    first = last = None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": request["prompt"]}],
        max_tokens=request["max_tokens"],
        temperature=0,
        stream=True,
    )
    usage = None
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
        usage = chunk.usage or usage
    tokens = usage.completion_tokens if usage else 0
    return {
        "ttft_s": None if first is None else first - sent,
        "tokens": tokens,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "itl_s": (last - first) / (tokens - 1) if first is not None and tokens > 1 else None,
    }


def run_workload(server: ServerProcess, model: str, requests: list[dict], clients: int, sample_s: float) -> dict:
    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            state = server.kv_cache()
            samples.append(
                {
                    "t": time.perf_counter(),
                    "active": state["requests_active"],
                    "waiting": state["requests_waiting"],
                    "pages": state["pages_in_use"],
                }
            )
            time.sleep(sample_s)

    client = server.openai_client()
    with concurrent.futures.ThreadPoolExecutor(clients + 1) as pool:
        sampler = pool.submit(sample)
        start = time.perf_counter()
        results = list(pool.map(lambda r: one_request(client, model, r), requests))
        wall = time.perf_counter() - start
        done.set()
        sampler.result()
    bound = [s["active"] for s in samples if s["waiting"] > 0]
    after = server.kv_cache()
    return {
        "wall_s": wall,
        "requests": len(results),
        "completion_tokens": sum(r["tokens"] for r in results),
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "concurrency_mean_memory_bound": statistics.fmean(bound) if bound else None,
        "memory_bound_samples": len(bound),
        "samples": len(samples),
        "concurrency_peak": max(s["active"] for s in samples),
        "ttft_median_s": statistics.median(r["ttft_s"] for r in results if r["ttft_s"] is not None),
        "itl_median_s": statistics.median(r["itl_s"] for r in results if r["itl_s"] is not None),
        "pages_in_use_after": after["pages_in_use"],
        "tokens_capacity": after["tokens_capacity"],
        "per_request": results,
        "trace": samples,
    }


RATIO_KEYS = ("concurrency_mean_memory_bound", "concurrency_peak", "tokens_per_s", "ttft_median_s", "itl_median_s")


def summarize(runs: list[dict], formats: list[str]) -> dict:
    summary = {}
    for fmt in formats:
        mine = [r for r in runs if r["format"] == fmt]
        row = {
            key: statistics.median([r[key] for r in mine if r[key] is not None] or [None])
            for key in RATIO_KEYS + ("tokens_capacity",)
        }
        for key in RATIO_KEYS + ("tokens_capacity",):
            ratios = []
            for r in mine:
                ref = next(x for x in runs if x["format"] == formats[0] and x["round"] == r["round"])
                if r[key] is not None and ref[key]:
                    ratios.append(r[key] / ref[key])
            row[f"{key}_ratio"] = statistics.median(ratios) if ratios else None  # None: never memory-bound
        summary[fmt] = row
    return summary


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = list(summary)
    panels = [
        ("concurrency_mean_memory_bound", "requests holding pages\n(mean, memory-bound)"),
        ("tokens_per_s", "output tokens/s"),
        ("ttft_median_s", "time to first token (s, median)"),
        ("itl_median_s", "inter-token latency (s, median)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (key, label) in zip(axes, panels):
        values = [summary[f][key] for f in formats]
        bars = ax.bar(
            formats,
            values,
            color=["0.6", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"][: len(formats)],
        )
        for bar, f in zip(bars, formats):
            ax.annotate(
                f"{summary[f][key + '_ratio']:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=9,
            )
        ax.set_title(label, fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="Hub id, local path or smollm2 (offline; default)")
    p.add_argument("--dtype", default="bfloat16", help="model dtype, and so model-dtype pages (default bfloat16)")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--formats",
        default="model,fp8_e4m3,int8",
        help="page formats, model first, as serve-bench's (fp8_e4m3:dequantize: the gather path), each with "
        "+KV_COMPRESS for prompt eviction (fp8_e4m3+keydiff:0.75: --kv-compress; +SPEC@token or @head: --kv-layout "
        "too, else the server's default, head pages; default %(default)s)",
    )
    p.add_argument("--kv-memory", default="64MiB", help="KV memory of every server (default %(default)s)")
    p.add_argument("--page-size", type=int, default=32, help="tokens per page (--cb-block-size; default 32)")
    p.add_argument("--max-batch-tokens", type=int, default=1024, help="tokens per forward (default 1024)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--prompt-tokens", default="100-400", metavar="MIN-MAX")
    p.add_argument("--new-tokens", default="8-32", metavar="MIN-MAX")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sample-ms", type=float, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "eval/results/serve_http"), help="output stem (default %(default)s)")
    args = p.parse_args(argv)
    formats = args.formats.split(",")
    if formats[0] != "model":
        raise SystemExit(f"--formats: the first format must be 'model' (the reference), got {formats[0]!r}")
    if min(args.requests, args.clients, args.rounds, args.page_size, args.max_batch_tokens) < 1:
        raise SystemExit("--requests, --clients, --rounds, --page-size and --max-batch-tokens must be >= 1")

    import torch
    import transformers
    from transformers import AutoTokenizer

    from hf_kvcache.sharing.models import OFFLINE_MODEL, convert_smollm2

    path = str(convert_smollm2()) if args.model == OFFLINE_MODEL else args.model
    tokenizer = AutoTokenizer.from_pretrained(path)
    requests = make_prompts(
        tokenizer,
        args.requests,
        token_range(args.prompt_tokens, "--prompt-tokens"),
        token_range(args.new_tokens, "--new-tokens"),
        args.seed,
    )
    common = [
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--kv-memory",
        args.kv_memory,
        "--cb-block-size",
        str(args.page_size),
        "--cb-max-batch-tokens",
        str(args.max_batch_tokens),
        "--log-level",
        "error",
    ]
    servers = {}
    try:
        for fmt in formats:
            pages, _, compress = fmt.partition("+")  # e.g. fp8_e4m3+keydiff:0.75: prompt eviction too
            kv_dtype, options = parse_format(pages)  # e.g. fp8_e4m3:dequantize: the gather-and-dequantize path
            page_format = ["--kv-cache-dtype", kv_dtype]
            if options:
                page_format += ["--kv-cache-quantization", json.dumps(options)]
            if compress:  # SPEC or SPEC@LAYOUT, read as serve-bench reads it (no layout: the default)
                spec, layout = split_layout(compress)
                page_format += ["--kv-compress", spec, "--kv-layout", layout]
            servers[fmt] = ServerProcess(path, *page_format, *common, start_timeout=600, request_timeout=1800)
        warm = [{"prompt": "Hello", "max_tokens": 4}]
        for fmt in formats:
            run_workload(servers[fmt], path, warm, 1, args.sample_ms / 1000)  # builds the continuous batcher
        runs = []
        for round_ in range(args.rounds):
            for fmt in formats:
                result = run_workload(servers[fmt], path, requests, args.clients, args.sample_ms / 1000)
                result.update(format=fmt, round=round_)
                runs.append(result)
                print(
                    f"round {round_} {fmt:>9}: {result['concurrency_mean_memory_bound'] or 0:5.1f} requests "
                    f"(peak {result['concurrency_peak']}), {result['tokens_per_s']:6.1f} tok/s, TTFT "
                    f"{result['ttft_median_s']:.2f} s, ITL {result['itl_median_s'] * 1000:.0f} ms, "
                    f"pages held after: {result['pages_in_use_after']}",
                    flush=True,
                )
    finally:
        for server in servers.values():
            server.stop()
    summary = summarize(runs, formats)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    device = (
        args.device
        if args.device != "cpu"
        else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    )
    result = {
        "settings": settings,
        "device": device,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "summary": summary,
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def path(suffix: str) -> Path:  # OUT + suffix: a stem may hold dots (serve_http.decode_heavy)
        return out.with_name(out.name + suffix)

    path(".json").write_text(json.dumps(result, indent=1))
    with path(".csv").open("w", newline="") as f:
        keys = [
            "round",
            "format",
            "tokens_capacity",
            *RATIO_KEYS,
            "completion_tokens",
            "wall_s",
            "memory_bound_samples",
            "pages_in_use_after",
        ]
        writer = csv.DictWriter(f, keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(runs)
    plot(
        summary,
        path(".png"),
        f"hf-kvcache serve, {args.model} {args.dtype} on {args.device}, "
        f"KV memory {args.kv_memory}: {args.requests} requests from {args.clients} clients (ratios to model pages)",
    )
    for fmt, row in summary.items():
        print(
            f"{fmt:>9}: concurrency {row['concurrency_mean_memory_bound_ratio']:.2f}x (peak "
            f"{row['concurrency_peak_ratio']:.2f}x), tokens/s {row['tokens_per_s_ratio']:.2f}x, TTFT "
            f"{row['ttft_median_s_ratio']:.2f}x, ITL {row['itl_median_s_ratio']:.2f}x, capacity "
            f"{row['tokens_capacity_ratio']:.2f}x"
        )
    return result


if __name__ == "__main__":
    main()
