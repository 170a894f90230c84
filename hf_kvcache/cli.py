"""The `hf-kvcache` command."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    import torch
    from tqdm.auto import tqdm

    from .demo import format_table, run_demo
    from .models import load_model
    from .text import load_tokens

    torch.manual_seed(0)
    print(f"Loading {args.model} ...", flush=True)
    model, tokenizer = load_model(args.model)
    ids = load_tokens(tokenizer, args.text, max_tokens=args.offset + args.prompt_tokens)[:, args.offset :]
    print(f"Prompt: {ids.shape[1]} tokens of {args.text!r}; generating {args.new_tokens} tokens per cache.", flush=True)
    rows = run_demo(model, tokenizer, ids, new_tokens=args.new_tokens, progress=lambda it: tqdm(it, desc="caches"))
    print()
    print(format_table(rows))
    print(
        "\nbytes held: what the cache allocated (buffers, scales, metadata); decode tok/s: one-token forwards through "
        "the cache (noisy on a shared machine);\ngen agree: positions where the greedy "
        "output equals the full cache's;\ntop-1: next-token argmax equal to the full cache's, teacher-forced on the "
        "full cache's continuation."
    )
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-kvcache", description="KV-cache compression for Hugging Face Transformers: demo and evaluation."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="generate with each cache on a model and print bytes held, speed and agreement with the full cache",
        description="A small budget sweep: one greedy generate per cache and budget (1/8, 1/4, 1/2 of the prompt).",
    )
    demo.add_argument("--model", default="smollm2", help="Hub id, local path, or 'smollm2' (offline; default)")
    demo.add_argument("--text", default="pydoc", help="'pydoc' (offline corpus; default), a text file, or hf:DATASET")
    demo.add_argument("--prompt-tokens", type=_positive_int, default=1024, help="prompt length (default 1024)")
    demo.add_argument("--new-tokens", type=_positive_int, default=64, help="tokens to generate (default 64)")
    demo.add_argument("--offset", type=int, default=20000, help="where the prompt starts in the corpus, in tokens")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
