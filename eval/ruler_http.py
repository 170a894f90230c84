"""RULER-style needle tasks through `hf-kvcache serve`'s HTTP API, per prompt-eviction setting: the server's accuracy
with `kv_compress` (hf_kvcache.paged.eviction), to set beside the same method through `generate` (`hf-kvcache ruler`,
eval/results/ruler*) and the uncompressed server.

One server (a subprocess on 127.0.0.1: model-dtype pages, `--kv-compress none`, so each request names its own setting
through the body's `kv_compress` field) answers every sample of every setting: the board's samples
(hf_kvcache.evaluation.ruler.make_sample, seeds 0..N-1), the context, question and answer prefix sent as one
completion prompt (`/v1/completions`, greedy, the sample's max_new_tokens), `--clients` at a time. Unlike the board's
question-agnostic protocol, which compresses the context alone and feeds the question after it, the server compresses
the whole prompt at the end of its prefill: the question sits in the newest tokens every method keeps (64, at most a
quarter of what is kept).

    python eval/ruler_http.py --tasks niah_single_1 niah_single_2 --length 2048 --samples 50 \
        --kv-compress none kvzap:0.75 keydiff:0.75 --out eval/results/ruler_http

Writes OUT/results.jsonl (one line per answer; resumable: answers already there are not asked again) and
OUT/cells.csv / OUT/cells.json (per setting and task: mean score, 95% interval, n, and what eviction kept).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> dict:
    import torch

    from hf_kvcache.evaluation.ruler import make_sample, score
    from hf_kvcache.paged.compress_spec import parse
    from hf_kvcache.paged.serve_process import ServerProcess
    from hf_kvcache.sharing.models import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", help="the server's model dtype (default bfloat16)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_single_2"])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--kv-compress", nargs="+", default=["none", "kvzap:0.75", "keydiff:0.75"])
    p.add_argument("--kv-memory", default="1GiB")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument(
        "--through",
        choices=("http", "generate"),
        default="http",
        help="http: the server; generate: the same method on the same prompts one request at a time in this process "
        "(hf_kvcache.evaluation.eviction_reference), for the comparison (results under OUT/generate)",
    )
    p.add_argument(
        "--kv-layout",
        choices=("token", "head"),
        default="token",
        help="the server's page layout (hf-kvcache serve --kv-layout); rows of 'head' are named SETTING@head",
    )
    p.add_argument("--out", default=str(ROOT / "eval/results/ruler_http"))
    args = p.parse_args(argv)
    for value in args.kv_compress:
        parse(value, "--kv-compress")
    out = Path(args.out) / "generate" if args.through == "generate" else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    done = {}
    if results_path.exists():
        for line in results_path.read_text().splitlines():
            record = json.loads(line)
            done[(record["kv_compress"], record["task"], record["seed"])] = record
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    jobs = []
    for task in args.tasks:
        for seed in range(args.samples):
            sample = make_sample(task, context_len=args.length, seed=seed, tokenizer=tokenizer)
            for setting in args.kv_compress:
                if (_row(setting, args.kv_layout), task, seed) not in done:
                    jobs.append((setting, task, seed, sample))
    if args.through == "generate":
        return _through_generate(args, model, tokenizer, jobs, done, results_path, out)
    del model
    server = ServerProcess(
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--kv-cache-dtype",
        "auto",
        "--kv-memory",
        args.kv_memory,
        "--cb-block-size",
        str(args.page_size),
        "--kv-compress",
        "none",
        "--kv-layout",
        args.kv_layout,
        request_timeout=1800,
    )

    def ask(job):
        setting, task, seed, sample = job
        response = server.openai_client().completions.create(
            model=args.model,
            prompt=sample.context + sample.question + sample.answer_prefix,
            max_tokens=sample.max_new_tokens,
            temperature=0,
            extra_body={"kv_compress": setting},
        )
        text = response.choices[0].text
        return {
            "kv_compress": _row(setting, args.kv_layout),
            "task": task,
            "seed": seed,
            "context_len": args.length,
            "score": score(text, sample.answers, sample.metric),
            "output": text,
            "answers": sample.answers,
            "prompt_tokens": response.usage.prompt_tokens,
        }

    try:
        with open(results_path, "a") as f, concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            for i, record in enumerate(pool.map(ask, jobs)):
                f.write(json.dumps(record) + "\n")
                f.flush()
                done[(record["kv_compress"], record["task"], record["seed"])] = record
                if (i + 1) % 25 == 0:
                    print(f"{i + 1}/{len(jobs)} answers", flush=True)
        eviction = server.kv_cache()["eviction"]
    finally:
        server.stop()
    return write_cells(args, done, out, eviction)


def _row(setting: str, layout: str) -> str:
    """A setting's name in the results: SETTING, or SETTING@head on head pages."""
    return setting if layout == "token" else f"{setting}@{layout}"


