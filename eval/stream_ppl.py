"""Streaming perplexity (StreamingLLM protocol) of SmolLM2-135M on the offline pydoc corpus.

One token per forward, NLL of the next token, perplexity per 1K-token bucket. Configurations (StreamingLLM Fig. 3):
  sink_cache     SinkCache 4 sinks + 1020 window, sinks re-positioned just before the window   32K tokens
  sink_original  SinkCache 4 + 1020, sinks keep their original positions                       32K tokens
  window         SlidingWindowCache 1024 (window only, 0 sinks)                                  4K tokens
  dense          transformers DynamicCache (no eviction; SmolLM2 was trained on 8K)            12K tokens

Each configuration is resumable (checkpoints under eval/results/checkpoints/) and selectable, so they can run as
separate background processes:
  nohup .venv/bin/python eval/stream_ppl.py --only sink_cache --threads 1 > eval/results/logs/sink_cache.log 2>&1 &
Every run rewrites the report (CSV, PNG, JSON) from all checkpoints present; `--report` only rewrites the report.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import DynamicCache  # noqa: E402

from hf_kvcache import SinkCache, SlidingWindowCache  # noqa: E402
from hf_kvcache.evaluation.streaming import bucket_perplexity, perplexity, read_progress, stream_nll  # noqa: E402

TRAIN_CONTEXT = 8192  # SmolLM2 max_position_embeddings
CONFIGS = {
    # name: (tokens, label, factory(model))
    "sink_cache": (
        32768,
        "SinkCache 4+1020 (positions in cache)",
        lambda m: SinkCache(m, sinks=4, window=1020, position_mode="cache"),
    ),
    "sink_original": (
        32768,
        "SinkCache 4+1020 (original positions)",
        lambda m: SinkCache(m, sinks=4, window=1020, position_mode="original"),
    ),
    "window": (4096, "Window only 1024 (0 sinks)", lambda m: SlidingWindowCache(m, window=1024)),
    "dense": (12288, "Dense (DynamicCache)", lambda m: DynamicCache(config=m.config)),
}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    import transformers

    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "git_commit": commit,
    }


def checkpoint_path(results: Path, name: str) -> Path:
    return results / "checkpoints" / f"stream_ppl.{name}.pt"


def tag_for(name: str, tokens_source: str) -> str:
    return f"stream_ppl/{name}/smollm2/{tokens_source}"


def write_report(results: Path, bucket: int, corpus: str) -> dict:
    """CSV, PNG and JSON from whatever the checkpoints hold (complete or partial runs)."""
    rows, summary = [], {}
    for name, (target, label, _) in CONFIGS.items():
        got = read_progress(checkpoint_path(results, name))
        if got is None:
            continue
        nlls, meta = got
        if meta.get("tag") != tag_for(name, corpus):
            continue
        buckets = bucket_perplexity(nlls, bucket)
        for b in buckets:
            rows.append({"cache": name, **b})
        done = int(meta["done"])
        segments = {}
        for lo, hi in ((0, 1024), (1024, 4096), (4096, 8192), (8192, 12288), (12288, 32768)):
            if done > lo:
                segments[f"{lo}-{min(hi, done)}"] = perplexity(nlls[lo:hi])
        summary[name] = {
            "label": label,
            "target_tokens": target - 1,
            "scored_tokens": done,
            "complete": done >= min(target - 1, meta["total"]),
            "ppl_overall": perplexity(nlls),
            "ppl_segments": segments,
            "elapsed_s": round(meta["elapsed_s"], 1),
            "ms_per_token": round(1000 * meta["elapsed_s"] / max(done, 1), 1),
        }
    results.mkdir(parents=True, exist_ok=True)
    tmp = results / "stream_ppl.csv.tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["cache", "bucket_start", "bucket_end", "tokens", "ppl"])
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, "ppl": f"{r['ppl']:.4f}"})
    os.replace(tmp, results / "stream_ppl.csv")

    info = {
        "protocol": "StreamingLLM: one token per forward, NLL of the next token (float64 log-softmax); "
        f"ppl = exp(mean NLL) per bucket of {bucket} query positions [bucket_start, bucket_end)",
        "model": "SmolLM2-135M-Instruct (offline GGUF Q4_1 dequantized to float32)",
        "corpus": corpus,
        "train_context": TRAIN_CONTEXT,
        "environment": environment(),
        "configs": summary,
    }
    tmp = results / "stream_ppl.json.tmp"
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, results / "stream_ppl.json")
    plot(rows, summary, results / "stream_ppl.png", bucket)
    return info


def plot(rows: list[dict], summary: dict, out: Path, bucket: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    styles = {"sink_cache": "C0-", "sink_original": "C2--", "window": "C3-", "dense": "C1-"}
    for name, info in summary.items():
        mine = [r for r in rows if r["cache"] == name and r["tokens"] >= bucket // 4]
        x = [(r["bucket_start"] + r["bucket_end"]) / 2 for r in mine]
        y = [r["ppl"] for r in mine]
        label = info["label"] + ("" if info["complete"] else f" (partial: {info['scored_tokens']} tokens)")
        ax.plot(x, y, styles.get(name, "-"), marker=".", label=label)
    ax.axvline(TRAIN_CONTEXT, color="grey", ls=":", lw=1.2)
    ax.text(
        TRAIN_CONTEXT,
        0.98,
        " 8192 = training context",
        transform=ax.get_xaxis_transform(),
        va="top",
        fontsize=8,
        color="grey",
    )
    ax.axvline(1024, color="grey", ls=":", lw=0.8)
    ax.text(1024, 0.90, " 1024 = cache budget", transform=ax.get_xaxis_transform(), va="top", fontsize=8, color="grey")
    ax.set_yscale("log")
    ax.set_xlabel("stream position (tokens)")
    ax.set_ylabel(f"perplexity per {bucket}-token bucket (log)")
    ax.set_title("SmolLM2-135M streaming perplexity, pydoc corpus, one token per forward")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only",
        action="append",
        choices=list(CONFIGS),
        help="run only this configuration (repeatable); default: all, one after the other",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="override every configuration's stream length (a short timing run: use --scratch)",
    )
    parser.add_argument("--corpus", default="pydoc", help="text source for hf_kvcache.sharing.corpus.load_tokens")
    parser.add_argument("--bucket", type=int, default=1024, help="bucket size for perplexities (default 1024)")
    parser.add_argument("--checkpoint-every", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (1 when running two)")
    parser.add_argument("--results", type=Path, default=ROOT / "eval" / "results")
    parser.add_argument(
        "--scratch",
        action="store_true",
        help="no checkpoints and no report: print the timing only (for short speed measurements)",
    )
    parser.add_argument("--fresh", action="store_true", help="delete the selected configurations' checkpoints first")
    parser.add_argument("--report", action="store_true", help="only rewrite CSV/PNG/JSON from the checkpoints")
    args = parser.parse_args(argv)

    if args.report:
        info = write_report(args.results, args.bucket, args.corpus)
        print(json.dumps(info["configs"], indent=1))
        return
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    transformers.logging.set_verbosity_error()
    from hf_kvcache.sharing.corpus import load_tokens
    from hf_kvcache.sharing.models import load_model

    model, tokenizer = load_model("smollm2")
    names = args.only or list(CONFIGS)
    longest = max(args.tokens or CONFIGS[n][0] for n in names)
    ids = load_tokens(tokenizer, args.corpus, max_tokens=longest)
    for name in names:
        target, _label, factory = CONFIGS[name]
        n = args.tokens or target
        ckpt = None if args.scratch else checkpoint_path(args.results, name)
        if ckpt is not None and args.fresh:
            for p in ckpt.parent.glob(ckpt.name + "*"):
                p.unlink()
        start = time.perf_counter()
        nlls = stream_nll(
            model,
            ids[:, :n],
            lambda: factory(model),
            checkpoint=ckpt,
            checkpoint_every=args.checkpoint_every,
            tag=tag_for(name, args.corpus),
            desc=name,
        )
        wall = time.perf_counter() - start
        print(
            f"{name}: {len(nlls)} NLLs, ppl {perplexity(nlls):.3f}; this process {wall:.1f} s for the tokens "
            "it scored (after any resumed part)",
            flush=True,
        )
        if not args.scratch:
            write_report(args.results, args.bucket, args.corpus)


if __name__ == "__main__":
    main()
