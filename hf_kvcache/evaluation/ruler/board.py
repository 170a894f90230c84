"""The leaderboard run: every method x compression x protocol x task x context length x sample, resumable.

A *method* is a cache spec (hf_kvcache.evaluation.cache_spec: `(name, config)`) with the key its budget goes to;
a compression c keeps `1 - c` of the context (c = 0: the full cache, one shared row). Every generated answer is one
JSON line of `results.jsonl` under `out`, keyed by (method, compression, protocol, task, length, seed): a run that
stops resumes where it stopped and never recomputes a line. `summarize` gives one row per cell (mean score over the
samples, a 95% interval, n) and per (method, compression, protocol, length) the mean over the kept tasks, as kvpress's
leaderboard plots it (score vs compression, one line per method).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from . import make_sample
from .protocol import PROTOCOLS, prompt_parts, run_sample


@dataclass(frozen=True)
class Method:
    label: str
    cache: str  # a name for hf_kvcache.evaluation.cache_spec.make_cache
    config: dict = field(default_factory=dict)
    budget_key: str | None = "budget"  # the config key the kept share goes to; None: a fixed method
    fixed: float | None = None  # a fixed method's compression (quantized caches: 1 - their bytes / the full cache's)


#: the board's methods: every cache family in prompt mode (question-agnostic, kvpress's protocol), the evicting ones
#: also at decode time ("always"), the quantized caches at a nominal byte ratio on a float32 model (stated, not
#: measured: 1 byte of 4 for FP8, ~4.5 bits of 32 for KIVI int4 with its scales and residual)
DEFAULT_METHODS = [
    Method("KVzip (model-wide)", "kvzip", {"head_budget": "adaptive", "layer_budget": "adaptive"}),
    *[Method(f"{label} prompt", name, {"compress": "prompt"}) for label, name in (
        ("ExpectedAttention", "expected_attention"), ("SnapKV", "snapkv"), ("TOVA", "tova"), ("KeyDiff", "keydiff"),
        ("Knorm", "knorm"), ("H2O", "h2o"))],
    Method("StreamingLLM prompt", "sink", {"sinks": 4, "compress": "prompt"}, budget_key="window"),
    *[Method(f"{label} always", name, {"compress": "always"}) for label, name in (
        ("ExpectedAttention", "expected_attention"), ("SnapKV", "snapkv"), ("H2O", "h2o"))],
    Method("StreamingLLM always", "sink", {"sinks": 4}, budget_key="window"),
    Method("FP8 (E4M3)", "fp8", {}, budget_key=None, fixed=0.75),
    Method("KIVI int4", "kivi", {}, budget_key=None, fixed=0.84),
]


def cell_key(method: str, compression: float, protocol: str, task: str, length: int, seed: int) -> str:
    return json.dumps([method, round(compression, 4), protocol, task, length, seed])


def jobs(methods: list[Method], compressions: list[float], protocols: list[str], tasks: list[str],
         lengths: list[int], samples: int) -> Iterator[tuple[Method, float, str, str, int, int]]:
    """Every (method, compression, protocol, task, length, seed) to run; compression 0 is the full cache (once)."""
    for protocol in protocols:
        if protocol not in PROTOCOLS:
            raise ValueError(f"`protocols`: each must be one of {PROTOCOLS}, got {protocol!r}.")
    for c in compressions:
        if not 0.0 <= c < 1.0:
            raise ValueError(f"`compressions`: each must be in [0, 1), got {c!r}.")
    full = Method("full", "dynamic", {}, None)
    for protocol in protocols:
        for length in lengths:
            for task in tasks:
                for seed in range(samples):
                    if 0.0 in compressions:
                        yield full, 0.0, protocol, task, length, seed
                    for method in methods:
                        points = [method.fixed] if method.budget_key is None else [c for c in compressions if c > 0]
                        for c in points:
                            yield method, c, protocol, task, length, seed


def done_keys(path: Path) -> set[str]:
    """Keys of the answers already in `path`. A run killed in the middle of a line leaves it without its newline:
    that line is cut off here (its answer is run again), so appending never glues two records together."""
    if not path.exists():
        return set()
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        path.write_text(text, encoding="utf-8")
    return {json.loads(line)["key"] for line in text.splitlines() if line.strip()}


def run_board(model, tokenizer, make_cache: Callable[[str, dict], object], methods: list[Method],
              compressions: list[float], protocols: list[str], tasks: list[str], lengths: list[int], samples: int,
              out: Path, progress: bool = False) -> Path:
    """Run every missing job, appending one line per answer to `out`/results.jsonl (returned). `make_cache(name,
    config, context_tokens)` builds a fresh cache; the kept share is a fraction of the context's tokens (the text
    compressed), resolved by the harness so every method keeps the same number of tokens."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    done = done_keys(path)
    todo = [j for j in jobs(methods, compressions, protocols, tasks, lengths, samples)
            if cell_key(j[0].label, *j[1:]) not in done]
    if progress:
        from tqdm.auto import tqdm

        todo = tqdm(todo, desc="ruler", unit="answer")
    with path.open("a", encoding="utf-8") as f:
        for method, c, protocol, task, length, seed in todo:
            config = dict(method.config)
            if method.budget_key is not None:
                config[method.budget_key] = round(1.0 - c, 4)
            sample = make_sample(task, length, seed, tokenizer)
            context = len(tokenizer(prompt_parts(sample, protocol)[0], add_special_tokens=False).input_ids)
            result = run_sample(model, tokenizer, sample, make_cache(method.cache, config, context), protocol)
            record = {"key": cell_key(method.label, c, protocol, task, length, seed), "method": method.label,
                      "cache": method.cache, "config": config, "compression": c, "protocol": protocol,
                      "task": task, "context_len": length, "seed": seed, **result}
            f.write(json.dumps(record) + "\n")
            f.flush()
    return path


