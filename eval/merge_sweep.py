"""Merge a re-run of some cells into a sweep's results: the records of SOURCE_DIR/results.jsonl (a subset spec with
the same settings, e.g. eval/specs/scorers_prompt.yaml for eval/specs/scorers.yaml) replace the records of the same
cells in the target sweep's results.jsonl, then the runner rewrites the target's reports (results.csv, summary.json,
plots: `run_sweep(report_only=True)`).

    python eval/merge_sweep.py SOURCE_DIR TARGET_SPEC [--out eval/results]

A source record is merged only when its key (metric, cell parameters, settings digest: see
hf_kvcache.evaluation.sweep) is a cell of TARGET_SPEC; any other record (measured with other settings, or a cell the
target does not plan) is an error naming it, and nothing is written. The target keeps one record per cell, in its
order, a replaced record at the place of the one it replaces (new cells at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from hf_kvcache.evaluation.sweep import load_spec, plan_cells, read_results, run_sweep


def merge(source: Path, spec_path: str, out_dir: str) -> tuple[int, int]:
    """(records replaced, records added) in the target's results.jsonl; its reports rewritten."""
    spec = load_spec(spec_path)
    digest = spec.settings_digest()
    planned = {cell.key(digest) for cell in plan_cells(spec)}
    new = read_results(source / "results.jsonl")
    if not new:
        raise ValueError(f"{source / 'results.jsonl'} holds no finished cell.")
    foreign = [key for key in new if key not in planned]
    if foreign:
        raise ValueError(
            f"{len(foreign)} record(s) of {source} are not cells of {spec_path} (other settings or "
            f"cells it does not plan), e.g. {foreign[0]}; nothing merged."
        )
    target = Path(out_dir) / spec.name / "results.jsonl"
    old = read_results(target)  # (the last record of a key wins, as for the runner)
    merged = {key: new.get(key, record) for key, record in old.items()}
    merged.update({key: record for key, record in new.items() if key not in old})
    tmp = target.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(record) + "\n" for record in merged.values()))
    os.replace(tmp, target)
    run_sweep(spec, out_dir, progress=False, report_only=True)
    replaced = sum(key in old for key in new)
    return replaced, len(new) - replaced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="results directory of the re-run (holding results.jsonl)")
    parser.add_argument("spec", help="the target sweep's YAML spec")
    parser.add_argument("--out", default="eval/results", help="results root of the target (default eval/results)")
    args = parser.parse_args(argv)
    replaced, added = merge(args.source, args.spec, args.out)
    print(f"{replaced} record(s) replaced, {added} added; reports of {args.spec} rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
