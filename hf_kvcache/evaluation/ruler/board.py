"""The leaderboard run: every method x compression x protocol x task x context length x sample, resumable.

A *method* is a cache spec (hf_kvcache.evaluation.cache_spec: `(name, config)`) with the key its budget goes to;
a compression c keeps `1 - c` of the context (c = 0: the full cache, one shared row; a quantized cache: one point,
its compression measured from its bytes). Every generated answer is one JSON line of `results.jsonl` under `out`
(`results.<i>of<n>.jsonl` for shard i of n processes), keyed by (method, compression, protocol, task, length, seed):
a run that stops resumes where it stopped and never recomputes a line. The samples of a cell can run as left-padded
batches (`protocol.run_batch`); each sample is made once per board (`samples*.jsonl`). `summarize` gives one row per
cell (mean score over the samples, a 95% interval, n) and per (method, compression, protocol, length) the mean over
the kept tasks, as kvpress's leaderboard plots it (score vs compression, one line per method).
"""

from __future__ import annotations

import json
import lzma
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..memory import Precision, cache_nbytes, kv_cache_bytes, shape_from_config
from . import make_sample
from .protocol import PROTOCOLS, prompt_parts, run_batch, tail_length
from .sample import Sample


@dataclass(frozen=True)
class Method:
    label: str
    cache: str  # a name for hf_kvcache.evaluation.cache_spec.make_cache
    config: dict = field(default_factory=dict)
    budget_key: str | None = "budget"  # the config key the kept share goes to; None: a fixed method (see FIXED)
    batchable: bool = True  # False: a row's result depends on the batch's other rows, so samples run one at a time


#: the compression point of a method with no budget (quantized caches): one point per cell, its compression measured
#: from the bytes the cache holds against a full cache of the same tokens at the model's dtype
FIXED = "fixed"

#: the board's methods: every cache family in prompt mode (question-agnostic, kvpress's protocol), every evicting one
#: also at decode time ("always": the budget holds through the question and the answer), the quantized caches at the
#: byte ratio they measure
DEFAULT_METHODS = [
    # model-wide layer shares are averaged over a batch's rows: one sample at a time
    Method("KVzip (model-wide)", "kvzip", {"head_budget": "adaptive", "layer_budget": "adaptive"}, batchable=False),
    *[
        Method(f"{label} {mode}", name, {"compress": mode})
        for mode in ("prompt", "always")
        for label, name in (
            ("ExpectedAttention", "expected_attention"),
            ("SnapKV", "snapkv"),
            ("TOVA", "tova"),
            ("KeyDiff", "keydiff"),
            ("Knorm", "knorm"),
            ("H2O", "h2o"),
        )
    ],
    Method("StreamingLLM prompt", "sink", {"sinks": 4, "compress": "prompt"}, budget_key="window"),
    Method("StreamingLLM always", "sink", {"sinks": 4}, budget_key="window"),
    Method("FP8 (E4M3)", "fp8", {}, budget_key=None),
    Method("KIVI int4", "kivi", {}, budget_key=None, batchable=False),  # its token blocks follow the padded stream
]


#: the label of the full cache, the method every board runs at compression 0
FULL_LABEL = "full"


def cell_key(method: str, compression, protocol: str, task: str, length: int, seed: int) -> str:
    point = compression if compression == FIXED else round(compression, 4)
    return json.dumps([method, point, protocol, task, length, seed])


def jobs(
    methods: list[Method],
    compressions: list[float],
    protocols: list[str],
    tasks: list[str],
    lengths: list[int],
    samples: int,
) -> Iterator[tuple[Method, float | str, str, str, int, int]]:
    """Every (method, compression, protocol, task, length, seed) to run; compression 0 is the full cache (once), a
    method without a budget runs once per cell at FIXED."""
    for protocol in protocols:
        if protocol not in PROTOCOLS:
            raise ValueError(f"`protocols`: each must be one of {PROTOCOLS}, got {protocol!r}.")
    for c in compressions:
        if not 0.0 <= c < 1.0:
            raise ValueError(f"`compressions`: each must be in [0, 1), got {c!r}.")
    full = Method(FULL_LABEL, "dynamic", {}, None)
    for protocol in protocols:
        for length in lengths:
            for task in tasks:
                for seed in range(samples):
                    if 0.0 in compressions:
                        yield full, 0.0, protocol, task, length, seed
                    for method in methods:
                        points = [FIXED] if method.budget_key is None else [c for c in compressions if c > 0]
                        for c in points:
                            yield method, c, protocol, task, length, seed


