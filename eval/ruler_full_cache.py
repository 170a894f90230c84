"""Which generated tasks can our small model do at all (issue 27): every task of hf_kvcache.evaluation.ruler through
the full cache (DynamicCache), per context length, mean score with a 95% interval, next to chance. A task enters the
leaderboard only where the full cache scores well above chance; the others are listed as dropped, with their scores.

    python eval/ruler_full_cache.py [--lengths 1024 2048] [--samples 10] [--out eval/results/ruler/full_cache.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stream_ppl import environment  # noqa: E402

from hf_kvcache.evaluation.ruler import TASKS, make_sample  # noqa: E402
from hf_kvcache.evaluation.ruler.board import interval95  # noqa: E402
from hf_kvcache.evaluation.ruler.protocol import run_sample  # noqa: E402

KEEP_MARGIN = 0.3  # kept when the full cache's mean is at least chance + this


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--tasks", nargs="+", default=sorted(TASKS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from hf_kvcache.evaluation.models import load_model

    model, tokenizer = load_model(args.model)
    rows, start = [], time.time()
    for task in args.tasks:
        for length in args.lengths:
            results = [run_sample(model, tokenizer, make_sample(task, length, seed, tokenizer),
                                  DynamicCache(config=model.config)) for seed in range(args.samples)]
            scores = [r["score"] for r in results]
            mean, (low, high) = sum(scores) / len(scores), interval95(scores)
            chance = results[0]["chance"]
            rows.append({"task": task, "context_len": length, "samples": len(scores), "mean": round(mean, 3),
                         "ci95": [round(low, 3), round(high, 3)], "chance": round(chance, 3),
                         "kept": mean >= chance + KEEP_MARGIN, "example_output": results[0]["output"][:120],
                         "example_answers": results[0]["answers"]})
            print(f"{task:18s} {length:5d} mean {mean:.2f} [{low:.2f}, {high:.2f}] chance {chance:.2f} "
                  f"{'kept' if rows[-1]['kept'] else 'DROPPED'}  e.g. {results[0]['output'][:60]!r}", flush=True)
    report = {"what": "full-cache (DynamicCache) scores of the generated RULER-style tasks, greedy, agnostic protocol",
              "model": args.model, "keep_rule": f"mean >= chance + {KEEP_MARGIN}", "rows": rows,
              "seconds": round(time.time() - start), "environment": environment()}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
