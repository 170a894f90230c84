"""H2O speed against DynamicCache on SmolLM2-135M (offline), one interleaved run: prefill of a 2K-token prompt and
decode ms/token at a 20% budget (heavy 10% + recent 10% of the prompt).

H2O needs the attention probabilities each key column receives; the bridge computes them in the same pass as the
attention output (hf_kvcache.attention.scored), query-chunked. Targets (issue 13): prefill <= 1.3x DynamicCache at
2K tokens, decode <= 1.1x at a 20% budget.

Method:
- Each round builds a fresh cache per configuration (order rotated per round), times the prefill of the prompt
  (one forward, `logits_to_keep=1`), then `--warmup` untimed and `--steps` timed one-token forwards of the
  following corpus tokens (teacher-forced, as generate's decode would run them).
- Ratios are paired: per round, H2O's figure over DynamicCache's in the same round (prefill seconds; median
  ms/token for decode); the reported ratio is the median over rounds. Ratios of overall medians are reported too.
  Interleaving spreads a shared machine's noise over both configurations.

    .venv/bin/python eval/bench_h2o.py                 # writes eval/results/h2o_speed.{json,csv}
    .venv/bin/python eval/bench_h2o.py --clock cpu     # thread CPU time: eval/results/h2o_speed_cpu.{json,csv}
    .venv/bin/python eval/bench_h2o.py --rounds 3 --prompt 1024 --results /tmp/x   # quicker look
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stream_ppl import environment  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import hf_kvcache  # noqa: E402
from hf_kvcache import cache_kwargs  # noqa: E402

PREFILL_TARGET, DECODE_TARGET = 1.3, 1.1


@torch.inference_mode()
def measure(model, cache, ids, prompt: int, warmup: int, steps: int, clock=time.perf_counter):
    """(prefill seconds, timed decode seconds per step) for one fresh cache, on `clock`."""
    t0 = clock()
    model(input_ids=ids[:, :prompt], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    prefill = clock() - t0
    times = []
    for i in range(prompt, prompt + warmup + steps):
        t0 = clock()
        model(input_ids=ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True)
        times.append(clock() - t0)
    return prefill, times[warmup:]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens (default 2048)")
    parser.add_argument(
        "--budget",
        type=float,
        default=0.2,
        help="H2O budget as a fraction of the prompt, split evenly between heavy and recent (default 0.2)",
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per round and configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: time.perf_counter; cpu: time.thread_time, the CPU time of the calling thread, "
        "which other processes on a shared machine disturb far less (meaningful with --threads 1, "
        "where torch computes in the calling thread)",
    )
    parser.add_argument("--offset", type=int, default=20000, help="where the prompt starts in the pydoc corpus")
    parser.add_argument("--results", type=Path, default=ROOT / "eval" / "results")
    args = parser.parse_args(argv)
    if not 0 < args.budget <= 1:
        raise SystemExit(f"--budget must be in (0, 1], got {args.budget}")
    torch.set_num_threads(args.threads)
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu measures the calling thread only: use it with --threads 1")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time

    import transformers

    transformers.logging.set_verbosity_error()
    from hf_kvcache.sharing.corpus import load_tokens
    from hf_kvcache.sharing.models import load_model

    model, tokenizer = load_model("smollm2")
    hf_kvcache.enable(model)
    need = args.offset + args.prompt + args.warmup + args.steps
    ids = load_tokens(tokenizer, "pydoc", max_tokens=need)[:, args.offset :]
    half = args.budget / 2
    configs = {
        "dynamic": lambda: DynamicCache(config=model.config),
        f"h2o {half:g}+{half:g}": lambda: hf_kvcache.H2OCache(model, heavy=half, recent=half),
    }
    names = list(configs)
    base, h2o = names
    measure(model, configs[h2o](), ids, 128, 1, 2)  # warm-up
    prefill = {n: [] for n in names}
    decode = {n: [] for n in names}  # per-round median seconds per step
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for n in names[r % 2 :] + names[: r % 2]:
            p, steps = measure(model, configs[n](), ids, args.prompt, args.warmup, args.steps, clock)
            prefill[n].append(p)
            decode[n].append(statistics.median(steps))
        print(
            f"round {r + 1}/{args.rounds}: prefill {prefill[h2o][-1] / prefill[base][-1]:.3f}x, decode "
            f"{decode[h2o][-1] / decode[base][-1]:.3f}x ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )

    def paired(series):
        return statistics.median(a / b for a, b in zip(series[h2o], series[base]))

    rows = [
        {
            "cache": n,
            "prompt_tokens": args.prompt,
            "prefill_s_median": round(statistics.median(prefill[n]), 4),
            "decode_ms_per_token_median": round(1000 * statistics.median(decode[n]), 3),
            "prefill_ratio_paired": round(paired(prefill), 3) if n == h2o else 1.0,
            "decode_ratio_paired": round(paired(decode), 3) if n == h2o else 1.0,
            "prefill_ratio_of_medians": round(statistics.median(prefill[n]) / statistics.median(prefill[base]), 3),
            "decode_ratio_of_medians": round(statistics.median(decode[n]) / statistics.median(decode[base]), 3),
        }
        for n in names
    ]
    result = rows[1]
    info = {
        "what": f"H2OCache(heavy={half:g}, recent={half:g}) vs DynamicCache, SmolLM2-135M float32, "
        f"{args.prompt}-token pydoc prompt: prefill seconds and decode ms/token after it",
        "targets": {"prefill": f"<= {PREFILL_TARGET}x", "decode": f"<= {DECODE_TARGET}x"},
        "prefill_ratio": result["prefill_ratio_paired"],
        "decode_ratio": result["decode_ratio_paired"],
        "pass": {
            "prefill": result["prefill_ratio_paired"] <= PREFILL_TARGET,
            "decode": result["decode_ratio_paired"] <= DECODE_TARGET,
        },
        "ratio_statistic": "median over rounds of (H2O / DynamicCache in the same round)",
        "per_round": {"prefill_s": prefill, "decode_s_per_token": decode},
        "load_average_at_end": list(os.getloadavg()),
        "method": {
            "clock": args.clock,
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "threads": args.threads,
            "interleaved": True,
            "order": "rotated per round",
            "offset": args.offset,
        },
        "rows": rows,
        "environment": environment(),
    }
    args.results.mkdir(parents=True, exist_ok=True)
    stem = "h2o_speed" if args.clock == "wall" else "h2o_speed_cpu"
    (args.results / f"{stem}.json").write_text(json.dumps(info, indent=1) + "\n")
    with open(args.results / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        print(row)
    print(
        f"prefill {info['prefill_ratio']}x (target <= {PREFILL_TARGET}), decode {info['decode_ratio']}x "
        f"(target <= {DECODE_TARGET}); load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
