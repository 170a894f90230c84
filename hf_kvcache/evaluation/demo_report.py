"""The demo's files: its rows as `demo.csv` and `demo.json` (rows plus the run's settings and environment) and
`demo.png`, quality against bytes held (matplotlib, Agg backend), all in one directory."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, fields
from pathlib import Path

from .demo import DemoRow

__all__ = ["plot_demo", "write_demo_report"]


def plot_demo(rows: list[DemoRow], path) -> Path:
    """Teacher-forced top-1 agreement and free-running agreement with the full cache against bytes held, one line
    per cache family (points: its budgets; a star for a single point)."""
    from .plots import log_bytes_axes, plt, save_figure

    families: dict[str, list[DemoRow]] = {}
    for r in rows:
        if r.not_run:
            continue
        families.setdefault(r.family, []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharex=True)
    for family, members in families.items():
        members = sorted(members, key=lambda r: r.bytes_held)
        x = [r.bytes_held / 2**20 for r in members]
        marker = "o" if len(members) > 1 else "*"
        axes[0].plot(x, [r.top1_agreement for r in members], marker=marker, label=family)
        axes[1].plot(x, [r.generated_agreement for r in members], marker=marker, label=family)
    axes[0].set_ylabel("top-1 agreement with the full cache (teacher-forced)")
    axes[1].set_ylabel("greedy tokens equal to the full cache's")
    log_bytes_axes(axes)
    for ax in axes:
        ax.set_ylim(-0.02, 1.02)
    axes[1].legend(fontsize=8)
    fig.suptitle("hf-kvcache demo: quality vs bytes held")
    return save_figure(fig, path)


def write_demo_report(rows: list[DemoRow], out_dir, settings: dict) -> list[Path]:
    """Write demo.csv, demo.json ({settings, rows}) and demo.png into `out_dir` (created); returns their paths."""
    if not rows:
        raise ValueError("`rows` is empty: run_demo returned nothing to write.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "demo.csv"
    with open(table, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[field.name for field in fields(DemoRow)])
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    data = out / "demo.json"
    data.write_text(json.dumps({"settings": settings, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    return [table, data, plot_demo(rows, out / "demo.png")]
