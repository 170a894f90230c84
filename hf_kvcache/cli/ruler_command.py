"""`hf-kvcache ruler`: the RULER-style leaderboard (hf_kvcache.evaluation.ruler.board) from the command line.

    hf-kvcache ruler --lengths 2048 4096 --samples 50 --out eval/results/ruler            # every default method
    hf-kvcache ruler --method "KVzip=kvzip:head_budget=adaptive,layer_budget=adaptive" --tasks niah_single_2 ...

    hf-kvcache ruler --device cuda --dtype bfloat16 --batch-size 25 --shard 0/4 ...       # one of 4 processes on a GPU

Resumable: the answers already in OUT/results*.jsonl are not recomputed. Writes OUT/cells.csv (one row per method,
compression, protocol, task, length: mean score, 95% interval, n), OUT/board.csv and OUT/board.json (mean over the
tasks per method, compression, protocol, length) and OUT/board.png (score vs compression, one line per method).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .args import parse_cache, positive_int


def _method(text: str):
    """ "LABEL=NAME:key=value,..." (or "NAME:..." labelled by itself); the kept share goes to `budget`, or to
    `window` for sink and sliding."""
    from ..evaluation.ruler.board import Method

    label, _, spec = text.partition("=") if "=" in text.split(":", 1)[0] else ("", "", text)
    _, name, config = parse_cache(spec)
    key = "window" if name in ("sink", "sliding") else "budget"
    # model-wide layer shares (kvzip / kvzap by default) are averaged over a batch's rows: those run alone
    model_wide = name in ("kvzip", "kvzap") and config.get("layer_budget", "adaptive") == "adaptive"
    return Method(label or spec, name, config, budget_key=key, batchable=not model_wide)


def _shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and 0 <= int(index) < int(count)):
        raise ValueError(f"--shard: expected I/N with 0 <= I < N (e.g. 0/4), got {text!r}.")
    return int(index), int(count)


def select_methods(methods: list, only: list[str], exclude: list[str]) -> tuple[list, bool]:
    """(the methods `--only` / `--exclude` leave, whether the full cache runs): a method runs when its label contains
    one of `only` (if given) and none of `exclude`; the full cache (compression 0) is the method labelled "full", so
    `--only KVzip` runs KVzip alone (processes split by method then never both run the full cache) and `--only full`
    the full cache alone."""
    from ..evaluation.ruler.board import FULL_LABEL

    def kept(label: str) -> bool:
        return (not only or any(part in label for part in only)) and not any(part in label for part in exclude)

    left, full = [m for m in methods if kept(m.label)], kept(FULL_LABEL)
    if not left and not full:
        raise ValueError(f"--only / --exclude: no method left of {[m.label for m in methods] + [FULL_LABEL]}.")
    return left, full


def cmd_ruler(args) -> int:
    from ..evaluation.cache_spec import make_cache
    from ..evaluation.ruler import TASKS
    from ..evaluation.ruler.board import DEFAULT_METHODS, plot_board, result_files, run_board, summarize
    from ..sharing.models import load_model

    unknown = sorted(set(args.tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"--tasks: {unknown} are not tasks; the tasks are {sorted(TASKS)}.")
    methods = [_method(m) for m in args.method] if args.method else DEFAULT_METHODS
    methods, full = select_methods(methods, args.only, args.exclude)
    compressions = args.compressions if full else [c for c in args.compressions if c != 0.0]
    shard = _shard(args.shard)
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if not args.summarize_only:
        model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
        run_board(
            model,
            tokenizer,
            lambda name, config, context: make_cache(model, name, config, context),
            methods,
            compressions,
            args.protocols,
            args.tasks,
            args.lengths,
            args.samples,
            out,
            progress=not args.quiet,
            batch_size=args.batch_size,
            shard=shard,
            keep_going=args.keep_going,
        )
        if shard[1] > 1:
            return 0  # the shards' answers are summarized by one `--summarize-only` run once all have finished
    if not out.is_dir() or not result_files(out):
        raise ValueError(f"--out {str(out)!r}: no answers to summarize (results*.jsonl) there.")
    summary = summarize(out, args.tasks)
    for name, rows in (("cells", summary["cells"]), ("board", summary["board"])):
        with (out / f"{name}.csv").open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    (out / "board.json").write_text(json.dumps({"model": args.model, "tasks": args.tasks, **summary}, indent=1) + "\n")
    plot_board(summary["board"], out / "board.png", args.title or f"{args.model}: generated RULER-style tasks")
    for row in summary["board"]:
        print(
            f"{row['method']:28s} {row['compression']:.2f} {row['protocol']:8s} {row['context_len']:6d} "
            f"{row['score']:.3f} +- {row['ci95_halfwidth']:.3f} (n={row['samples']})"
        )
    return 0


def add_ruler_command(sub) -> None:
    from ..evaluation.ruler import TASKS
    from ..evaluation.ruler.protocol import PROTOCOLS

    p = sub.add_parser(
        "ruler",
        help="the RULER-style leaderboard: generated tasks x caches x compressions",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", default="smollm2", help="a Hub id, a local directory, or smollm2 (offline)")
    p.add_argument(
        "--method",
        action="append",
        default=[],
        help='"LABEL=NAME:key=value,...", repeatable (default: every cache family, see the docs)',
    )
    p.add_argument("--compressions", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 0.9])
    p.add_argument("--protocols", nargs="+", default=["agnostic"], choices=PROTOCOLS)
    p.add_argument("--tasks", nargs="+", default=sorted(TASKS))
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[2048])
    p.add_argument("--samples", type=positive_int, default=50)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--device", default="cpu", help="where the model runs, e.g. cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=1,
        help="samples of a cell generated together, left-padded (rows share the budget of their mean context length)",
    )
    p.add_argument("--shard", default="0/1", help="I/N: run every N-th cell from the I-th, writing results.IofN.jsonl")
    p.add_argument("--only", nargs="+", default=[], help="run the default methods whose label contains one of these")
    p.add_argument("--exclude", nargs="+", default=[], help="leave out the methods whose label contains one of these")
    p.add_argument("--keep-going", action="store_true", help="record a failing batch in OUT/errors.jsonl and go on")
    p.add_argument("--title", default=None, help="the plot's title (default: the model and the suite)")
    p.add_argument("--summarize-only", action="store_true", help="write the tables and the plot from OUT's answers")
    p.add_argument("--out", default="ruler_results")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_ruler)
