"""Decode cost must not grow with stream length: SinkCache(4 + 508) ms/token at stream positions 1K, 4K and 16K on
SmolLM2-135M, as ratios to DynamicCache at a 512-token context (the same attention size), measured in one run.

Method:
- Caches are brought to their stream position by chunked prefill (1024-token chunks of the pydoc corpus). That is
  not the streaming protocol (see eval/stream_ppl.py) but the cost of a decode step depends only on what the cache
  holds, and a SinkCache holds its budget whatever the path was.
- Measurements are interleaved: each round runs every configuration once (order rotated per round), each for a few
  warm-up steps then `--steps` timed one-token forwards. Interleaving spreads machine noise (other processes,
  frequency changes) evenly over the configurations.
- The ratio that is checked is paired: per round, median ms/token of the configuration over the median of the
  baseline in the same round; then the median over rounds. On a shared machine this is far steadier than a ratio of
  global medians, which is also reported, as is the ratio of 10th percentiles (the least-disturbed steps).
- DynamicCache contexts are cropped back after each measurement, so the baseline stays at 512 (+ steps) tokens.
  DynamicCache at some far positions (`--dense-far`) is measured too, for information (its cost grows).
Target: SinkCache / DynamicCache@512 <= 1.15 at every position.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import DynamicCache  # noqa: E402

from hf_kvcache import SinkCache, cache_kwargs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_ppl import environment  # noqa: E402

TARGET = 1.15


def prefill_to(model, cache, ids, start: int, stop: int, chunk: int) -> None:
    with torch.inference_mode():
        for s in range(start, stop, chunk):
            model(input_ids=ids[:, s : min(stop, s + chunk)], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)


def decode_steps(model, cache, ids, pos: int, n: int) -> list[float]:
    """n one-token forwards feeding corpus tokens from `pos` on; seconds per step."""
    times = []
    with torch.inference_mode():
        for i in range(n):
            token = ids[:, pos + i : pos + i + 1]
            t0 = time.perf_counter()
            model(input_ids=token, **cache_kwargs(cache), use_cache=True)
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=508)
    parser.add_argument("--position-mode", default="cache", choices=["cache", "original"])
    parser.add_argument("--baseline", type=int, default=512, help="DynamicCache context of the baseline")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per measurement")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=1024, help="prefill chunk")
    parser.add_argument(
        "--dense-far",
        type=int,
        nargs="*",
        default=[1024, 4096],
        help="positions (among --positions) where DynamicCache is also timed, for information; "
        "16384 costs a long dense prefill",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--results", type=Path, default=ROOT / "eval" / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import transformers

    transformers.logging.set_verbosity_error()
    from hf_kvcache.sharing.corpus import load_tokens
    from hf_kvcache.sharing.models import load_model

    model, tokenizer = load_model("smollm2")
    positions = sorted(args.positions)
    per_measure = args.warmup + args.steps
    need = positions[-1] + args.rounds * per_measure + 1
    ids = load_tokens(tokenizer, "pydoc", max_tokens=need)

    # Build every configuration: name -> dict(cache, next stream index, crop-to or None, kind, position).
    t0 = time.perf_counter()
    configs = {}
    base = DynamicCache(config=model.config)
    prefill_to(model, base, ids, 0, args.baseline, args.chunk)
    configs[f"dynamic@{args.baseline}"] = dict(
        cache=base, pos=args.baseline, crop=args.baseline, kind="baseline", position=args.baseline
    )
    sink = SinkCache(model, sinks=args.sinks, window=args.window, position_mode=args.position_mode)
    dense_far = sorted(set(args.dense_far) & set(positions))
    dense = DynamicCache(config=model.config) if dense_far else None
    done = dense_done = 0
    for p in positions:
        prefill_to(model, sink, ids, done, p, args.chunk)
        done = p
        if p in dense_far:
            prefill_to(model, dense, ids, dense_done, p, args.chunk)
            dense_done = p
        configs[f"sink{args.sinks}+{args.window}@{p}"] = dict(
            cache=copy.deepcopy(sink), pos=p, crop=None, kind="sink", position=p
        )
        if p in dense_far:
            configs[f"dynamic@{p}"] = dict(cache=copy.deepcopy(dense), pos=p, crop=p, kind="dense_far", position=p)
    del sink, dense
    print(f"prefill of all configurations: {time.perf_counter() - t0:.1f} s", flush=True)

    names = list(configs)
    samples = {n: [] for n in names}
    round_medians = {n: [] for n in names}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            c = configs[n]
            times = decode_steps(model, c["cache"], ids, c["pos"], per_measure)
            samples[n].extend(times[args.warmup :])
            round_medians[n].append(statistics.median(times[args.warmup :]))
            if c["crop"] is not None:
                # the dense context stays where it was (crop takes minus the number of tokens to drop in 5.x)
                c["cache"].crop(c["crop"] - c["cache"].get_seq_length())
            else:
                c["pos"] += per_measure
        print(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - t0:.0f} s)", flush=True)

    base_name = f"dynamic@{args.baseline}"
    base_ms = 1000 * statistics.median(samples[base_name])
    base_p10 = sorted(samples[base_name])[len(samples[base_name]) // 10]
    rows = []
    for n in names:
        c = configs[n]
        ms = 1000 * statistics.median(samples[n])
        paired = statistics.median(a / b for a, b in zip(round_medians[n], round_medians[base_name]))
        p10 = sorted(samples[n])[len(samples[n]) // 10]
        rows.append(
            {
                "config": n,
                "kind": c["kind"],
                "stream_position": c["position"],
                "kv_tokens_held": min(c["position"], args.sinks + args.window)
                if c["kind"] == "sink"
                else c["position"],
                "cache_mb": round(
                    c["cache"].nbytes() / 2**20
                    if hasattr(c["cache"], "nbytes")
                    else sum(layer.keys.nbytes + layer.values.nbytes for layer in c["cache"].layers) / 2**20,
                    2,
                ),
                "ms_per_token_median": round(ms, 3),
                "ms_p10": round(1000 * p10, 3),
                "ms_p90": round(1000 * sorted(samples[n])[9 * len(samples[n]) // 10], 3),
                "samples": len(samples[n]),
                "ratio_paired": round(paired, 3),
                "ratio_of_medians": round(ms / base_ms, 3),
                "ratio_of_p10": round(p10 / base_p10, 3),
            }
        )
    sink_rows = [r for r in rows if r["kind"] == "sink"]
    passed = all(r["ratio_paired"] <= TARGET for r in sink_rows)

    args.results.mkdir(parents=True, exist_ok=True)
    with open(args.results / "decode_cost.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    info = {
        "what": f"SinkCache({args.sinks}+{args.window}, position_mode={args.position_mode!r}) ms/token at stream "
        f"positions {positions} vs DynamicCache at a {args.baseline}-token context, SmolLM2-135M float32",
        "target": f"<= {TARGET}x at every position",
        "pass": passed,
        "ratios": {str(r["stream_position"]): r["ratio_paired"] for r in sink_rows},
        "ratio_statistic": "median over rounds of (config median / baseline median in the same round)",
        "ratios_of_medians": {str(r["stream_position"]): r["ratio_of_medians"] for r in sink_rows},
        "ratios_of_p10": {str(r["stream_position"]): r["ratio_of_p10"] for r in sink_rows},
        "load_average_at_end": list(os.getloadavg()),
        "baseline_ms_per_token": round(base_ms, 3),
        "method": {
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "prefill_chunk": args.chunk,
            "threads": args.threads,
            "interleaved": True,
            "statistic": "per-round median ms/token; ratio = median over rounds of config/baseline",
        },
        "rows": rows,
        "environment": environment(),
    }
    (args.results / "decode_cost.json").write_text(json.dumps(info, indent=1) + "\n")

    print(
        f"\n{'config':<20}{'position':>9}{'held':>7}{'MB':>7}{'ms/tok':>8}{'p10':>8}{'p90':>8}"
        f"{'paired':>8}{'med/med':>8}{'p10/p10':>8}"
    )
    for r in rows:
        print(
            f"{r['config']:<20}{r['stream_position']:>9}{r['kv_tokens_held']:>7}{r['cache_mb']:>7.1f}"
            f"{r['ms_per_token_median']:>8.1f}{r['ms_p10']:>8.1f}{r['ms_p90']:>8.1f}{r['ratio_paired']:>8.3f}"
            f"{r['ratio_of_medians']:>8.3f}{r['ratio_of_p10']:>8.3f}"
        )
    print(
        f"\ntarget SinkCache/DynamicCache@{args.baseline} <= {TARGET}x at every position: "
        f"{'PASS' if passed else 'FAIL'} ({info['ratios']})"
    )


if __name__ == "__main__":
    main()
