"""eval/merge_sweep.py: a re-run of some cells (a subset spec with the same settings) replaces those cells' records in
the target sweep's results, one record per cell in the target's order, and the runner rewrites the target's reports;
records of other settings are refused and nothing is written."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from conftest import build_model

from hf_kvcache.evaluation.sweep import read_results, run_sweep

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from merge_sweep import merge

SPEC = {
    "name": "full",
    "model": "tiny-model",
    "text": "random",
    "text_offset": 0,
    "context_lengths": [24],
    "scored_tokens": 4,
    "metrics": ["quality"],
    "budgets": [0.25, 0.5],
    "caches": [{"name": "dynamic"}, {"name": "sink", "config": {"sinks": 2}, "budget_key": "budget"}],
}
SUBSET = {
    **SPEC,
    "name": "subset",
    "caches": [{"name": "sink", "config": {"sinks": 2}, "budget_key": "budget", "budgets": [0.5]}],
}


def _loader(name, dtype):
    return build_model("llama", seed=1, num_hidden_layers=1), None


def _write(path: Path, spec: dict) -> str:
    path.write_text(json.dumps(spec))  # (YAML is a superset of JSON)
    return str(path)


def test_a_rerun_replaces_its_cells_and_the_reports_are_rewritten(tmp_path):
    run_sweep(SPEC, tmp_path, loader=_loader, progress=False)
    run_sweep(SUBSET, tmp_path, loader=_loader, progress=False)
    source = tmp_path / "subset" / "results.jsonl"
    record = json.loads(source.read_text())
    record["rows"][0]["bytes_held"] = 12345  # marks the re-run's record
    source.write_text(json.dumps(record) + "\n")
    before = read_results(tmp_path / "full" / "results.jsonl")
    assert merge(tmp_path / "subset", _write(tmp_path / "full.yaml", SPEC), str(tmp_path)) == (1, 0)
    after = read_results(tmp_path / "full" / "results.jsonl")
    assert list(after) == list(before) and len((tmp_path / "full" / "results.jsonl").read_text().splitlines()) == 3
    assert after[record["key"]]["rows"][0]["bytes_held"] == 12345
    assert all(after[k] == before[k] for k in before if k != record["key"])
    with open(tmp_path / "full" / "results.csv") as f:
        held = {row["label"]: row["bytes_held"] for row in csv.DictReader(f)}
    assert held["sink 50%"] == "12345" and held["sink 25%"] != "12345" and len(held) == 3


def test_records_of_other_settings_are_refused_and_nothing_is_written(tmp_path):
    run_sweep(SPEC, tmp_path, loader=_loader, progress=False)
    other = {**SUBSET, "scored_tokens": 3}
    run_sweep(other, tmp_path, loader=_loader, progress=False)
    target = (tmp_path / "full" / "results.jsonl").read_text()
    with pytest.raises(ValueError, match="1 record.* not cells of"):
        merge(tmp_path / "subset", _write(tmp_path / "full.yaml", SPEC), str(tmp_path))
    assert (tmp_path / "full" / "results.jsonl").read_text() == target
