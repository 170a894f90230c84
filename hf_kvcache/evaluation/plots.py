"""PNG plots of sweep rows (matplotlib, Agg backend): quality vs bytes held, per-bucket perplexity, retrieval by
needle position. Each function takes the flat rows of a sweep (see `hf_kvcache.evaluation.sweep`) and writes one
file; `plot_all` writes whichever plots the rows allow and returns their paths."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

__all__ = ["log_bytes_axes", "plot_all", "plot_buckets", "plot_quality_vs_bytes", "plot_retrieval", "save_figure"]


def log_bytes_axes(axes) -> None:
    """Bytes held on a log x axis (MiB), light grid: the quality-vs-bytes panels of sweeps and of the demo."""
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("bytes held by the cache (MiB)")
        ax.grid(alpha=0.3)


def save_figure(fig, path) -> Path:
    """Lay out `fig`, write it to `path` (PNG, 110 dpi), close it; returns the path."""
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _series_name(r: dict) -> str:
    """The cache without its budget (a line in a budget sweep)."""
    label = r.get("label") or r.get("cache")
    budget = r.get("budget")
    if budget is not None and label.endswith(" " + _short(budget)):
        return label[: -len(_short(budget)) - 1]
    return label


def _short(b) -> str:
    if isinstance(b, float):
        return f"{b:.0%}" if b * 100 == round(b * 100) else f"{b:.1%}"
    return str(b)


def plot_quality_vs_bytes(rows: list[dict], path, context_len: int | None = None) -> Path | None:
    """KL mean, top-1 agreement and perplexity against bytes held, one line per cache (points: budgets)."""
    q = [r for r in rows if r.get("metric") == "quality" and (context_len is None or r["context_len"] == context_len)]
    if not q:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = defaultdict(list)
    for r in q:
        series[(_series_name(r), r["context_len"])].append(r)
    multi_n = len({r["context_len"] for r in q}) > 1
    for (name, n), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["bytes_held"])
        x = [r["bytes_held"] / 2**20 for r in rs]
        label = f"{name} (n={n})" if multi_n else name
        marker = "o" if len(rs) > 1 else "*"
        axes[0].plot(x, [max(r["kl_mean"], 1e-7) for r in rs], marker=marker, label=label)
        axes[1].plot(x, [r["top1_agreement"] for r in rs], marker=marker, label=label)
        axes[2].plot(x, [r["ppl"] for r in rs], marker=marker, label=label)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("KL(full || cache), mean over positions")
    axes[1].set_ylabel("top-1 agreement with full cache")
    axes[2].set_ylabel("perplexity of the scored tokens")
    ref = q[0].get("ppl_ref")
    if ref:
        axes[2].axhline(ref, color="gray", ls="--", lw=1, label="full cache")
    log_bytes_axes(axes)
    axes[2].legend(fontsize=8)
    fig.suptitle("Quality vs bytes held (teacher-forced, same positions as the full cache)")
    return save_figure(fig, path)


def plot_buckets(rows: list[dict], path) -> Path | None:
    """Perplexity per bucket of the stream, one line per cache and budget."""
    p = [r for r in rows if r.get("metric") == "ppl" and r.get("buckets")]
    if not p:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in p:
        b = r["buckets"]
        ax.plot([x["bucket_end"] for x in b], [x["ppl"] for x in b], marker=".", label=r["label"])
    ax.set_yscale("log")
    ax.set_xlabel("tokens into the stream (bucket end)")
    ax.set_ylabel("perplexity of the bucket")
    ax.set_title(f"Per-bucket perplexity ({p[0]['protocol']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def plot_retrieval(rows: list[dict], path) -> Path | None:
    """Exact match (and value match) by needle position, grouped bars per cache, one panel per probe kind."""
    rt = [r for r in rows if r.get("metric") == "retrieval"]
    if not rt:
        return None
    kinds = sorted({(r["kind"], r["context_len"]) for r in rt})
    fig, axes = plt.subplots(1, len(kinds), figsize=(max(6, 5 * len(kinds)), 4.2), squeeze=False)
    for ax, (kind, n) in zip(axes[0], kinds):
        rs = [r for r in rt if r["kind"] == kind and r["context_len"] == n]
        positions = list(dict.fromkeys(r["position"] for r in rs))
        labels = list(dict.fromkeys(r["label"] for r in rs))
        width = 0.8 / max(1, len(labels))
        for i, label in enumerate(labels):
            by_pos = {r["position"]: r for r in rs if r["label"] == label}
            xs = [j + i * width for j in range(len(positions))]
            metric = "exact_match" if kind == "passkey" else "value_match"
            ax.bar(xs, [by_pos[p][metric] if p in by_pos else 0 for p in positions], width, label=label)
        ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(positions))], positions)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{kind}, {n} tokens ({'exact match' if kind == 'passkey' else 'value match'})", fontsize=9)
        ax.set_xlabel("needle position")
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_all(rows: list[dict], out_dir) -> list[Path]:
    out = Path(out_dir)
    made = [
        plot_quality_vs_bytes(rows, out / "quality_vs_bytes.png"),
        plot_buckets(rows, out / "ppl_buckets.png"),
        plot_retrieval(rows, out / "retrieval_by_position.png"),
    ]
    return [p for p in made if p is not None]
