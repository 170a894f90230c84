"""Sweep results on disk: `results.jsonl` (one line per finished cell, appended and fsynced; a line cut short by a
kill is ignored), the reports rewritten after every run (`results.csv` of scalar columns, `summary.json`, the plots),
the run environment, and `format_summary` (markdown tables of a sweep's rows)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

from .sweep_spec import Sweep

__all__ = ["environment", "format_summary", "read_results", "write_reports"]


def read_results(path: str | os.PathLike) -> dict[str, dict]:
    """{key: record} of a results.jsonl; a line cut short by an interruption is ignored."""
    path = Path(path)
    done = {}
    if not path.is_file():
        return done
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "key" in rec:
            done[rec["key"]] = rec
    return done


def _append(path: Path, record: dict) -> None:
    """One line per record, fsynced; a line cut short by an earlier kill is closed first so it stays alone."""
    cut = False
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
    with open(path, "a") as f:
        f.write(("\n" if cut else "") + json.dumps(record, default=_json_default) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _json_default(o):
    import numpy as np

    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def environment() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        root = Path(__file__).resolve().parents[2]
        commit = (
            subprocess.run(
                ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    from ..version import __version__

    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "hf_kvcache": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": commit,
    }


SCALAR_FIRST = ["metric", "context_len", "label", "cache", "budget", "budget_tokens", "kind", "position"]


def write_reports(out: Path, spec: Sweep, records: list[dict], env: dict) -> list[dict]:
    """results.csv (scalar columns), summary.json and plots from all finished cells; returns the flat rows."""
    import csv

    rows = [row for rec in records for row in rec["rows"]]
    scalar_keys = []
    for r in rows:
        for k, v in r.items():
            if k not in scalar_keys and (v is None or isinstance(v, (int, float, str, bool))):
                scalar_keys.append(k)
    columns = [k for k in SCALAR_FIRST if k in scalar_keys] + [k for k in scalar_keys if k not in SCALAR_FIRST]
    tmp = out / "results.csv.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in columns})
    os.replace(tmp, out / "results.csv")
    summary = {"spec": spec.raw, "environment": env, "rows": rows}
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1, default=_json_default))
    os.replace(tmp, out / "summary.json")
    try:
        from .plots import plot_all

        plot_all(rows, out)
    except ImportError:  # matplotlib is an optional extra
        pass
    return rows


def _quality_cells(r: dict) -> list:
    from .memory import format_bytes

    return [
        r["context_len"],
        r["label"],
        r.get("budget_tokens") or "all",
        format_bytes(r["bytes_held"]),
        f"{r['bytes_vs_dense']:.2f}",
        f"{r['ppl']:.2f}",
        f"{r['ppl_ref']:.2f}",
        f"{r['kl_mean']:.4f}",
        f"{r['kl_p99']:.3f}",
        f"{r['top1_agreement']:.3f}",
        f"{r['top5_agreement']:.3f}",
    ]


#: metric -> (column headers, the cells of one row) of `format_summary`'s table for that metric
SUMMARY_TABLES = {
    "quality": (
        [
            "n",
            "cache",
            "tokens kept",
            "bytes held",
            "vs dense",
            "PPL",
            "PPL full",
            "KL mean",
            "KL p99",
            "top-1",
            "top-5",
        ],
        _quality_cells,
    ),
    "ppl": (
        ["n", "cache", "tokens", "PPL", "protocol"],
        lambda r: [r["context_len"], r["label"], r["tokens"], f"{r['ppl']:.2f}", r["protocol"]],
    ),
    "speed": (
        ["n", "cache", "prefill s", "x dynamic", "decode ms/token", "x dynamic"],
        lambda r: [
            r["context_len"],
            r["label"],
            f"{r['prefill_s']:.3f}",
            f"{r['prefill_ratio']:.2f}",
            f"{r['decode_ms_per_token']:.1f}",
            f"{r['decode_ratio']:.2f}",
        ],
    ),
    "retrieval": (
        ["n", "probe", "position", "cache", "exact", "JSON parse", "value match"],
        lambda r: [
            r["context_len"],
            r["kind"],
            r["position"],
            r["label"],
            f"{r['exact_match']:.2f}",
            f"{r['parse_rate']:.2f}",
            f"{r['value_match']:.2f}",
        ],
    ),
}


def format_summary(rows: list[dict]) -> str:
    """Markdown tables of a sweep's rows (quality, ppl, speed, retrieval: SUMMARY_TABLES), for READMEs."""
    lines = []
    for metric, (headers, cells) in SUMMARY_TABLES.items():
        selected = [r for r in rows if r["metric"] == metric]
        if selected:
            lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(str(c) for c in cells(r)) + " |" for r in selected]
            lines.append("")
    return "\n".join(lines)
