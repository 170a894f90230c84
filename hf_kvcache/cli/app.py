"""The `hf-kvcache` command."""

from __future__ import annotations

import argparse
import sys

from .args import MODEL_HELP, TEXT_HELP, non_negative_int, positive_int


def _demo(args) -> int:
    import time

    import torch

    from ..evaluation.demo import format_table, run_demo
    from ..evaluation.demo_report import write_demo_report
    from ..sharing.corpus import load_tokens
    from ..sharing.models import load_model

    start = time.perf_counter()
    torch.manual_seed(0)
    print(f"Loading {args.model} ...", flush=True)
    model, tokenizer = load_model(args.model)
    ids = load_tokens(tokenizer, args.text, max_tokens=args.offset + args.prompt_tokens)[:, args.offset :]
    print(
        f"Prompt: {ids.shape[1]} tokens of {args.text!r}; {args.new_tokens} new tokens per cache (a bar per row "
        "counts its forwards: prefill, generation, teacher-forced pass).",
        flush=True,
    )
    rows = run_demo(model, tokenizer, ids, new_tokens=args.new_tokens, progress=True)
    settings = {
        "model": args.model,
        "text": args.text,
        "offset": args.offset,
        "prompt_tokens": ids.shape[1],
        "new_tokens": args.new_tokens,
        "torch_threads": torch.get_num_threads(),
        "total_seconds": time.perf_counter() - start,
    }
    paths = write_demo_report(rows, args.out, settings)
    print()
    print(format_table(rows))
    print(
        "\nbytes held: what the cache allocated (buffers, scales, metadata); decode tok/s: generate's one-token "
        "forwards through the cache (noisy on a shared machine);\ngen agree: positions where the greedy "
        "output equals the full cache's;\ntop-1: next-token argmax equal to the full cache's, teacher-forced on the "
        "full cache's continuation; row s: wall time of the row."
    )
    print(f"\nTable and plot: {', '.join(str(p) for p in paths)} ({time.perf_counter() - start:.0f} s in all)")
    return 0


