"""Sweeps: a YAML spec of caches x budgets x metrics x context lengths, run cell by cell, resumable.

Spec (every field is checked before any model is loaded; an error names the field, e.g. `caches[2].name`):

```yaml
name: h2o-smollm2                 # results go to <out>/<name>/ (default: the file name)
model: smollm2                    # Hub id, local path, or "smollm2" (offline)
dtype: float32                    # float32 | bfloat16 | float16
threads: 2                        # torch threads
text: pydoc                       # "pydoc" (offline), a text file, "hf:DATASET", or "random" (random ids; tests)
text_offset: 20000                # where the tokens start in the text
context_lengths: [2048]           # prompt lengths; budget fractions resolve against them
scored_tokens: 128                # quality: tokens scored after the prompt, one per forward
prefill_chunk: null               # prefill in chunks of this many tokens (null: one forward)
metrics: [quality, speed]         # quality (ppl/KL/top-1/top-5/bytes/ms per token), ppl, speed, retrieval
budgets: [0.05, 0.1, 0.25, 0.5, 1.0]   # fractions of the context (float in (0, 1], "N%") or tokens (int)
caches:
  - name: dynamic                 # no budget_key: run once, as the reference
  - name: sink
    config: {sinks: 4}
    budget_key: budget            # which config key receives each budget
  - name: h2o
    budget_key: budget
    budgets: [0.1, 0.2]           # optional per-cache budgets
    label: H2O                    # optional display name
ppl: {tokens: 4096, mode: chunked, chunk: 64, bucket: 1024}
speed: {decode_tokens: 32, rounds: 3}
retrieval: {kinds: [passkey, records], positions: [early, middle, late], samples: 2, context_lengths: [4096],
            chat: false}
```

Cells: `quality` and `ppl` per (context length, cache, budget); `retrieval` per (cache, budget, kind, context
length, position); `speed` per context length (all caches interleaved in one cell, one row each). Every finished
cell is appended as one JSON line to `results.jsonl`, keyed by its parameters and by a digest of the settings that
change results (model, dtype, text, offset, scored tokens, ...). A restarted sweep skips cells already there, so an
interruption loses at most the cell that was running (exact `ppl` streams also checkpoint every 1024 tokens
inside the cell, under `checkpoints/`, and resume from there). `results.csv` (scalar columns), `summary.json` (spec,
environment, rows), `environment.json` and the plots are rewritten after every run.

Modules: `sweep_spec` (the spec and its checks), `sweep_cells` (planning and measuring cells), `sweep_results`
(results files and reports); this module runs a sweep and re-exports their public names.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from .sweep_cells import RUNNERS, Cell, CellContext, plan_cells
from .sweep_results import _append, environment, format_summary, read_results, write_reports
from .sweep_spec import METRICS, SpecError, Sweep, load_spec

__all__ = [
    "METRICS",
    "Cell",
    "SpecError",
    "Sweep",
    "environment",
    "format_summary",
    "load_spec",
    "plan_cells",
    "read_results",
    "run_sweep",
    "write_reports",
]


def run_sweep(
    spec: Sweep | str | os.PathLike | dict,
    out_dir: str | os.PathLike = "eval/results",
    loader: Callable[[str, str], tuple] | None = None,
    progress: bool = True,
    on_cell: Callable[[Cell], None] | None = None,
    dry_run: bool = False,
    report_only: bool = False,
) -> list[dict]:
    """Run every cell not already in `<out_dir>/<name>/results.jsonl`; returns all rows (old and new).
    `loader(model, dtype) -> (model, tokenizer)` defaults to `hf_kvcache.sharing.models.load_model`. `on_cell` is
    called
    after each finished cell (tests use it to interrupt a run). `report_only` runs nothing and rewrites the reports
    from the cells already done (for a sweep stopped part-way)."""
    if not isinstance(spec, Sweep):
        spec = load_spec(spec)
    out = Path(out_dir) / spec.name
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    digest = spec.settings_digest()
    done = read_results(results)
    cells = plan_cells(spec)
    todo = [c for c in cells if c.key(digest) not in done]
    if dry_run:
        return [{"metric": c.metric, **c.params, "done": c.key(digest) in done} for c in cells]
    env = environment()
    if todo and not report_only:
        import torch

        if spec.threads:
            torch.set_num_threads(spec.threads)
        env["torch_threads"] = torch.get_num_threads()
        if loader is None:
            from ..sharing.models import load_model

            def loader(name, dtype):
                return load_model(name, dtype=getattr(torch, dtype))

        model, tokenizer = loader(spec.model, spec.dtype)
        ctx = CellContext(spec, model, tokenizer, out, digest)
        runs = json.loads((out / "environment.json").read_text()) if (out / "environment.json").is_file() else []
        runs = runs if isinstance(runs, list) else [runs]
        runs.append({**env, "cells_planned": len(cells), "cells_to_run": len(todo)})
        (out / "environment.json").write_text(json.dumps(runs, indent=1))
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc=spec.name, unit="cell")
        for cell in todo:
            if bar is not None:
                bar.set_postfix_str(f"{cell.metric} {cell.params.get('label', '')} n={cell.params['context_len']}")
            t0 = time.perf_counter()
            rows = RUNNERS[cell.metric](ctx, cell)
            record = {
                "key": cell.key(digest),
                "metric": cell.metric,
                "params": cell.params,
                "rows": rows,
                "cell_s": time.perf_counter() - t0,
                "finished": datetime.datetime.now().isoformat(timespec="seconds"),
                "git_commit": env.get("git_commit"),
            }
            _append(results, record)
            done[record["key"]] = record
            if bar is not None:
                bar.update(1)
            if on_cell is not None:
                on_cell(cell)
        if bar is not None:
            bar.close()
    records = [done[c.key(digest)] for c in cells if c.key(digest) in done]
    return write_reports(out, spec, records, env)
