"""`hf-kvcache serve-bench`: the flags of hf_kvcache.evaluation.serve_bench (defaults from its ServeBenchSettings),
their parsing into settings (a malformed MIN-MAX range or scale list raises ValueError naming the flag), and what it
prints."""

from __future__ import annotations


def add_serve_bench_command(sub) -> None:
    """The `serve-bench` subcommand of `hf-kvcache` (hf_kvcache.cli)."""
    from ..evaluation.serve_bench import ServeBenchSettings
    from ..evaluation.serve_bench import __doc__ as bench_doc
    from .args import MODEL_HELP

    d = ServeBenchSettings()
    p = sub.add_parser(
        "serve-bench",
        help="continuous batching under a fixed KV memory budget: model-dtype vs FP8 / INT8 pages",
        description=bench_doc.split("\n\n")[0] + " Writes OUT.json, OUT.csv and OUT.png.",
    )
    p.add_argument("--model", default=d.model, help=MODEL_HELP)
    p.add_argument("--dtype", default=d.dtype, help=f"model (and reference page) dtype (default {d.dtype})")
    p.add_argument("--device", default=d.device, help=f"cpu or cuda (default {d.device})")
    p.add_argument("--requests", type=int, default=d.requests, help=f"number of requests (default {d.requests})")
    p.add_argument(
        "--prompt-lengths",
        default=f"{d.prompt_min}-{d.prompt_max}",
        metavar="MIN-MAX",
        help="prompt length range in tokens (default %(default)s)",
    )
    p.add_argument(
        "--new-tokens",
        default=f"{d.new_min}-{d.new_max}",
        metavar="MIN-MAX",
        help="generation length range (default %(default)s)",
    )
    p.add_argument(
        "--budget-tokens",
        type=int,
        default=d.budget_tokens,
        help=f"KV memory budget, in tokens of the whole model in model-dtype pages (default {d.budget_tokens})",
    )
    p.add_argument(
        "--budget-scales",
        default=",".join(map(str, d.budget_scales)),
        help="budgets for the concurrency plot, as multiples of --budget-tokens (default %(default)s)",
    )
    p.add_argument(
        "--formats",
        default=",".join(d.formats),
        help="page formats, 'model' first (default %(default)s); FORMAT:hadamard / FORMAT:none sets the "
        "key rotation (default: hadamard for FP8 and INT4, none for INT8)",
    )
    p.add_argument(
        "--kv-compress",
        default=",".join(d.kv_compress),
        help="prompt eviction settings each format runs with, 'none' first (e.g. none,keydiff:budget=0.25,"
        "knorm:budget=512: what each prompt keeps, hf_kvcache.paged.compress_spec; SPEC@head for pages of one layer "
        "and KV head, each its own budget: --kv-layout head of hf-kvcache serve; default %(default)s)",
    )
    p.add_argument("--page-size", type=int, default=d.page_size, help=f"tokens per page (default {d.page_size})")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=d.max_batch_tokens,
        help=f"tokens per forward (default {d.max_batch_tokens})",
    )
    p.add_argument(
        "--kl-requests",
        type=int,
        default=d.kl_requests,
        help=f"requests scored with QuantizedFP8Cache on the same text (default {d.kl_requests})",
    )
    p.add_argument("--rounds", type=int, default=d.rounds, help="repeats of the interleaved sweep (default 1)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=d.out, help="output path without suffix (default %(default)s)")
    p.set_defaults(func=_serve_bench_cli)


def parse_range(text: str, name: str) -> tuple[int, int]:
    """(MIN, MAX) from 'MIN-MAX'; a ValueError naming --`name` otherwise (the bounds are the caller's to check)."""
    try:
        low, high = (int(x) for x in text.split("-"))
    except ValueError:
        raise ValueError(f"--{name} must be MIN-MAX (two integers), got {text!r}.") from None
    return low, high


def _serve_bench_cli(args) -> int:
    from ..evaluation.serve_bench import ServeBenchSettings, run_serve_bench, summary_lines, write_results

    prompt_min, prompt_max = parse_range(args.prompt_lengths, "prompt-lengths")
    new_min, new_max = parse_range(args.new_tokens, "new-tokens")
    try:
        scales = tuple(float(x) for x in args.budget_scales.split(","))
    except ValueError:
        raise ValueError(f"--budget-scales must be comma-separated numbers, got {args.budget_scales!r}.") from None
    settings = ServeBenchSettings(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        requests=args.requests,
        prompt_min=prompt_min,
        prompt_max=prompt_max,
        new_min=new_min,
        new_max=new_max,
        budget_tokens=args.budget_tokens,
        budget_scales=scales,
        page_size=args.page_size,
        max_batch_tokens=args.max_batch_tokens,
        formats=tuple(f.strip() for f in args.formats.split(",")),
        kv_compress=tuple(c.strip() for c in args.kv_compress.split(",")),
        kl_requests=args.kl_requests,
        rounds=args.rounds,
        seed=args.seed,
        threads=args.threads,
        out=args.out,
    )
    result = run_serve_bench(settings)
    for path in write_results(result, settings.out):
        print(f"wrote {path}")
    for line in summary_lines(result):
        print(line)
    return 0
