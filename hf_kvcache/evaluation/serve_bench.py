"""`hf-kvcache serve-bench`: continuous batching (`model.generate_batch`) under a fixed KV memory budget, with
model-dtype pages vs quantized pages, in one interleaved run.

The command's flags and their parsing are hf_kvcache.cli.serve_bench_command; the benchmark, one module per job:
- hf_kvcache.evaluation.serve_workload: the settings (validated), page formats (`parse_format`), the requests
  (`make_workload`) and the continuous-batching config of a run;
- hf_kvcache.evaluation.serve_runner: the interleaved sweep (`run_serve_bench`, `run_once`): protocol, concurrency and
  serving measurements of each run;
- hf_kvcache.evaluation.serve_kl: KL / top-1 of quantized pages against the model-dtype run, and QuantizedFP8Cache on
  the
  same text;
- hf_kvcache.evaluation.serve_report: the summary (ratios to model-dtype pages) and the files OUT.json (everything, with
  the per-forward trace of every run), OUT.csv (one row per run) and OUT.png (concurrency vs budget).
The names of those modules that callers use are re-exported here.
"""

from __future__ import annotations

from .serve_report import summarize, summary_lines, write_results
from .serve_runner import run_once, run_serve_bench
from .serve_workload import DEFAULT_FORMATS, SCALE_DTYPE_NAMES, ServeBenchSettings, make_workload, parse_format

__all__ = [
    "DEFAULT_FORMATS",
    "SCALE_DTYPE_NAMES",
    "ServeBenchSettings",
    "make_workload",
    "parse_format",
    "run_once",
    "run_serve_bench",
    "summarize",
    "summary_lines",
    "write_results",
]