def write_cells(args, done: dict, out: Path, eviction) -> dict:
    """OUT/cells.json and OUT/cells.csv from the answers `done`, printed too."""
    from hf_kvcache.evaluation.ruler.board import interval95

    cells = []
    settings = list(dict.fromkeys([*(_row(s, args.kv_layout) for s in args.kv_compress), *(s for s, _, _ in done)]))
    tasks = list(dict.fromkeys([*args.tasks, *(t for _, t, _ in done)]))
    for setting in settings:  # every answer on record, not only this run's settings: runs may ask for a subset
        for task in tasks:
            scores = [r["score"] for (s, t, _), r in done.items() if s == setting and t == task]
            if not scores:
                continue
            low, high = interval95(scores)
            cells.append(
                {
                    "kv_compress": setting,
                    "task": task,
                    "context_len": args.length,
                    "n": len(scores),
                    "score": sum(scores) / len(scores),
                    "ci95": [low, high],
                }
            )
    summary = {"model": args.model, "dtype": args.dtype, "cells": cells, "server_eviction_totals": eviction}
    (out / "cells.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out / "cells.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(cells[0]))
        writer.writeheader()
        writer.writerows(cells)
    for cell in cells:
        print(f"{cell['kv_compress']:>19} {cell['task']}: {cell['score']:.2f} {cell['ci95']} (n={cell['n']})")
    return summary


@torch.inference_mode()
def _through_generate(args, model, tokenizer, jobs, done, results_path: Path, out: Path) -> dict:
    from hf_kvcache.evaluation.eviction_reference import generate_with_eviction, generate_with_head_eviction
    from hf_kvcache.evaluation.ruler import score
    from hf_kvcache.paged.compress_spec import parse

    with open(results_path, "a") as f:
        for i, (setting, task, seed, sample) in enumerate(jobs):
            text = sample.context + sample.question + sample.answer_prefix
            prompt = tokenizer(text).input_ids  # as the server's completions endpoint tokenizes it
            spec = parse(setting)
            run = (
                generate_with_head_eviction if args.kv_layout == "head" and spec is not None else generate_with_eviction
            )
            tokens = run(model, prompt, spec, sample.max_new_tokens, eos=tokenizer.eos_token_id)
            output = tokenizer.decode(tokens, skip_special_tokens=True)
            record = {
                "kv_compress": _row(setting, args.kv_layout),
                "task": task,
                "seed": seed,
                "context_len": args.length,
                "score": score(output, sample.answers, sample.metric),
                "output": output,
                "answers": sample.answers,
                "prompt_tokens": len(prompt),
            }
            f.write(json.dumps(record) + "\n")
            f.flush()
            done[(record["kv_compress"], task, seed)] = record
            if (i + 1) % 25 == 0:
                print(f"{i + 1}/{len(jobs)} answers", flush=True)
    return write_cells(args, done, out, None)


if __name__ == "__main__":
    main()
