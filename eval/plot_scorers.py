"""Table and plot of the scorers sweep (eval/specs/scorers.yaml): KL and top-1 vs the full cache per scorer, prompt
vs always mode, per budget, from eval/results/scorers/results.jsonl.

    python eval/plot_scorers.py [results_dir]   # writes table.md and kl_by_scorer.png next to results.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

MODES = ("prompt", "always")


def read_rows(directory: Path) -> list[dict]:
    """Quality rows with a budget, from results.jsonl (every finished cell, also while the sweep runs)."""
    rows = []
    for line in (directory / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["metric"] == "quality":
            rows += [row for row in record["rows"] if row.get("budget") is not None]
    return rows


def split_label(label: str) -> tuple[str, str]:
    """'SnapKV prompt 20%' -> ('SnapKV', 'prompt')."""
    words = label.rsplit(" ", 2)
    if len(words) != 3 or words[1] not in MODES:
        raise ValueError(f"label {label!r} is not '<cache> <mode> <budget>'")
    return words[0], words[1]


def table(rows: list[dict]) -> str:
    lines = [
        "| cache | mode | budget | tokens | KL mean | KL p99 | top-1 | top-5 | bytes held | vs full |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(
        rows, key=lambda r: (float(r["budget"]), MODES.index(split_label(r["label"])[1]), float(r["kl_mean"]))
    )
    for r in order:
        cache, mode = split_label(r["label"])
        lines.append(
            f"| {cache} | {mode} | {float(r['budget']):.0%} | {r['budget_tokens']} | "
            f"{float(r['kl_mean']):.3f} | {float(r['kl_p99']):.2f} | {float(r['top1_agreement']):.3f} | "
            f"{float(r['top5_agreement']):.3f} | {int(r['bytes_held']) / 1e6:.1f} MB | "
            f"{float(r['bytes_vs_dense']):.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    budgets = sorted({float(r["budget"]) for r in rows})
    fig, axes = plt.subplots(1, len(budgets), figsize=(max(8, 6 * len(budgets)), 4.5), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        at = [r for r in rows if float(r["budget"]) == budget]
        caches = sorted(
            {split_label(r["label"])[0] for r in at},
            key=lambda c: min(float(r["kl_mean"]) for r in at if split_label(r["label"])[0] == c),
        )
        width = 0.4
        for i, mode in enumerate(MODES):
            values = []
            for cache in caches:
                match = [r for r in at if split_label(r["label"]) == (cache, mode)]
                values.append(float(match[0]["kl_mean"]) if match else float("nan"))
            ax.bar([x + (i - 0.5) * width for x in range(len(caches))], values, width, label=f"compress={mode}")
        ax.set_xticks(range(len(caches)), caches, rotation=30, ha="right")
        ax.set_ylabel("mean KL(full || cache)")
        ax.set_title(f"budget {budget:.0%} of a 2048-token prompt")
        ax.legend()
    fig.suptitle("SmolLM2-135M, pydoc, 256 teacher-forced tokens: KL vs the full cache (lower is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(directory: str = "eval/results/scorers") -> None:
    out = Path(directory)
    rows = read_rows(out)
    if not rows:
        raise SystemExit(f"no quality rows with a budget in {out / 'results.jsonl'}")
    (out / "table.md").write_text(table(rows))
    plot(rows, out / "kl_by_scorer.png")
    print((out / "table.md").read_text())


if __name__ == "__main__":
    main(*sys.argv[1:])
