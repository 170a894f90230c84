"""The demo's rows, files and progress bars: demo.csv / demo.json / demo.png next to each other with every row, a bar
per row that counts its forwards, and bad sizes refused by name. (tests/test_eval_cli.py runs the whole sweep on a
tiny model.)"""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
from conftest import build_model, random_ids

from hf_kvcache.evaluation.demo import DemoRow, demo_specs, run_demo
from hf_kvcache.evaluation.demo_report import write_demo_report


def _row(cache, family, budget, held, top1):
    return DemoRow(
        cache=cache,
        family=family,
        budget=budget,
        bytes_held=held,
        decode_tokens_per_s=10.0,
        generated_agreement=top1 / 2,
        top1_agreement=top1,
        seconds=1.5,
        cpu_seconds=1.2,
    )


def test_report_files_hold_every_row(tmp_path):
    rows = [
        _row("full (DynamicCache)", "full", "all", 4096, 1.0),
        _row("h2o 32", "h2o", "32", 512, 0.5),
        _row("h2o 64", "h2o", "64", 1024, 0.75),
        _row("kivi int4", "kivi int4", "all", 1500, 0.9),
    ]
    paths = write_demo_report(rows, tmp_path / "out", {"prompt_tokens": 256})
    assert [p.name for p in paths] == ["demo.csv", "demo.json", "demo.png"]
    assert all(p.parent == tmp_path / "out" for p in paths)
    with open(paths[0]) as f:
        table = list(csv.DictReader(f))
    assert [r["cache"] for r in table] == [r.cache for r in rows]
    assert float(table[2]["top1_agreement"]) == 0.75 and int(table[1]["bytes_held"]) == 512
    data = json.loads(paths[1].read_text())
    assert data["settings"] == {"prompt_tokens": 256} and len(data["rows"]) == 4
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[2].stat().st_size > 10_000
    with pytest.raises(ValueError, match="rows"):
        write_demo_report([], tmp_path / "empty", {})


def test_every_family_has_three_budgets_and_the_quantized_caches_keep_all():
    specs = demo_specs(512)
    budgets = {}
    for _, family, _, _, budget in specs:
        budgets.setdefault(family, []).append(budget)
    assert budgets == {
        "full": ["all"],
        "sink": ["64", "128", "256"],
        "sliding": ["64", "128", "256"],
        "h2o": ["64", "128", "256"],
        "composite fp8": ["64", "128", "256"],
        "fp8": ["all"],
        "kivi int4": ["all"],
    }


def test_progress_bar_per_row_counts_its_forwards(monkeypatch):
    import hf_kvcache.evaluation.demo as demo

    bars = []

    class Bar:
        def __init__(self, total, desc, **kwargs):
            self.total, self.desc, self.n, self.closed = total, desc, 0, False
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    monkeypatch.setattr(demo, "_row_bar", lambda label, total, progress: Bar(total, label) if progress else None)
    monkeypatch.setattr(demo, "demo_specs", lambda n: [s for s in demo_specs(n) if s[1] in ("full", "h2o", "sink")])
    model = build_model("llama")
    rows = run_demo(model, SimpleNamespace(pad_token_id=0), random_ids(1, 64, seed=3), new_tokens=5, progress=True)
    assert [b.desc for b in bars] == [r.cache for r in rows] and len(rows) == 7
    assert bars[0].total == bars[0].n == 1 + 4  # the full cache: prefill + generation (no teacher-forced pass)
    assert all(b.total == b.n == 1 + 2 * 4 and b.closed for b in bars[1:])
    assert all(r.seconds > 0 and r.cpu_seconds > 0 for r in rows)
    assert rows[0].top1_agreement == rows[0].generated_agreement == 1.0


def test_bad_new_tokens_is_refused_by_name():
    with pytest.raises(ValueError, match="new_tokens"):
        run_demo(build_model("llama"), SimpleNamespace(pad_token_id=0), random_ids(1, 64), new_tokens=1)


def test_a_row_whose_backend_is_missing_says_so_and_the_others_run(monkeypatch, tmp_path):
    import hf_kvcache.evaluation.demo as demo
    from hf_kvcache.evaluation.demo import format_table
    from hf_kvcache.stores import quantization

    monkeypatch.setattr(quantization, "backend_available", lambda backend: backend == "torch")
    monkeypatch.setattr(demo, "demo_specs", lambda n: [s for s in demo_specs(n) if s[1] in ("full", "kivi int4")])
    rows = run_demo(build_model("llama"), SimpleNamespace(pad_token_id=0), random_ids(1, 64, seed=3), new_tokens=3)
    assert [r.cache for r in rows] == ["full (DynamicCache)", "kivi int4"]
    assert rows[0].not_run == "" and rows[0].top1_agreement == 1.0
    assert "optimum-quanto" in rows[1].not_run and rows[1].top1_agreement != rows[1].top1_agreement  # NaN
    assert "kivi int4" in format_table(rows) and "not run: " in format_table(rows)
    paths = write_demo_report(rows, tmp_path, {})
    assert json.loads(paths[1].read_text())["rows"][1]["not_run"] == rows[1].not_run


def test_the_demo_extras_hold_every_backend_its_rows_need():
    """`make demo` installs the extras it names into a fresh .venv: they must hold a packing backend for the KIVI row
    (the demo failed on every fresh machine when `eval` lacked one and only `dev` had it)."""
    import configparser
    import re
    from pathlib import Path

    from hf_kvcache.stores.quantization import BACKEND_PACKAGES

    root = Path(__file__).resolve().parents[1]
    extras_named = re.search(r"^demo:\n\tbash scripts/setup-env.sh (\S+)", (root / "Makefile").read_text(), re.M)
    assert extras_named, "Makefile's demo target must set up its environment with scripts/setup-env.sh EXTRAS"
    cfg = configparser.ConfigParser()
    cfg.read(root / "setup.cfg")
    extras = cfg["options.extras_require"]
    requirements = "\n".join(extras[e] for e in extras_named.group(1).split(","))
    names = {
        re.split(r"[<>=!;\[ ]", line.strip(), maxsplit=1)[0].lower()
        for line in requirements.splitlines()
        if line.strip()
    }
    packages = {package.lower() for backend, (module, package) in BACKEND_PACKAGES.items() if backend != "torch"}
    assert names & packages, f"the demo's extras {extras_named.group(1)!r} hold none of {sorted(packages)}"
    assert {"matplotlib", "gguf"} <= names  # its plot and the offline model