def result_files(out: Path) -> list[Path]:
    """Every answer file under `out`: results.jsonl, the shards' results.<i>of<n>.jsonl, and any of them committed
    xz-compressed (read-only: new answers go to a plain file beside it)."""
    return sorted([*out.glob("results*.jsonl"), *out.glob("results*.jsonl.xz")])


def done_keys(path: Path) -> set[str]:
    """Keys of the answers already in `path`. A run killed in the middle of a line leaves it without its newline:
    that line is cut off here (its answer is run again), so appending never glues two records together."""
    return {json.loads(line)["key"] for line in complete_lines(path)}


def complete_lines(path: Path) -> list[str]:
    """The whole lines of an append-only JSONL file; a last line cut off without its newline is removed from the
    file, so the next append starts a line of its own."""
    if not path.exists():
        return []
    if path.suffix == ".xz":
        with lzma.open(path, "rt", encoding="utf-8") as f:
            return [line for line in f.read().splitlines() if line.strip()]
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        path.write_text(text, encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def load_samples(out: Path) -> dict[tuple, Sample]:
    """The samples a board has made (out/samples*.jsonl), by (task, length, seed): made once, then read back (making
    a 4K sample tokenizes its context several times; the board asks for each one per method and compression)."""
    found = {}
    for path in sorted(out.glob("samples*.jsonl")) if out.is_dir() else []:
        for line in complete_lines(path):
            r = json.loads(line)
            found[r["task"], r["context_len"], r["seed"]] = Sample(**r["sample"])
    return found


def save_samples(path: Path, samples: dict[tuple, Sample]) -> None:
    with path.open("a", encoding="utf-8") as f:
        for (task, length, seed), sample in samples.items():
            f.write(json.dumps({"task": task, "context_len": length, "seed": seed, "sample": sample.to_dict()}) + "\n")


def full_cache_bytes(model, batch: int, tokens: int) -> int:
    """Bytes a full cache holds for `batch` rows of `tokens` tokens at the model's dtype (keys and values of every
    layer as DynamicCache holds them: sliding layers their window; `shape_from_config`), the reference of a fixed
    method's measured compression."""
    bits = next(model.parameters()).element_size() * 8
    return int(kv_cache_bytes(shape_from_config(model.config), Precision(f"{bits}-bit", bits), tokens, batch))


def _batches(group: list[tuple], batch_size: int, tail_of) -> Iterator[list[tuple]]:
    """A group's jobs in batches of at most `batch_size` whose samples share the tail's token length."""
    by_tail: dict[int, list[tuple]] = {}
    for job in group:
        by_tail.setdefault(tail_of(job), []).append(job)
    for same in by_tail.values():
        for i in range(0, len(same), batch_size):
            yield same[i : i + batch_size]


def run_board(
    model,
    tokenizer,
    make_cache: Callable[[str, dict, int], object],
    methods: list[Method],
    compressions: list[float],
    protocols: list[str],
    tasks: list[str],
    lengths: list[int],
    samples: int,
    out: Path,
    progress: bool = False,
    batch_size: int = 1,
    shard: tuple[int, int] = (0, 1),
    keep_going: bool = False,
) -> Path:
    """Run every missing job, appending one line per answer to `out`/results.jsonl (returned; shard i of n writes
    results.<i>of<n>.jsonl and takes every n-th cell). `make_cache(name, config, context_tokens)` builds a fresh cache;
    the kept share is a fraction of the context's tokens, resolved by the harness so every method keeps the same number
    of tokens. With `batch_size` > 1 the samples of a cell run as left-padded batches (`protocol.run_batch`) whose rows
    share the token budget of their mean context length. With `keep_going` a failing batch is written to
    errors.jsonl and the run goes on."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be an integer >= 1, got {batch_size!r}.")
    index, count = shard
    if not (isinstance(index, int) and isinstance(count, int) and 0 <= index < count):
        raise ValueError(f"`shard` must be (i, n) with 0 <= i < n, got {shard!r}.")
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("results.jsonl" if count == 1 else f"results.{index}of{count}.jsonl")
    done = set().union(*(done_keys(p) for p in result_files(out)))
    cells: dict[tuple, list[tuple]] = {}
    for job in jobs(methods, compressions, protocols, tasks, lengths, samples):
        cells.setdefault((job[0].label,) + job[1:5], []).append(job)
    # shards split the cells in plan order (done or not, so a shard's share never moves), then drop the done jobs
    mine = [
        [j for j in group if cell_key(j[0].label, *j[1:]) not in done]
        for i, group in enumerate(cells.values())
        if i % count == index
    ]
    mine = [group for group in mine if group]
    memo: dict[tuple, tuple] = {}
    made = load_samples(out)
    sample_path = out / ("samples.jsonl" if count == 1 else f"samples.{index}of{count}.jsonl")

    def sample_of(job):  # (sample, context tokens, tail tokens), made once per (task, length, seed, protocol)
        _, _, protocol, task, length, seed = job
        if (task, length, seed, protocol) not in memo:
            if (task, length, seed) not in made:
                made[task, length, seed] = make_sample(task, length, seed, tokenizer)
                save_samples(sample_path, {(task, length, seed): made[task, length, seed]})
            sample = made[task, length, seed]
            context = len(tokenizer(prompt_parts(sample, protocol)[0], add_special_tokens=False).input_ids)
            memo[task, length, seed, protocol] = (sample, context, tail_length(tokenizer, sample, protocol))
        return memo[task, length, seed, protocol]

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(g) for g in mine), desc="ruler", unit="answer")
    with path.open("a", encoding="utf-8") as f:
        for group in mine:
            size = batch_size if group[0][0].batchable else 1
            for batch in _batches(group, size, lambda job: sample_of(job)[2]):
                _run_batch(model, tokenizer, make_cache, batch, [sample_of(j) for j in batch], f, out, keep_going)
                if bar is not None:
                    bar.update(len(batch))
    if bar is not None:
        bar.close()
    return path


def _run_batch(model, tokenizer, make_cache, batch, made, f, out: Path, keep_going: bool) -> None:
    method, c, protocol, task, length, _ = batch[0]
    context = round(sum(m[1] for m in made) / len(made))
    config = dict(method.config)
    if method.budget_key is not None:
        config[method.budget_key] = round(1.0 - c, 4)
    try:
        cache = make_cache(method.cache, config, context)
        results = run_batch(model, tokenizer, [m[0] for m in made], cache, protocol)
    except torch.OutOfMemoryError:
        if len(batch) == 1:
            raise
        cache = None
        torch.cuda.empty_cache()  # a batch too large for the device runs as two halves (each with its own budget)
        half = len(batch) // 2
        for part, got in ((batch[:half], made[:half]), (batch[half:], made[half:])):
            _run_batch(model, tokenizer, make_cache, part, got, f, out, keep_going)
        return
    except Exception as err:
        if not keep_going:
            raise
        with (out / "errors.jsonl").open("a", encoding="utf-8") as e:
            e.write(
                json.dumps(
                    {
                        "method": method.label,
                        "compression": c,
                        "protocol": protocol,
                        "task": task,
                        "context_len": length,
                        "seeds": [j[5] for j in batch],
                        "error": f"{type(err).__name__}: {err}",
                    }
                )
                + "\n"
            )
        return
    measured = c
    if c == FIXED:
        full = full_cache_bytes(model, len(batch), cache.get_seq_length())
        measured = 1.0 - cache_nbytes(cache) / full
    for job, result in zip(batch, results):
        record = {
            "key": cell_key(method.label, *job[1:]),
            "method": method.label,
            "cache": method.cache,
            "config": config,
            "point": c,
            "compression": measured,
            "protocol": protocol,
            "task": task,
            "context_len": length,
            "seed": job[5],
            "batch": len(batch),
            "budget_context": context,
            **result,
        }
        f.write(json.dumps(record, default=repr) + "\n")
    f.flush()


def standard_error(scores: list[float]) -> float:
    """Standard error of the mean score (sample standard deviation / sqrt(n); 0 for one sample)."""
    n = len(scores)
    mean = sum(scores) / n
    return math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1) / n) if n > 1 else 0.0


def interval95(scores: list[float]) -> tuple[float, float]:
    """95% normal-approximation interval of the mean score, clipped to [0, 1]."""
    mean, half = sum(scores) / len(scores), 1.96 * standard_error(scores)
    return max(0.0, mean - half), min(1.0, mean + half)


def records(where: Path) -> list[dict]:
    """Every answer recorded under `where` (a board's directory: all its result files) or in one results file, once
    per key (two processes that answered the same job, e.g. a shard restarted beside its old self: the first)."""
    paths = result_files(where) if where.is_dir() else [where]
    found: dict[str, dict] = {}
    for p in paths:
        for line in complete_lines(p):
            r = json.loads(line)
            found.setdefault(r["key"], r)
    return list(found.values())


def summarize(where: Path, tasks: list[str] | None = None) -> dict[str, list[dict]]:
    """{"cells": per (method, compression, protocol, task, length) the mean score, a 95% interval and n, "board": per
    (method, compression, protocol, length) the mean over `tasks` (all tasks seen when None) with the 95% half-width
    of that mean (the tasks' samples independent), `complete` when every task has all its samples. A fixed method's
    compression is the mean it measured."""
    groups: dict[tuple, list[dict]] = {}
    for r in records(where):
        point = r.get("point", r["compression"])
        groups.setdefault((r["method"], point, r["protocol"], r["task"], r["context_len"]), []).append(r)
    cells = []
    for (method, point, protocol, task, length), rs in sorted(groups.items(), key=lambda kv: json.dumps(kv[0])):
        scores = [r["score"] for r in rs]
        low, high = interval95(scores)
        cells.append(
            {
                "method": method,
                "compression": sum(r["compression"] for r in rs) / len(rs),
                "protocol": protocol,
                "task": task,
                "context_len": length,
                "n": len(scores),
                "score": sum(scores) / len(scores),
                "ci95": [low, high],
                "stderr": standard_error(scores),
                "point": point,
            }
        )
    wanted = set(tasks) if tasks is not None else {c["task"] for c in cells}
    board: dict[tuple, list[dict]] = {}
    for cell in cells:
        if cell["task"] in wanted:
            board.setdefault((cell["method"], cell["point"], cell["protocol"], cell["context_len"]), []).append(cell)
    planned = {}  # per length, the most answers any cell has: the board's sample count
    for cell in cells:
        planned[cell["context_len"]] = max(planned.get(cell["context_len"], 0), cell["n"])
    rows = []
    for (m, _point, p, n), cs in sorted(board.items(), key=lambda kv: json.dumps(kv[0])):
        variance = sum(x["stderr"] ** 2 for x in cs)
        rows.append(
            {
                "method": m,
                "compression": sum(x["compression"] for x in cs) / len(cs),
                "protocol": p,
                "context_len": n,
                "tasks": len(cs),
                "score": sum(x["score"] for x in cs) / len(cs),
                "ci95_halfwidth": 1.96 * math.sqrt(variance) / len(cs),
                "samples": min(x["n"] for x in cs),
                "complete": {x["task"] for x in cs} == wanted and all(x["n"] == planned[n] for x in cs),
            }
        )
    for cell in cells:
        del cell["point"]
    return {"cells": cells, "board": rows}


def plot_board(rows: list[dict], path: Path, title: str) -> None:
    """Score vs compression, one line per method (a family's decode-time line dashed in its prompt-mode colour; a
    fixed method one point; the full cache a horizontal reference), one panel per (protocol, context length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("complete", True)]  # a mean over fewer tasks or samples is another scale
    panels = sorted({(r["protocol"], r["context_len"]) for r in rows if r["method"] != FULL_LABEL})
    families = sorted({r["method"].rsplit(" ", 1)[0] for r in rows if r["method"] != FULL_LABEL})
    colors = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels) + 2.5, 4.5), squeeze=False)
    for ax, (protocol, length) in zip(axes[0], panels):
        mine = [r for r in rows if r["protocol"] == protocol and r["context_len"] == length]
        for method in sorted({r["method"] for r in mine}):
            points = sorted((r["compression"], r["score"]) for r in mine if r["method"] == method)
            if method == FULL_LABEL:
                ax.axhline(points[0][1], color="black", linestyle="--", label="full cache")
            else:
                ax.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    marker="o",
                    markersize=3,
                    label=method,
                    color=colors[method.rsplit(" ", 1)[0]],
                    linestyle="--" if method.endswith("always") else "-",
                )
        ax.set_title(f"{protocol}, {length} tokens")
        ax.set_xlabel("compression (share of the context dropped)")
        ax.set_ylabel("score (mean over tasks)")
        ax.set_ylim(0, 1)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1 - 2.3 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