def _export_hub(args) -> int:
    from ..sharing.export import export_custom_generate
    from .args import parse_cache

    text, name, config = parse_cache(args.cache)
    model_config = None
    if args.model is not None:
        from transformers import AutoConfig

        try:
            model_config = AutoConfig.from_pretrained(args.model)
        except (OSError, ValueError) as err:
            raise OSError(f"--model {args.model!r}: cannot load its config: {err}") from err
    written = export_custom_generate(
        args.directory, name, config, model_config=model_config, overwrite=args.overwrite, source=f"--cache {text!r}"
    )
    for rel in written.values():
        print(rel)
    print(
        f"Use: model.generate(..., custom_generate={args.directory!r}, trust_remote_code=True), or push the "
        f"folder to a Hub repo and pass its id."
    )
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `hf-kvcache` parser. `main` passes the command it runs: for "serve" the harness's subcommands are left out,
    so that the server imports nothing of the harness (whose settings are the benchmark commands' defaults)."""
    parser = argparse.ArgumentParser(
        prog="hf-kvcache",
        description="KV-cache compression for Hugging Face Transformers: demo and evaluation. Caches are named as "
        "NAME or NAME:key=value,key=value (e.g. sink:sinks=4,budget=256 or sliding:window=25%); `hf-kvcache "
        "caches` lists them. Budget keys take tokens or a fraction of the context.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    from ..version import __version__

    parser.add_argument("--version", action="version", version=f"hf-kvcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="generate with each cache on a model and print bytes held, speed and agreement with the full cache",
        description="A small budget sweep: per cache and budget (1/8, 1/4, 1/2 of the prompt), one prefill, a greedy "
        "generate and a teacher-forced pass; writes demo.csv, demo.json and demo.png (quality vs bytes) to --out.",
    )
    demo.add_argument("--model", default="smollm2", help=MODEL_HELP)
    demo.add_argument("--text", default="pydoc", help=TEXT_HELP)
    demo.add_argument("--prompt-tokens", type=positive_int, default=512, help="prompt length (default 512)")
    demo.add_argument("--new-tokens", type=positive_int, default=32, help="tokens to generate (default 32)")
    demo.add_argument(
        "--offset", type=non_negative_int, default=20000, help="where the prompt starts in the corpus, in tokens"
    )
    demo.add_argument(
        "--out", default="demo_results", help="directory for demo.csv / .json / .png (default demo_results)"
    )
    demo.set_defaults(func=_demo)
    export = sub.add_parser(
        "export-hub",
        help="write a Hub-ready custom_generate folder that generates with a cache",
        description="Write DIR/custom_generate/generate.py, DIR/custom_generate/requirements.txt and DIR/README.md "
        "(tag custom_generate): model.generate(..., custom_generate=DIR or its Hub repo, trust_remote_code=True) "
        "then generates with the cache.",
    )
    export.add_argument("directory", metavar="DIR", help="folder to write (created when missing)")
    export.add_argument(
        "--cache",
        required=True,
        metavar="NAME:key=value,...",
        help="cache name and settings, e.g. sink:sinks=4,window=1020 or 'composite:{\"regions\": [...]}'",
    )
    export.add_argument(
        "--model",
        metavar="ID|PATH",
        help="check the settings against this model's config "
        "(folder or Hub id) instead of a minimal Llama-shaped one (head_dim 8)",
    )
    export.add_argument("--overwrite", action="store_true", help="replace existing files of the folder")
    export.set_defaults(func=_export_hub)
    from .eval_commands import add_eval_commands
    from .kvzap_command import add_train_kvzap_command
    from .ruler_command import add_ruler_command
    from .serve_bench_command import add_serve_bench_command
    from .serve_command import add_serve_command

    if command == "serve":
        add_serve_command(sub)
        return parser
    add_eval_commands(sub)
    add_ruler_command(sub)
    add_serve_bench_command(sub)
    add_serve_command(sub)
    add_train_kvzap_command(sub)
    return parser


_EPILOG = """commands:
  demo        generate with each cache and print bytes held, speed and agreement with the full cache
  export-hub  write a Hub-ready custom_generate folder (generate(custom_generate=DIR, trust_remote_code=True))
  caches      list the cache names and their config keys
  memory      KV-cache bytes per token / per context for model shapes and precisions; max concurrent requests;
              with --measure, bytes held by real caches next to the calculator
  ppl         streaming perplexity of a long text through a cache (exact one-token protocol, or chunked)
  divergence  KL / top-1 / top-k of caches against the full cache on the same positions
  retrieval   pass-key and JSON-records probes at early/middle/late positions
  speed       prefill time and decode ms/token as ratios to DynamicCache, measured interleaved
  sweep       run a YAML spec (caches x budgets x metrics x context lengths), resumable, CSV/JSON/PNG
  ruler       the RULER-style leaderboard: generated tasks x caches x compressions x protocols, resumable
  lm-eval     lm-evaluation-harness with --model hf-kvcache and the local probe tasks
  serve-bench continuous batching under a KV memory budget: model-dtype vs FP8 / INT8 pages (concurrency,
              tokens/s, TTFT, KL)
  serve       transformers' OpenAI-compatible server with FP8 / INT8 / INT4 KV pages in a given KV memory
  train-kvzap fit a KVzap surrogate (per-layer predictor of KVzip scores from attention inputs), print its fit

Run `hf-kvcache COMMAND --help` for the options of each."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "lm-eval":  # everything after it belongs to lm-eval (argparse cannot pass "--x" through)
        from .eval_commands import run_lm_eval

        return run_lm_eval(argv[1:])
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    if getattr(args, "handles_errors", False):
        return args.func(args)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head`
        return 0
    except (ValueError, FileNotFoundError, OSError) as err:  # a bad sweep spec's SpecError is a ValueError
        print(f"hf-kvcache {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
