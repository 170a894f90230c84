"""`hf-kvcache train-kvzap`: fit a KVzap surrogate (hf_kvcache.evaluation.kvzap_training) and print its fit.

    hf-kvcache train-kvzap --model smollm2 --out kvzap-smollm2                    # linear, offline pydoc corpus
    hf-kvcache train-kvzap --model M --out DIR --kind mlp --dataset NAME --split train --text-field text

Writes DIR/model.safetensors and DIR/config.json (the report: settings and the held-out fit), loadable with
`hf_kvcache.scorers.kvzap_surrogate.Surrogate.load(DIR)`.
"""

from __future__ import annotations

import argparse

from .args import non_negative_int, positive_int


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1), got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1), got {text!r}")
    return value


def _at_least_two(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2 (windows to train on and to hold out), got {value}")
    return value


def text_source(args) -> tuple[str, dict]:
    """(source, load_text keywords) from --dataset / --split / --text-field / --dataset-config; those three need
    --dataset."""
    if args.dataset is None:
        given = [flag for flag, value in (("--split", args.split), ("--text-field", args.text_field)) if value]
        given += ["--dataset-config"] if args.dataset_config else []
        if given:
            raise ValueError(f"{', '.join(given)}: only with --dataset NAME (the default text is the pydoc corpus).")
        return "pydoc", {}
    kwargs = {"split": args.split or "train", "field": args.text_field or "text", "config": args.dataset_config}
    return f"hf:{args.dataset}", kwargs


def format_fit(report: dict) -> str:
    """The held-out fit as a table: a row per layer, then the mean over layers."""
    fit = report["fit"]["held_out"]
    names = ("r2", "pearson", "spearman", "top20_overlap")
    lines = [f"{'layer':>7s} " + " ".join(f"{n:>14s}" for n in names)]
    for index, row in fit["per_layer"].items():
        lines.append(f"{index:>7s} " + " ".join(f"{row[n]:14.3f}" for n in names))
    lines.append(f"{'mean':>7s} " + " ".join(f"{fit['overall'][n]:14.3f}" for n in names))
    return "\n".join(lines)


def cmd_train_kvzap(args) -> int:
    import torch

    from ..evaluation.kvzap_training import DEFAULT_SKIP, train_kvzap
    from ..sharing.models import load_model

    source, text_kwargs = text_source(args)
    torch.manual_seed(args.seed)
    print(f"Loading {args.model} ...", flush=True)
    model, tokenizer = load_model(args.model, device=args.device)
    report = train_kvzap(
        model,
        tokenizer,
        args.out,
        source=source,
        text_kwargs=text_kwargs,
        contexts=args.contexts,
        context_len=args.context_len,
        kind=args.kind,
        held_out=args.held_out,
        skip_tokens=DEFAULT_SKIP if source == "pydoc" else None,
        seed=args.seed,
        width=args.width,
        epochs=args.epochs,
        model_name=args.model,
        progress=not args.quiet,
    )
    training = report["training"]
    print(format_fit(report))
    print(
        f"\n{args.kind} surrogate: {len(training['train_windows'])} windows trained on, "
        f"{len(training['held_out_windows'])} held out, {training['seconds']:.0f} s; written to {args.out}"
    )
    return 0


def add_train_kvzap_command(sub) -> None:
    p = sub.add_parser(
        "train-kvzap",
        help="fit a KVzap surrogate (per-layer predictor of KVzip scores) for a model and print its fit",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", required=True, help="a Hub id, a local directory, or smollm2 (offline)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write model.safetensors and config.json to")
    p.add_argument("--contexts", type=_at_least_two, default=10, help="context windows in all (default 10)")
    p.add_argument("--context-len", type=_at_least_two, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--kind", choices=["linear", "mlp"], default="linear", help="predictor per layer (default linear)")
    p.add_argument("--held-out", type=_fraction, default=0.2, help="share of the windows held out (default 0.2)")
    p.add_argument("--width", type=positive_int, default=64, help="hidden width of the mlp (default 64)")
    p.add_argument("--epochs", type=positive_int, default=20, help="Adam epochs of the mlp (default 20)")
    p.add_argument("--dataset", default=None, help="a `datasets` name to train on instead of the pydoc corpus")
    p.add_argument("--split", default=None, help="the dataset's split (default train)")
    p.add_argument("--text-field", default=None, help="the dataset's text column (default text)")
    p.add_argument("--dataset-config", default=None, help="the dataset's configuration name")
    p.add_argument("--seed", type=non_negative_int, default=0, help="window choice and MLP init (default 0)")
    p.add_argument("--device", default="cpu", help="where the model runs (default cpu)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train_kvzap)
