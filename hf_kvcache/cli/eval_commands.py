"""The evaluation subcommands of `hf-kvcache` (see `hf-kvcache --help`). Every cache, model, file and budget is
checked before a model is loaded, and errors say what is valid."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .args import MODEL_HELP, TEXT_HELP, int_list, non_negative_int, parse_cache, positive_float, positive_int


def needle_positions(text: str) -> list:
    """--positions: early / middle / late or depths in [0, 1], comma-separated."""
    from ..evaluation.retrieval import POSITIONS

    positions = []
    for item in text.split(","):
        try:
            depth = item if item in POSITIONS else float(item)
        except ValueError:
            depth = None
        if depth is None or (isinstance(depth, float) and not 0.0 <= depth <= 1.0):
            raise ValueError(
                f"--positions: each entry must be one of {list(POSITIONS)} or a depth in [0, 1], got {item!r}."
            )
        positions.append(depth)
    return positions


def _caches(args, context_len: int | None, default=("dynamic",)) -> list[tuple[str, str, dict]]:
    from ..evaluation.cache_spec import check_cache

    specs = [parse_cache(c) for c in (args.cache or default)]
    for _label, name, config in specs:
        check_cache(name, config, context_len=context_len, where=f"--cache {name}")
    return specs


def _check_model_arg(model: str) -> None:
    from ..sharing.models import OFFLINE_MODELS

    if model in OFFLINE_MODELS:
        return
    if model.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(model)):
        raise FileNotFoundError(f"--model {model!r}: no such model directory.")


def _check_text_arg(text: str) -> None:
    if text in ("pydoc",) or text.startswith("hf:"):
        return
    if not os.path.isfile(text):
        raise FileNotFoundError(f"--text {text!r}: not 'pydoc', 'hf:DATASET' or an existing text file.")


def _load(args):
    import torch

    from ..sharing.models import load_model

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    print(f"Loading {args.model} ...", file=sys.stderr, flush=True)
    try:
        return load_model(args.model, dtype=getattr(torch, args.dtype))
    except (OSError, ValueError) as err:
        raise OSError(f"cannot load model {args.model!r}: {err}") from err


def _tokens(args, tokenizer, n: int):
    from ..sharing.corpus import load_tokens

    return load_tokens(tokenizer, args.text, max_tokens=args.offset + n)[:, args.offset :]


def _write_json(path: str | None, data) -> None:
    if path:
        from ..evaluation.sweep_results import _json_default

        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=_json_default)
        print(f"wrote {path}", file=sys.stderr)


# -- commands --------------------------------------------------------------------------------------------------------
def cmd_caches(args) -> int:
    from ..evaluation.cache_spec import BUDGET_KEYS, available_caches, config_keys

    names = available_caches()
    for group in ("hf_kvcache", "transformers"):
        print(f"{group}:")
        for name in names[group]:
            print(f"  {name:<18} keys: {', '.join(config_keys(name)) or '(none)'}")
    print(f"\nbudget keys (tokens or a fraction of the context, e.g. 0.25 or 25%): {', '.join(BUDGET_KEYS)}")
    return 0


def cmd_memory(args) -> int:
    from ..evaluation import memory as m

    precisions = args.precisions.split(",")
    for p in precisions:
        m.get_precision(p)
    shapes = [m.get_shape(s) for s in args.shapes.split(",")]  # a Hub id or directory: its config, read once
    contexts = int_list(args.contexts, "--contexts")
    print(
        "Bytes per token = 2 x KV heads x head_dim x bytes per value (+ scales per group), summed over the layers "
        "holding every token;\na sliding-window layer holds at most its window (hybrid models: Gemma 2/3, GPT-OSS)\n"
    )
    print(
        m.format_rows(
            m.memory_table(shapes, precisions, contexts),
            [
                ("model", "model"),
                ("precision", "precision"),
                ("bytes_per_token", "per token"),
                ("tokens", "tokens"),
                ("bytes", "KV cache"),
            ],
        )
    )
    budgets = [None] + int_list(args.budgets, "--budgets") if args.budgets else [None]
    rows = m.concurrency_table(shapes[0], args.memory_gb * 1e9, args.weight_bits, precisions, contexts, budgets)
    shape = shapes[0]
    print(
        f"\nMax concurrent requests of {shape.name} in {args.memory_gb:g} GB after "
        f"{(shape.params_b or 0):g}B weights at {args.weight_bits} bits (budget: tokens a compressed cache keeps)\n"
    )
    print(
        m.format_rows(
            rows, [("precision", "precision"), ("context", "context"), ("budget", "budget"), ("requests", "requests")]
        )
    )
    if args.measure:
        specs = _caches(
            args, args.prompt_tokens, default=("dynamic", "sink:sinks=4,budget=0.25", "sliding:window=0.25")
        )
        model, tokenizer = _load(args)
        ids = _tokens(args, tokenizer, args.prompt_tokens)
        rows = m.measured_vs_theory(model, specs, ids)
        print(f"\nMeasured on {args.model} after {args.prompt_tokens} tokens ({next(model.parameters()).dtype})\n")
        print(
            m.format_rows(
                rows,
                [
                    ("cache", "cache"),
                    ("tokens_kept", "tokens kept"),
                    ("theory_bytes", "theory"),
                    ("measured_bytes", "measured"),
                    ("measured_over_theory", "measured/theory"),
                    ("dense_bytes", "dense"),
                ],
            )
        )
    return 0


def cmd_ppl(args) -> int:
    from ..evaluation.cache_spec import make_factory
    from ..evaluation.perplexity import run_perplexity

    _check_model_arg(args.model)
    _check_text_arg(args.text)
    specs = _caches(args, args.context)
    model, tokenizer = _load(args)
    ids = _tokens(args, tokenizer, args.tokens)
    results = []
    for label, name, config in specs:
        factory = make_factory(model, (name, config), context_len=args.context, total_len=args.tokens)
        kwargs = {}
        if args.mode == "stream" and args.checkpoint:
            kwargs = {"checkpoint": os.path.join(args.checkpoint, f"{label.replace('/', '_')}.pt"), "tag": label}
        r = run_perplexity(
            model, ids, factory, mode=args.mode, chunk=args.chunk, bucket=args.bucket, progress=True, **kwargs
        )
        r.pop("nlls")
        results.append({"cache": label, **r})
        print(f"\n{label}: perplexity {r['ppl']:.3f} over {r['tokens']} tokens, {r['protocol']}")
        for b in r["buckets"]:
            print(f"  tokens {b['bucket_start']:>6}-{b['bucket_end']:<6} ppl {b['ppl']:.3f}")
    _write_json(args.json, results)
    return 0


def cmd_divergence(args) -> int:
    from transformers import DynamicCache

    from ..evaluation.cache_spec import make_factory
    from ..evaluation.divergence import cache_logprobs, divergence_metrics
    from ..evaluation.memory import cache_nbytes, format_rows

    _check_model_arg(args.model)
    _check_text_arg(args.text)
    specs = _caches(args, args.prompt_tokens)
    model, tokenizer = _load(args)
    n, total = args.prompt_tokens, args.prompt_tokens + args.scored_tokens
    ids = _tokens(args, tokenizer, total)
    ref = cache_logprobs(
        model, ids, DynamicCache(config=model.config), n, args.prefill_chunk, progress=True, desc="reference"
    )
    rows = []
    for label, name, config in specs:
        cache = make_factory(model, (name, config), context_len=n, total_len=total)()
        logp = cache_logprobs(model, ids, cache, n, args.prefill_chunk, progress=True, desc=label)
        m = divergence_metrics(ref, logp, ids[0, n:].cpu(), k=args.top_k)
        rows.append({"cache": label, "bytes_held": cache_nbytes(cache), **m})
    print(f"\n{args.scored_tokens} tokens scored after a {n}-token prompt; reference: DynamicCache\n")
    k = f"top{args.top_k}_agreement"
    print(
        format_rows(
            rows,
            [
                ("cache", "cache"),
                ("bytes_held", "bytes held"),
                ("kl_mean", "KL mean"),
                ("kl_p99", "KL p99"),
                ("top1_agreement", "top-1"),
                (k, f"top-{args.top_k}"),
                ("ppl", "PPL"),
                ("ppl_ref", "PPL full"),
            ],
        )
    )
    _write_json(args.json, rows)
    return 0


def cmd_retrieval(args) -> int:
    from ..evaluation.cache_spec import make_factory
    from ..evaluation.memory import format_rows
    from ..evaluation.retrieval import KINDS, run_retrieval, summarize

    _check_model_arg(args.model)
    kinds = args.kinds.split(",")
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"--kinds: unknown probe {k!r}; valid probes are {list(KINDS)}.")
    positions = needle_positions(args.positions)
    lengths = int_list(args.context_lengths, "--context-lengths")
    specs = [(label, name, config) for length in lengths for label, name, config in _caches(args, length)]
    specs = list(dict.fromkeys((label, name, json.dumps(config)) for label, name, config in specs))
    model, tokenizer = _load(args)
    rows = []
    for label, name, config in specs:
        for n in lengths:
            factory = make_factory(model, (name, json.loads(config)), context_len=n, total_len=n + 64)
            detail = run_retrieval(
                model,
                tokenizer,
                factory,
                kinds,
                [n],
                positions,
                args.samples,
                args.seed,
                args.prefill_chunk,
                args.chat,
                progress=True,
            )
            for r in summarize(detail):
                rows.append({"cache": label, **r})
            if args.show_outputs:
                for d in detail:
                    print(f"  [{label} {d['kind']} {n} {d['position']}] expected {d['answer']} got {d['output']!r}")
    print(
        format_rows(
            rows,
            [
                ("cache", "cache"),
                ("kind", "probe"),
                ("context_len", "tokens"),
                ("position", "position"),
                ("n", "n"),
                ("exact_match", "exact"),
                ("parse_rate", "parsed"),
                ("value_match", "value match"),
            ],
        )
    )
    _write_json(args.json, rows)
    return 0


def cmd_speed(args) -> int:
    from ..evaluation.cache_spec import make_factory
    from ..evaluation.memory import format_rows
    from ..evaluation.speed import measure_speed

    _check_model_arg(args.model)
    _check_text_arg(args.text)
    specs = _caches(args, args.prompt_tokens, default=("dynamic", "sink:sinks=4,budget=0.25", "sliding:window=0.25"))
    model, tokenizer = _load(args)
    total = args.prompt_tokens + args.decode_tokens
    ids = _tokens(args, tokenizer, total)
    factories = {
        label: make_factory(model, (name, config), context_len=args.prompt_tokens, total_len=total)
        for label, name, config in specs
    }
    reference = next((label for label, name, config in specs if name == "dynamic" and not config), None)
    rows = measure_speed(
        model, ids, factories, args.prompt_tokens, args.decode_tokens, args.rounds, reference=reference, progress=True
    )
    print(
        f"\n{args.rounds} interleaved rounds, medians; prompt {args.prompt_tokens} tokens, "
        f"{args.decode_tokens} decode steps\n"
    )
    print(
        format_rows(
            rows,
            [
                ("cache", "cache"),
                ("prefill_s", "prefill s"),
                ("prefill_ratio", "x dynamic"),
                ("decode_ms_per_token", "decode ms/token"),
                ("decode_ratio", "x dynamic"),
            ],
        )
    )
    _write_json(args.json, rows)
    return 0


def cmd_sweep(args) -> int:
    from ..evaluation.sweep import format_summary, load_spec, run_sweep

    spec = load_spec(args.spec)
    if args.dry_run:
        cells = run_sweep(spec, args.out, dry_run=True)
        done = sum(c["done"] for c in cells)
        print(
            f"{spec.name}: {len(cells)} cells, {done} already done, {len(cells) - done} to run "
            f"(results in {os.path.join(args.out, spec.name)})"
        )
        for c in cells:
            print(
                f"  [{'x' if c['done'] else ' '}] {c['metric']:<9} n={c['context_len']:<6} "
                f"{c.get('label', '') or ', '.join(x[0] for x in c.get('caches', []))} "
                f"{c.get('kind', '')} {c.get('position', '')}"
            )
        return 0
    rows = run_sweep(spec, args.out, report_only=args.report_only)
    print(format_summary(rows))
    print(f"results: {os.path.join(args.out, spec.name)}/ (results.jsonl, results.csv, summary.json, *.png)")
    return 0


def cmd_lm_eval(args) -> int:
    return run_lm_eval(list(args.lm_eval_args))


def run_lm_eval(argv: list[str]) -> int:
    """`lm-eval run ARGS` with the hf-kvcache model registered and the local tasks on the include path."""
    try:
        from ..evaluation import lm_eval_adapter
    except ImportError as err:
        print(f"hf-kvcache lm-eval: error: {err}", file=sys.stderr)
        return 2
    if argv and argv[0] == "--":
        argv = argv[1:]
    if argv and argv[0] in ("-h", "--help"):
        print(__doc_lm_eval__)
    if "--model" not in argv:
        argv = ["--model", "hf-kvcache"] + argv
    if "--include_path" not in argv:
        argv += ["--include_path", str(lm_eval_adapter.TASKS_DIR)]
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", "run"] + argv if not argv or argv[0] not in ("run", "ls", "validate") else ["lm-eval"] + argv
    try:
        cli_evaluate()
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


__doc_lm_eval__ = """hf-kvcache lm-eval: lm-evaluation-harness with the model `hf-kvcache` registered and the local
tasks (kvcache_passkey, kvcache_records, group kvcache_probes) on the include path. Arguments go to `lm-eval run`.

  hf-kvcache lm-eval --model_args pretrained=smollm2 cache=sink 'cache_config={"sinks":4,"budget":256}' \\
      --tasks kvcache_passkey --limit 20 --metadata '{"context_tokens": 2048}'

