"""Composite decode speed (issue 13): CompositeCache(preset="sinks_heavy_recent", 4 sinks in full precision + FP8
recent window + FP8 heavy hitters) against H2OCache at the same token budget, and against itself across budgets, on
SmolLM2-135M (by default float32, CPU, one thread; `--device cuda` runs bfloat16 on a GPU), in one interleaved run.

    python eval/bench_composite_decode.py [--prompt 2048] [--budgets 256 1024] [--rounds 8] [--steps 12]
    python eval/bench_composite_decode.py --clock cpu --out eval/results/composite_decode_cpu.json  # thread CPU time
    python eval/bench_composite_decode.py --attention blockwise --out eval/results/composite_decode_blockwise.json
    python eval/bench_composite_decode.py --compile --rounds 4 --out eval/results/composite_decode_compiled.json
    # on a GPU (not run here: no GPU was available): bfloat16, the composite attending from its codes ("auto")
    python eval/bench_composite_decode.py --device cuda --prompt 8192 --budgets 1024 4096 \
        --out eval/results/composite_decode_cuda.json

Method (as eval/bench_decode_cost.py):
- Each configuration (cache x budget) prefills the same `--prompt` tokens of the pydoc corpus once, then every round
  runs each configuration in turn (order rotated per round) for `--warmup` + `--steps` one-token forwards fed from
  the corpus (teacher-forced), so machine noise (a shared machine) hits all of them alike.
- Ratios are paired: per round, the median ms/token of a configuration over the median of its reference in the same
  round, then the median over rounds. Reported: composite / H2O at each budget, and composite at the largest budget /
  composite at the smallest (how its cost grows with the regions); H2O's growth for comparison; and the quartiles of
  the per-round ratios (`round_ratio_quartiles`), how much one round strays on this machine.
- aten operations and host syncs per decode step are counted once per configuration, on the decode step after
  `--warmup` others (hf_kvcache.evaluation.host_syncs.HostSyncCounter).
Targets (issue 13): composite <= 1.2x H2O at every budget; composite growth from the smallest to the largest budget
< 10%. Results: eval/results/composite_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stream_ppl import environment  # noqa: E402

import hf_kvcache  # noqa: E402
from hf_kvcache import cache_kwargs  # noqa: E402
from hf_kvcache.evaluation.host_syncs import HostSyncCounter  # noqa: E402

RATIO_TARGET = 1.2
GROWTH_TARGET = 1.10
CACHES = {
    "h2o": lambda model, budget, attention: hf_kvcache.H2OCache(model, budget=budget),
    "composite": lambda model, budget, attention: hf_kvcache.CompositeCache(
        model, preset="sinks_heavy_recent", budget=budget, attention=attention
    ),
}


def decode_times(forward, cache, ids, pos: int, n: int, clock=time.perf_counter, sync=lambda: None) -> list[float]:
    """Seconds of each of `n` one-token forwards (`forward`: the model, or its compiled forward; `sync`: waits for
    the device, CUDA, around each)."""
    times = []
    for i in range(n):
        sync()
        t0 = clock()
        forward(input_ids=ids[:, pos + i : pos + i + 1], **cache_kwargs(cache), use_cache=True)
        sync()
        times.append(clock() - t0)
    return times


def paired(numerator: list[float], denominator: list[float]) -> float:
    return round(statistics.median(a / b for a, b in zip(numerator, denominator)), 3)


def paired_quartiles(numerator: list[float], denominator: list[float]) -> list[float]:
    """First and third quartiles of the per-round ratios: how far one round's ratio strays (the machine's noise)."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    if len(ratios) < 2:
        return [round(ratios[0], 3)] * 2
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return [round(q1, 3), round(q3, 3)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens prefilled into every cache")
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model", default="smollm2", help="Hub id, local path, or smollm2 (offline, the default)")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (default) or cuda, where attention='auto' makes the composite attend from its codes",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="default: float32 on CPU, bfloat16 elsewhere",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode through torch.compile(model.forward, fullgraph=True) (prefill eager, as generate "
        "does); minutes per cache on CPU",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: time.perf_counter; cpu: time.thread_time, the CPU time of the calling thread (far "
        "less disturbed by other processes on a shared machine; needs --threads 1)",
    )
    parser.add_argument(
        "--attention",
        choices=("auto", "dequantize", "blockwise"),
        default="auto",
        help="the composite's `attention` option (auto on CPU: decode from the codes with the native "
        "kernel; blockwise: from the codes in every forward; dequantize: the old CPU path)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "composite_decode.json")
    args = parser.parse_args(argv)
    if args.clock == "cpu" and (args.threads != 1 or args.device != "cpu"):
        parser.error("--clock cpu measures the calling thread only: use it with --threads 1 on --device cpu")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    budgets = sorted(args.budgets)
    if any(b >= args.prompt for b in budgets):
        parser.error(f"--budgets {budgets} must be below --prompt {args.prompt} (the caches must evict)")
    torch.set_num_threads(args.threads)

    import transformers

    transformers.logging.set_verbosity_error()
    from hf_kvcache.sharing.corpus import load_tokens
    from hf_kvcache.sharing.models import load_model

    model, tokenizer = load_model(args.model, dtype=dtype, device=args.device)
    hf_kvcache.enable(model)
    per_round = args.warmup + args.steps
    ids = load_tokens(tokenizer, "pydoc", max_tokens=args.prompt + args.warmup + 1 + args.rounds * per_round + 2)
    ids = ids.to(args.device)

    if args.compile:
        from torch import _dynamo

        _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 64)  # graphs per cache and budget
    forward = torch.compile(model.forward, fullgraph=True) if args.compile else model
    configs = {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        for budget in budgets:
            for name, make in CACHES.items():
                cache = make(model, budget, args.attention)
                model(input_ids=ids[:, : args.prompt], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
                pos = args.prompt + args.warmup  # a decode step after `warmup` others: what each step dispatches
                decode_times(forward, cache, ids, args.prompt, args.warmup, sync=sync)
                with HostSyncCounter() as counter:  # (eager: a dispatch mode would change what dynamo traces)
                    model(input_ids=ids[:, pos : pos + 1], **cache_kwargs(cache), use_cache=True)
                configs[f"{name}@{budget}"] = dict(
                    cache=cache, pos=pos + 1, name=name, budget=budget, ops=counter.ops, syncs=counter.syncs, rounds=[]
                )
        print(f"prefill of {len(configs)} configurations: {time.perf_counter() - t0:.0f} s", flush=True)
        labels = list(configs)
        t0 = time.perf_counter()
        for r in range(args.rounds):
            for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                c = configs[label]
                times = decode_times(forward, c["cache"], ids, c["pos"], per_round, clock, sync)
                c["pos"] += per_round
                c["rounds"].append(statistics.median(times[args.warmup :]))
            print(f"round {r + 1}/{args.rounds} ({time.perf_counter() - t0:.0f} s)", flush=True)

    low, high = budgets[0], budgets[-1]
    ratios = {str(b): paired(configs[f"composite@{b}"]["rounds"], configs[f"h2o@{b}"]["rounds"]) for b in budgets}
    growth = paired(configs[f"composite@{high}"]["rounds"], configs[f"composite@{low}"]["rounds"])
    h2o_growth = paired(configs[f"h2o@{high}"]["rounds"], configs[f"h2o@{low}"]["rounds"])
    spread = {
        str(b): paired_quartiles(configs[f"composite@{b}"]["rounds"], configs[f"h2o@{b}"]["rounds"]) for b in budgets
    }
    spread["growth"] = paired_quartiles(configs[f"composite@{high}"]["rounds"], configs[f"composite@{low}"]["rounds"])
    rows = [
        {
            "config": label,
            "cache": c["name"],
            "budget": c["budget"],
            "ms_per_token_median": round(1000 * statistics.median(c["rounds"]), 2),
            "aten_ops_per_decode_step": c["ops"],
            "host_syncs_per_decode_step": c["syncs"],
            "bytes_held": c["cache"].nbytes(),
        }
        for label, c in configs.items()
    ]
    result = {
        "what": f"CompositeCache(preset='sinks_heavy_recent': 4 sinks full precision + FP8 E4M3 recent + FP8 heavy, "
        f"attention={args.attention!r}) vs H2OCache(budget) at the same budget, {args.model} "
        f"{str(dtype).removeprefix('torch.')} {args.device}, {args.prompt}-token prompt, teacher-forced decode"
        + (", compiled (inductor, fullgraph)" if args.compile else ""),
        "targets": {
            "composite_over_h2o": f"<= {RATIO_TARGET} at every budget",
            "composite_growth": f"< {GROWTH_TARGET} from budget {low} to {high}",
        },
        "composite_over_h2o": ratios,
        "composite_growth": growth,
        "h2o_growth": h2o_growth,
        "pass": {"ratio": all(v <= RATIO_TARGET for v in ratios.values()), "growth": growth < GROWTH_TARGET},
        "ratio_statistic": "median over rounds of (config median ms/token / reference median in the same round)",
        "round_ratio_quartiles": spread,
        "rows": rows,
        "method": {
            "compiled": args.compile,
            "model": args.model,
            "device": args.device,
            "dtype": str(dtype).removeprefix("torch."),
            "attention": args.attention,
            "prompt": args.prompt,
            "budgets": budgets,
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "threads": args.threads,
            "clock": args.clock,
            "interleaved": True,
        },
        "load_average_at_end": list(os.getloadavg()),
        "environment": environment(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{'config':<18}{'ms/tok':>9}{'ops/step':>10}{'syncs':>7}{'MB':>8}")
    for row in rows:
        print(
            f"{row['config']:<18}{row['ms_per_token_median']:>9.1f}{row['aten_ops_per_decode_step']:>10}"
            f"{row['host_syncs_per_decode_step']:>7}{row['bytes_held'] / 2**20:>8.2f}"
        )
    print(f"\ncomposite / h2o: {ratios} (target <= {RATIO_TARGET}); per-round quartiles {spread}")
    print(f"composite growth {low} -> {high}: {growth} (target < {GROWTH_TARGET}); h2o growth: {h2o_growth}")


if __name__ == "__main__":
    main()