def interval95(scores: list[float]) -> tuple[float, float]:
    """95% normal-approximation interval of the mean score, clipped to [0, 1]."""
    n = len(scores)
    mean = sum(scores) / n
    sd = math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1)) if n > 1 else 0.0
    return max(0.0, mean - 1.96 * sd / math.sqrt(n)), min(1.0, mean + 1.96 * sd / math.sqrt(n))


def summarize(path: Path, tasks: list[str] | None = None) -> dict[str, list[dict]]:
    """{"cells": per (method, compression, protocol, task, length), "board": per (method, compression, protocol,
    length) the mean over `tasks` (all tasks seen when None) with the mean of the cells' interval half-widths}."""
    groups: dict[tuple, list[float]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        groups.setdefault((r["method"], r["compression"], r["protocol"], r["task"], r["context_len"]), []).append(
            r["score"])
    cells = []
    for (method, c, protocol, task, length), scores in sorted(groups.items()):
        low, high = interval95(scores)
        cells.append({"method": method, "compression": c, "protocol": protocol, "task": task, "context_len": length,
                      "n": len(scores), "score": sum(scores) / len(scores), "ci95": [low, high]})
    wanted = set(tasks) if tasks is not None else {c["task"] for c in cells}
    board: dict[tuple, list[dict]] = {}
    for cell in cells:
        if cell["task"] in wanted:
            board.setdefault((cell["method"], cell["compression"], cell["protocol"], cell["context_len"]),
                             []).append(cell)
    rows = [{"method": m, "compression": c, "protocol": p, "context_len": n, "tasks": len(cs),
             "score": sum(x["score"] for x in cs) / len(cs),
             "ci95_halfwidth": sum((x["ci95"][1] - x["ci95"][0]) / 2 for x in cs) / len(cs),
             "samples": min(x["n"] for x in cs)}
            for (m, c, p, n), cs in sorted(board.items())]
    return {"cells": cells, "board": rows}


def plot_board(rows: list[dict], path: Path, title: str) -> None:
    """Score vs compression, one line per method (the full cache drawn as a horizontal reference), one panel per
    (protocol, context length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["protocol"], r["context_len"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (protocol, length) in zip(axes[0], panels):
        mine = [r for r in rows if r["protocol"] == protocol and r["context_len"] == length]
        for method in sorted({r["method"] for r in mine}):
            points = sorted((r["compression"], r["score"]) for r in mine if r["method"] == method)
            if method == "full":
                ax.axhline(points[0][1], color="black", linestyle="--", label="full cache")
            else:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
        ax.set_title(f"{protocol}, {length} tokens")
        ax.set_xlabel("compression (share of the context dropped)")
        ax.set_ylabel("score (mean over tasks)")
        ax.set_ylim(0, 1)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
