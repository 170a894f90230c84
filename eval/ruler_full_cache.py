"""Which generated tasks can our small model do at all (issue 27): every task of hf_kvcache.evaluation.ruler through
the full cache (DynamicCache), per context length, mean score with a 95% interval, next to chance. A task enters the
leaderboard only where the full cache scores well above chance; the others are listed as dropped, with their scores.

    python eval/ruler_full_cache.py [--lengths 1024 2048] [--samples 10] [--out eval/results/ruler/full_cache.json]
    python eval/ruler_full_cache.py --device cuda --dtype bfloat16 --batch-size 25 --lengths 4096 --samples 20 ...
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stream_ppl import environment  # noqa: E402

from hf_kvcache.evaluation.cache_spec import make_cache  # noqa: E402
from hf_kvcache.evaluation.ruler import TASKS  # noqa: E402
from hf_kvcache.evaluation.ruler.board import records, run_board, summarize  # noqa: E402

KEEP_MARGIN = 0.3  # kept when the full cache's mean is at least chance + this


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--tasks", nargs="+", default=sorted(TASKS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument(
        "--board",
        type=Path,
        default=None,
        help="a board directory to answer in (its samples and answers are reused); default: a temporary one",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from hf_kvcache.sharing.models import load_model

    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    board = args.board or Path(tempfile.mkdtemp(prefix="ruler_full_"))
    start = time.time()
    run_board(
        model,
        tokenizer,
        lambda name, config, context: make_cache(model, name, config, context),
        [],
        [0.0],
        ["agnostic"],
        args.tasks,
        args.lengths,
        args.samples,
        board,
        batch_size=args.batch_size,
    )
    answers = [r for r in records(board) if r["method"] == "full" and r["seed"] < args.samples]
    rows = []
    for cell in summarize(board)["cells"]:
        if cell["method"] != "full" or cell["task"] not in args.tasks or cell["context_len"] not in args.lengths:
            continue
        mine = sorted(
            (r for r in answers if r["task"] == cell["task"] and r["context_len"] == cell["context_len"]),
            key=lambda r: r["seed"],
        )
        chance = mine[0]["chance"]
        rows.append(
            {
                "task": cell["task"],
                "context_len": cell["context_len"],
                "samples": len(mine),
                "mean": round(cell["score"], 3),
                "ci95": [round(x, 3) for x in cell["ci95"]],
                "chance": round(chance, 3),
                "kept": cell["score"] >= chance + KEEP_MARGIN,
                "example_output": mine[0]["output"][:120],
                "example_answers": mine[0]["answers"],
            }
        )
        print(
            f"{cell['task']:18s} {cell['context_len']:5d} mean {cell['score']:.2f} [{cell['ci95'][0]:.2f}, "
            f"{cell['ci95'][1]:.2f}] chance {chance:.2f} {'kept' if rows[-1]['kept'] else 'DROPPED'}  "
            f"e.g. {mine[0]['output'][:60]!r}",
            flush=True,
        )
    report = {
        "what": "full-cache (DynamicCache) scores of the generated RULER-style tasks, greedy, agnostic protocol",
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "keep_rule": f"mean >= chance + {KEEP_MARGIN}",
        "rows": rows,
        "seconds": round(time.time() - start),
        "environment": environment(),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
