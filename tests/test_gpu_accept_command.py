"""The GPU acceptance command end to end on the CPU (`DEVICE=cpu bash eval/gpu/accept.sh run ...`: every stage at
tiny sizes, the cuda-marked checks of tests/test_gpu_accept.py included, on a scratch RULER board), so it cannot rot
between lent GPUs; then its results as the results page shows them and as `collect` merges them."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["correctness", "speed", "serve", "ruler"]


@pytest.mark.slow
def test_accept_command_runs_every_stage_on_cpu(tmp_path):
    pytest.importorskip("triton")
    board = tmp_path / "board"
    board.mkdir()
    env = dict(
        os.environ,
        DEVICE="cpu",
        PYTHON=sys.executable,
        OUT=str(tmp_path / "out"),
        BOARD=str(board),
        STAGE=str(tmp_path / "stage"),
        # the stages' time budgets are for a GPU's 15 minutes; here they are hang guards only (a busy machine once
        # took the correctness stage past its 3 minutes): nothing this test checks depends on speed
        CORRECTNESS_MINUTES="15",
        SERVE_MINUTES="15",
    )
    proc = subprocess.run(
        ["bash", "eval/gpu/accept.sh", "run", ",".join(STAGES), "45"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = Path(proc.stdout.strip().splitlines()[-1])
    assert run.parent == tmp_path / "out" / "gpu" and run.name.endswith("-cpu")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["device"] == "cpu" and summary["torch"] and summary["transformers"] and summary["commit"]
    assert list(summary["stages"]) == STAGES
    assert {s: v["status"] for s, v in summary["stages"].items()} == dict.fromkeys(STAGES, "ok"), summary["stages"]
    assert 'failures="0"' in (run / "correctness" / "junit.xml").read_text()
    cells = json.loads((run / "speed" / "cells.json").read_text())["cells"]
    assert [c["status"] for c in cells] == ["ok"] * len(cells) and len(cells) == 2
    assert (run / "speed" / "kernel.json").exists()
    serve = json.loads((run / "serve" / "serve_bench.json").read_text())
    assert [r["format"] for r in serve["runs"]] == ["model", "fp8_e4m3", "fp8_e4m3:codes"]
    assert all(r["itl_mean_s"] is None or r["itl_mean_s"] > 0 for r in serve["runs"])
    assert (run / "ruler" / "results.new.jsonl.xz").exists()

    # the results page's section, from these files
    page = runpy.run_path(str(ROOT / "scripts" / "results_page.py"))
    text = page["gpu_runs"](run.parent)
    assert f"### {run.name}" in text and "correctness ok" in text and "| fp8 |" in text and "fp8_e4m3" in text
    assert "No run has landed yet" in page["gpu_runs"](tmp_path / "nothing")

    # collect's merge: a second call's stages join the first's
    sys.path.insert(0, str(ROOT / "eval" / "gpu"))
    import summary as gpu_summary

    into = tmp_path / "results_gpu"
    gpu_summary.merge(run.parent, into)
    second = tmp_path / "second" / run.name
    second.mkdir(parents=True)
    (second / "summary.json").write_text(
        json.dumps({"device": "cpu", "stages": {"ruler": {"status": "timed out", "seconds": 1}}})
    )
    gpu_summary.merge(second.parent, into)
    merged = json.loads((into / run.name / "summary.json").read_text())
    assert list(merged["stages"]) == STAGES and merged["stages"]["ruler"]["status"] == "timed out"
    assert merged["torch"] == summary["torch"]


def test_accept_command_refuses_bad_input():
    for args, word in (
        (["run", "correctness,warp", "1"], "unknown stage 'warp'"),
        (["run", "speed", "x"], "MINUTES"),
        (["nothing"], "STAGES"),
    ):
        proc = subprocess.run(
            ["bash", "eval/gpu/accept.sh", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=dict(os.environ, DEVICE="cpu"),
            timeout=60,
        )
        assert proc.returncode == 2 and word in proc.stderr, (args, proc.stderr)
    proc = subprocess.run(
        ["bash", "eval/gpu/accept.sh", "run", "speed", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, DEVICE="tpu"),
        timeout=60,
    )
    assert proc.returncode == 2 and "DEVICE must be cuda or cpu" in proc.stderr
