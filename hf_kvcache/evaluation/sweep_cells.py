"""Sweep cells: what one sweep runs (`plan_cells`: quality / ppl per context length, cache and budget; speed per
context length, every cache interleaved; retrieval per cache, probe, length and position) and how each cell is
measured (`RUNNERS[metric](context, cell) -> rows`). `CellContext` holds what the cells of one run share: the
model, the tokens and the full-cache reference log-probs per context length."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .sweep_spec import Sweep

__all__ = ["Cell", "CellContext", "RUNNERS", "plan_cells"]


@dataclass
class Cell:
    metric: str
    params: dict  # what identifies the cell (JSON-able)
    caches: list = field(default_factory=list)  # [(label, name, config, budget)]

    def key(self, digest: str) -> str:
        return json.dumps({"metric": self.metric, "settings": digest, **self.params}, sort_keys=True)


def plan_cells(s: Sweep) -> list[Cell]:
    """Every cell of the sweep, in run order."""
    variants = [(label, e.name, cfg, b) for e in s.caches for b, cfg, label in e.variants(s.budgets)]
    cells = []
    for n in s.context_lengths:
        for metric in ("quality", "ppl"):
            if metric in s.metrics:
                for label, name, cfg, b in variants:
                    params = {"context_len": n, "cache": name, "config": cfg, "label": label, "budget": b}
                    if metric == "ppl":
                        params["ppl"] = s.ppl
                    cells.append(Cell(metric, params, [(label, name, cfg, b)]))
        if "speed" in s.metrics:
            cells.append(
                Cell(
                    "speed",
                    {"context_len": n, "caches": [[lb, nm, cf] for lb, nm, cf, _ in variants], "speed": s.speed},
                    variants,
                )
            )
    if "retrieval" in s.metrics:
        r = s.retrieval
        for n in r["context_lengths"] or s.context_lengths:
            for kind in r["kinds"]:
                for pos in r["positions"]:
                    for label, name, cfg, b in variants:
                        params = {
                            "context_len": n,
                            "kind": kind,
                            "position": pos,
                            "cache": name,
                            "config": cfg,
                            "label": label,
                            "budget": b,
                            "samples": r["samples"],
                            "chat": r["chat"],
                            "max_new_tokens": r["max_new_tokens"],
                        }
                        cells.append(Cell("retrieval", params, [(label, name, cfg, b)]))
    return cells


class CellContext:
    """What cells share in one run: the model, tokens and reference log-probs per context length."""

    def __init__(self, spec: Sweep, model, tokenizer, out: Path | None = None, digest: str = ""):
        self.spec, self.model, self.tokenizer, self.out, self.digest = spec, model, tokenizer, out, digest
        self._tokens = None
        self._refs: dict[int, Any] = {}

    def tokens(self, n: int):
        import torch

        s = self.spec
        need = s.text_offset + n
        if self._tokens is None or self._tokens.shape[1] < need:
            if s.text == "random":
                g = torch.Generator().manual_seed(s.seed)
                vocab = self.model.config.vocab_size
                self._tokens = torch.randint(2, vocab, (1, need), generator=g)
            else:
                from ..sharing.corpus import load_tokens

                self._tokens = load_tokens(self.tokenizer, s.text, max_tokens=need)
        return self._tokens[:, s.text_offset : s.text_offset + n]

    def reference(self, n: int):
        from transformers import DynamicCache

        from .divergence import cache_logprobs

        if n not in self._refs:
            ids = self.tokens(n + self.spec.scored_tokens)
            self._refs[n] = cache_logprobs(
                self.model, ids, DynamicCache(config=self.model.config), n, self.spec.prefill_chunk
            )
        return self._refs[n]


def _run_quality(ctx: CellContext, cell: Cell) -> list[dict]:
    import torch

    from .cache_spec import make_cache, resolve_config
    from .divergence import cache_logprobs, divergence_metrics
    from .memory import Precision, cache_nbytes, expected_tokens, kv_cache_bytes, shape_from_config

    s, p = ctx.spec, cell.params
    n, total = p["context_len"], p["context_len"] + s.scored_tokens
    ids = ctx.tokens(total)
    ref = ctx.reference(n)
    resolved = resolve_config(p["cache"], p["config"], n)
    cache = make_cache(ctx.model, p["cache"], p["config"], context_len=n, total_len=total)
    after_prompt = []

    def measure_prompt(c) -> None:
        """The bytes held for the prompt alone, compressed: a cache that compresses the context on request
        (KVzip, KVzap) does it now, as its first decode step would; a cache that compresses in every forward has by
        now; a prompt-mode scorer cache only at its first decode step (not measured here)."""
        if hasattr(c, "compress_context"):
            c.compress_context(ctx.model)
        elif getattr(c, "compress", "always") == "prompt":
            return
        after_prompt.append(cache_nbytes(c))

    t0 = time.perf_counter()
    logp = cache_logprobs(ctx.model, ids, cache, n, s.prefill_chunk, after_prefill=measure_prompt)
    elapsed = time.perf_counter() - t0
    m = divergence_metrics(ref, logp, ids[0, n:].cpu())
    dtype = next(ctx.model.parameters()).dtype
    shape = shape_from_config(ctx.model.config)  # layer by layer: a hybrid model's sliding layers hold their window
    precision = Precision(str(dtype).replace("torch.", ""), torch.finfo(dtype).bits)
    held = cache_nbytes(cache)
    dense = kv_cache_bytes(shape, precision, total)
    theory = kv_cache_bytes(shape, precision, total, kept=expected_tokens(resolved, total))
    return [
        {
            "metric": "quality",
            "context_len": n,
            "label": p["label"],
            "cache": p["cache"],
            "budget": p["budget"],
            "budget_tokens": _budget_tokens(resolved, p),
            "config": resolved,
            "scored_tokens": s.scored_tokens,
            **m,
            "bytes_held": held,
            "theory_bytes": theory,
            "dense_bytes": dense,
            "bytes_vs_dense": held / dense,
            # what the cache holds once the prompt is compressed, against a bfloat16 cache of the prompt: the
            # equal-bytes comparison (docs/results.md)
            "prompt_bytes_held": after_prompt[0] if after_prompt else None,
            "prompt_bytes_vs_bf16": after_prompt[0] / kv_cache_bytes(shape, Precision("bfloat16", 16), n)
            if after_prompt
            else None,
            "score_ms_per_token": 1000 * elapsed / s.scored_tokens,
        }
    ]


def _budget_tokens(resolved: dict, p: dict):
    spec_budget = p.get("budget")
    if spec_budget is None:
        return None
    for key, value in p["config"].items():
        if value == spec_budget:
            return resolved.get(key)
    return None


def _run_ppl(ctx: CellContext, cell: Cell) -> list[dict]:
    from .cache_spec import make_factory, resolve_config
    from .perplexity import run_perplexity

    s, p = ctx.spec, cell.params
    n, cfg = p["context_len"], s.ppl
    ids = ctx.tokens(cfg["tokens"])
    factory = make_factory(ctx.model, (p["cache"], p["config"]), context_len=n, total_len=cfg["tokens"])
    kwargs, ckpt = {}, None
    if cfg["mode"] == "stream" and ctx.out is not None:
        # a long exact stream resumes inside the cell too (streaming.py checkpoints); removed once the cell is done
        key = cell.key(ctx.digest)
        ckpt = ctx.out / "checkpoints" / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".pt")
        kwargs = {"checkpoint": ckpt, "tag": key, "checkpoint_every": 1024}
    t0 = time.perf_counter()
    r = run_perplexity(ctx.model, ids, factory, mode=cfg["mode"], chunk=cfg["chunk"], bucket=cfg["bucket"], **kwargs)
    if ckpt is not None:
        for path in (ckpt, Path(str(ckpt) + ".nlls.npy"), Path(str(ckpt) + ".json")):
            path.unlink(missing_ok=True)
    resolved = resolve_config(p["cache"], p["config"], n)
    return [
        {
            "metric": "ppl",
            "context_len": n,
            "label": p["label"],
            "cache": p["cache"],
            "budget": p["budget"],
            "budget_tokens": _budget_tokens(resolved, p),
            "config": resolved,
            "ppl": r["ppl"],
            "tokens": r["tokens"],
            "protocol": r["protocol"],
            "buckets": r["buckets"],
            "elapsed_s": time.perf_counter() - t0,
        }
    ]


def _run_speed(ctx: CellContext, cell: Cell) -> list[dict]:
    from .cache_spec import make_factory
    from .speed import measure_speed

    s, p = ctx.spec, cell.params
    n = p["context_len"]
    dec = s.speed["decode_tokens"]
    ids = ctx.tokens(n + dec)
    factories = {
        label: make_factory(ctx.model, (name, cfg), context_len=n, total_len=n + dec)
        for label, name, cfg, _ in cell.caches
    }
    rows = measure_speed(ctx.model, ids, factories, n, decode_tokens=dec, rounds=s.speed["rounds"])
    budgets = {label: b for label, _, _, b in cell.caches}
    names = {label: name for label, name, _, _ in cell.caches}
    out = []
    for r in rows:
        label = r.pop("cache")
        out.append(
            {
                "metric": "speed",
                "context_len": n,
                "label": label,
                "cache": names.get(label, "dynamic"),
                "budget": budgets.get(label),
                **r,
            }
        )
    return out


def _run_retrieval(ctx: CellContext, cell: Cell) -> list[dict]:
    from .cache_spec import make_factory, resolve_config
    from .retrieval import run_retrieval

    s, p = ctx.spec, cell.params
    n = p["context_len"]
    factory = make_factory(ctx.model, (p["cache"], p["config"]), context_len=n, total_len=n + 64)
    rows = run_retrieval(
        ctx.model,
        ctx.tokenizer,
        factory,
        kinds=[p["kind"]],
        context_lens=[n],
        positions=[p["position"]],
        samples=p["samples"],
        seed=s.seed,
        prefill_chunk=s.prefill_chunk,
        chat=p["chat"],
        n_records=p.get("records"),
    )
    resolved = resolve_config(p["cache"], p["config"], n)
    k = len(rows)
    return [
        {
            "metric": "retrieval",
            "context_len": n,
            "label": p["label"],
            "cache": p["cache"],
            "budget": p["budget"],
            "budget_tokens": _budget_tokens(resolved, p),
            "config": resolved,
            "kind": p["kind"],
            "position": rows[0]["position"],
            "samples": k,
            "exact_match": sum(r["exact"] for r in rows) / k,
            "parse_rate": sum(r["parsed"] for r in rows) / k,
            "value_match": sum(r["value_match"] for r in rows) / k,
            "outputs": [{"answer": r["answer"], "output": r["output"]} for r in rows],
        }
    ]


RUNNERS: dict[str, Callable] = {
    "quality": _run_quality,
    "ppl": _run_ppl,
    "speed": _run_speed,
    "retrieval": _run_retrieval,
}