model_args of hf-kvcache: pretrained (Hub id, path or smollm2), cache (a name from `hf-kvcache caches`),
cache_config (JSON or key:value;key:value), decode_tail (context tokens fed one per forward after the prefill;
default 1), prefill_chunk, cont_chunk, and every argument of lm-eval's `hf` model. lm-eval's help follows.
"""


def add_eval_commands(sub) -> None:
    def common(p, text=True):
        p.add_argument("--model", default="smollm2", help=MODEL_HELP)
        if text:
            p.add_argument("--text", default="pydoc", help=TEXT_HELP)
            p.add_argument("--offset", type=non_negative_int, default=20000, help="where the tokens start in the text")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
        p.add_argument("--json", default=None, help="also write the results to this JSON file")

    def cache_arg(p, default_text="dynamic"):
        p.add_argument(
            "--cache",
            action="append",
            metavar="NAME[:k=v,...]",
            help=f"a cache, repeatable (default: {default_text}); e.g. sink:sinks=4,budget=256, "
            "h2o:budget=0.2, quantized:backend=fp8; budget keys take tokens or a fraction",
        )

    p = sub.add_parser(
        "caches",
        help="list the cache names and their config keys",
        description="Every cache name the harness accepts (ours and transformers' own) and its keys.",
    )
    p.set_defaults(func=cmd_caches)

    p = sub.add_parser(
        "memory",
        help="KV-cache memory calculator (and measured bytes with --measure)",
        description="Bytes per token = 2 x layers x KV heads x head_dim x bytes per value, plus one scale (and zero "
        "point for -asym) per group for integer formats, layer by layer: a sliding-window layer holds at most its "
        "window (Gemma 2/3, GPT-OSS), a KV-sharing layer nothing. Prints the KV cache size per context and the max "
        "concurrent requests in a memory budget (a budget: tokens the full-attention layers keep); with --measure, "
        "loads a model and puts the bytes held by real caches next to the calculator.",
    )
    p.add_argument(
        "--shapes",
        default="llama-3-8b,llama-3-70b",
        help="model shapes, comma-separated: published ones (see hf_kvcache.evaluation.memory.SHAPES), "
        "Hub model ids (org/name: their config.json) or local checkpoint directories",
    )
    p.add_argument(
        "--precisions",
        default="fp16,fp8,int4-g64",
        help="comma-separated: fp32, fp16, bf16, fp8, int8-g64, int4-g64, int4-g32-asym, int2-g32-asym",
    )
    p.add_argument("--contexts", default="8192,32768,131072", help="context lengths in tokens, comma-separated")
    p.add_argument(
        "--memory-gb", type=positive_float, default=80.0, help="accelerator memory for the concurrency table"
    )
    p.add_argument("--weight-bits", type=positive_int, default=16, help="bits per weight for the concurrency table")
    p.add_argument("--budgets", default="4096,1024", help="token budgets of compressed caches in the concurrency table")
    p.add_argument("--measure", action="store_true", help="also measure bytes held by real caches on --model")
    p.add_argument("--prompt-tokens", type=positive_int, default=1024, help="tokens fed for --measure")
    common(p)
    cache_arg(p, "dynamic, sink 25%%, sliding 25%%")
    p.set_defaults(func=cmd_memory)

    p = sub.add_parser(
        "ppl",
        help="streaming perplexity of a long text through a cache",
        description="StreamingLLM protocol: one token per forward through the cache, NLL of the next token, "
        "perplexity overall and per bucket. --mode chunked feeds --chunk tokens per forward (faster; a token may then "
        "see up to chunk-1 tokens more than the budget).",
    )
    common(p)
    cache_arg(p)
    p.add_argument("--tokens", type=positive_int, default=4096, help="length of the stream (default 4096)")
    p.add_argument(
        "--context", type=positive_int, default=None, help="tokens that budget fractions refer to (default: --tokens)"
    )
    p.add_argument("--mode", choices=["stream", "chunked"], default="stream")
    p.add_argument("--chunk", type=positive_int, default=64, help="tokens per forward in chunked mode")
    p.add_argument("--bucket", type=positive_int, default=1024, help="bucket size for per-bucket perplexity")
    p.add_argument("--checkpoint", default=None, help="directory for resumable checkpoints (stream mode)")
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser(
        "divergence",
        help="KL, top-1 and top-k agreement of caches against the full cache",
        description="Prefill a prompt into each cache, then feed the next tokens one per forward (teacher-forced) and "
        "compare next-token distributions with DynamicCache on the same positions: mean and p99 KL(full||cache), "
        "top-1 and top-k agreement, perplexities.",
    )
    common(p)
    cache_arg(p)
    p.add_argument("--prompt-tokens", type=positive_int, default=2048)
    p.add_argument("--scored-tokens", type=positive_int, default=128)
    p.add_argument("--prefill-chunk", type=positive_int, default=None)
    p.add_argument("--top-k", type=positive_int, default=5)
    p.set_defaults(func=cmd_divergence, ppl_context=None)

    p = sub.add_parser(
        "retrieval",
        help="pass-key and JSON-records retrieval probes by needle position",
        description="Probes generated locally: a pass key in filler text, or N similar records (distractors share "
        "names, dates, near-identical ids) with the code of one asked for in strict JSON. The context is prefilled "
        "and compressed, then the question goes through the compressed cache and the answer is generated greedily.",
    )
    common(p, text=False)
    cache_arg(p)
    p.add_argument("--kinds", default="passkey,records", help="comma-separated: passkey, records")
    p.add_argument("--context-lengths", default="2048,4096,8192", help="prompt lengths in tokens")
    p.add_argument("--positions", default="early,middle,late", help="early, middle, late or depths in [0, 1]")
    p.add_argument("--samples", type=positive_int, default=3, help="probes per (kind, length, position)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-chunk", type=positive_int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the probe in the tokenizer's chat template")
    p.add_argument("--show-outputs", action="store_true", help="print every expected and generated answer")
    p.set_defaults(func=cmd_retrieval)

    p = sub.add_parser(
        "speed",
        help="prefill and decode speed as ratios to DynamicCache",
        description="Interleaved rounds (rotated order), medians per cache; ratios to DynamicCache of the same run.",
    )
    common(p)
    cache_arg(p, "dynamic, sink 25%%, sliding 25%%")
    p.add_argument("--prompt-tokens", type=positive_int, default=2048)
    p.add_argument("--decode-tokens", type=positive_int, default=32)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.set_defaults(func=cmd_speed)

    p = sub.add_parser(
        "sweep",
        help="run a YAML sweep spec (resumable) and write CSV/JSON/PNG results",
        description="Runs every cell of a spec (see eval/specs/*.yaml and hf_kvcache/evaluation/sweep.py for the "
        "format) not already in <out>/<name>/results.jsonl. The spec is validated before the model is loaded.",
    )
    p.add_argument("spec", help="path to the YAML spec")
    p.add_argument("--out", default="eval/results", help="results root (default eval/results)")
    mode = p.add_mutually_exclusive_group()  # each runs nothing, in its own way: asking for both is a mistake
    mode.add_argument("--dry-run", action="store_true", help="list the cells and which are done; load nothing")
    mode.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rewrite results.csv, summary.json and the plots from the cells already done",
    )
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser(
        "lm-eval",
        help="lm-evaluation-harness through a compressed cache (--model hf-kvcache)",
        description=__doc_lm_eval__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="arguments for `lm-eval run`")
    p.set_defaults(func=cmd_lm_eval, handles_errors=True)
