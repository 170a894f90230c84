"""The summary of a GPU acceptance run (eval/gpu/accept.sh): RUN/summary.json, written at the start of a call and
rewritten after every stage, and the merge of a returned run into eval/results/gpu/ (a run's stages may come back
from two device calls, each with its own summary).

    python eval/gpu/summary.py --dir RUN --device cuda [--commit-file F]                 # start: the environment
    python eval/gpu/summary.py --dir RUN --device cuda --stage speed --status 0 --seconds 212
    python eval/gpu/summary.py --merge FROM/gpu --into eval/results/gpu                   # here, after a run

summary.json: {"device", "device_name", "driver", "cuda", "torch", "transformers", "triton", "python", "commit",
"stages": {stage: {"status": "ok" | "failed (exit N)" | "timed out" | "skipped...", "seconds", "finished"}}}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

STAGES = ("correctness", "speed", "serve", "ruler")


def device_slug(device: str) -> str:
    """The run folder's device part: the GPU's name in lower case with dashes (nvidia-h200), or 'cpu'."""
    if device == "cpu":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: CUDA is not available in this torch ({torch.__version__})")
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _commit(commit_file: Path | None) -> str | None:
    """git's HEAD where the repository is there (+ a mark for uncommitted changes), else what `pack` recorded."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=20)
        if head.returncode == 0:
            dirty = subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
            return head.stdout.strip() + (" (+ uncommitted changes)" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    if commit_file is not None and commit_file.exists():
        return " ".join(commit_file.read_text().split()) + " (recorded by pack)"
    return None


def environment(device: str, commit_file: Path | None = None) -> dict:
    import torch
    import transformers

    env = {
        "device": device,
        "device_name": platform.processor() or platform.machine(),
        "driver": None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": None,
        "python": platform.python_version(),
        "commit": _commit(commit_file),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device != "cpu":
        env["device_name"] = torch.cuda.get_device_name(0)
        env["driver"] = _driver()
        env["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return env


def status_text(code: str) -> str:
    """accept.sh's exit status of a stage, in words (124 / 130: stopped by its time limit)."""
    if not code.isdigit():
        return code
    n = int(code)
    return "ok" if n == 0 else "timed out" if n in (124, 130) else f"failed (exit {n})"


def update(
    run: Path, device: str, commit_file: Path | None, stage: str | None, status: str | None, seconds: float | None
) -> dict:
    path = run / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    if "torch" not in summary:
        summary.update(environment(device, commit_file))
    summary.setdefault("stages", {})
    if stage is not None:
        summary["stages"][stage] = {
            "status": status_text(status or "ok"),
            "seconds": seconds,
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
    run.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def merge(source: Path, target: Path) -> list[Path]:
    """Every run folder of `source` into `target` (files copied over; summary.json: the stages of both, the newer
    environment kept when both have one). Returns the merged run folders."""
    merged = []
    for run in sorted(p for p in source.iterdir() if p.is_dir()):
        dest = target / run.name
        old = json.loads((dest / "summary.json").read_text()) if (dest / "summary.json").exists() else {}
        new = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        shutil.copytree(run, dest, dirs_exist_ok=True)
        stages = {**old.get("stages", {}), **new.get("stages", {})}
        summary = {**old, **new, "stages": {s: stages[s] for s in STAGES if s in stages}}
        (dest / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        merged.append(dest)
        print(f"merged {run} into {dest}")
    return merged


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="the run folder (RUN)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--commit-file", type=Path, default=None)
    parser.add_argument("--stage", choices=STAGES, default=None)
    parser.add_argument("--status", default=None, help="the stage's exit status (0 = ok) or a word")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--merge", type=Path, default=None, help="a returned gpu/ folder to merge into --into")
    parser.add_argument("--into", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.merge is not None:
        if args.into is None:
            parser.error("--merge needs --into (e.g. eval/results/gpu)")
        merge(args.merge, args.into)
        return 0
    if args.dir is None:
        parser.error("--dir is required (or --merge FROM --into TO)")
    update(args.dir, args.device, args.commit_file, args.stage, args.status, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
