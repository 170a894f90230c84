"""Every cache on an accelerator's terms: memory, prefill and decode throughput eager and under `torch.compile`,
host-device syncs and aten ops per decode step, side by side with transformers' DynamicCache and StaticCache.

Written for a GPU (bfloat16, `torch.compile`, CUDA graphs) and runnable as-is on the CPU with small defaults (that is
how it is tested and how `eval/results/gpu_bench_cpu/` was made; no GPU was available to the project).

GPU command lines (nothing here was run on a GPU yet):

    # every registered cache + DynamicCache + StaticCache, SmolLM2 offline, bfloat16, inductor
    .venv/bin/python eval/bench_gpu.py --device cuda --prompt-tokens 2048 --new-tokens 256 --batch 8 \\
        --out eval/results/gpu_bench_cuda
    # CUDA graphs: inductor's "skipping cudagraphs due to ..." is counted and quoted per cache (cudagraph_skips)
    .venv/bin/python eval/bench_gpu.py --device cuda --compile-mode reduce-overhead --out eval/results/gpu_bench_cuda \
        --name reduce_overhead
    # any Hub model (downloads it), chosen caches and budgets, eager only
    .venv/bin/python eval/bench_gpu.py --device cuda --model meta-llama/Llama-3.1-8B --modes eager \\
        --cache sink:sinks=4,budget=0.25 --cache h2o:budget=0.25 --cache fp8 --prompt-tokens 8192 --batch 4
    # the composite attending from its FP8 codes (what "auto" does on CUDA) against its dequantize path and H2O
    .venv/bin/python eval/bench_gpu.py --device cuda --modes eager --prompt-tokens 8192 --batch 4 \
        --cache composite:preset=sinks_heavy_recent,budget=0.25,attention=blockwise \
        --cache composite:preset=sinks_heavy_recent,budget=0.25,attention=dequantize --cache h2o:budget=0.25
    # issue 28's table on the GPU: decode ms/token vs DynamicCache per context length (bfloat16), and the Triton
    # kernel alone in bytes/s against a plain read of the same bytes (HBM)
    .venv/bin/python eval/bench_gpu.py --device cuda --decode-bandwidth 4096 16384 32768 --out eval/results \
        --name h200
CPU (the committed results in eval/results/gpu_bench_cpu/; a few minutes each):

    # every cache eager and compiled with inductor, on the random 2-layer Llama (inductor needs 10-90 s per cache
    # on 2 shared cores; SmolLM2's 30 layers took 219 s for DynamicCache's 3 graphs, hence the tiny model)
    .venv/bin/python eval/bench_gpu.py --tiny --out eval/results/gpu_bench_cpu --name tiny_inductor
    # SmolLM2-135M, eager only: memory, host syncs and aten ops per step of the real model, eager throughput
    .venv/bin/python eval/bench_gpu.py --modes eager --out eval/results/gpu_bench_cpu --name smollm2_eager
    # SmolLM2-135M compiled, the fixed-capacity caches vs compiled StaticCache (fp8 and kivi need `max_length`)
    .venv/bin/python eval/bench_gpu.py --modes compiled --prompt-tokens 512 --new-tokens 32 --rounds 3 \
        --cache sink:budget=256 --cache sliding:window=256 --cache fp8:max_length=640 \
        --cache fp8:max_length=640,granularity=head --cache kivi:max_length=640,group_size=32,residual=32 \
        --out eval/results/gpu_bench_cpu --name smollm2_compiled

What is measured, per cache (default: every name in `hf_kvcache.CACHE_IMPLEMENTATIONS` with a default config, or
`--cache NAME:key=value,...` as the other eval scripts parse it) and per mode (`eager`, `compiled`):
- throughput: each repetition takes a fresh cache, prefills `--batch` x `--prompt-tokens` tokens (one forward,
  `logits_to_keep=1`), then feeds `--new-tokens` tokens one forward each (teacher-forced from the prompt source, so
  every cache does the same work). Prefill and decode tokens/s count every row of the batch. All (cache, mode)
  pairs run once per round in a rotated order (interleaved), `--rounds` rounds after a warm-up; figures are medians
  over rounds and ratios are medians of per-round ratios: eager rows against DynamicCache eager, compiled rows
  against StaticCache compiled (`ref` column; > 1 is faster). `compiled_vs_eager_decode` is the same cache's eager
  decode time over its compiled decode time (> 1: compile helps). `torch.cuda.synchronize()` brackets every timed
  region on CUDA only.
- compile: `torch.compile(forward, fullgraph=True, mode=--compile-mode, backend=--compile-backend)`, where
  `forward(**kw)` calls `model.forward(**kw)` with the cache passed in as `**cache_kwargs(cache)` (`cache`, or
  `past_key_values` before transformers 5.24). Prefill and decode get one such wrapper each, and every cache its
  own pair (distinct code objects), so dynamo's code cache, recompile limit and automatic-dynamic decisions are per
  cache and phase and the caches cannot influence each other.
  Warm-up: a prefill and `--compile-warmup` decode steps. Status per phase (`prefill_compile`, `decode_compile`;
  `status` is the decode one if it failed, else the prefill one): `ok`; `graph_break` (fullgraph refused, or a guard
  on a tensor's value: the reason and the user-code line; after the timed rounds `torch._dynamo.explain` counts the
  graph breaks without fullgraph, `graph_breaks`); `recompiles` (a new graph at each of the last 3 warm-up decode
  steps, dynamo's recompile limit hit, or any graph compiled during the timed rounds: counted with
  `torch._dynamo.utils.counters`; the reason is the guard that rejected the newest graph, from
  `torch._dynamo.utils.guard_failures`); `error` (anything else, message kept). A phase that fails runs eagerly
  from then on and gets no compiled figures (as transformers' `generate` compiles only the decode step, a cache whose
  prefill does not compile still gets compiled decode figures); `compiled_phases` says which phases were timed
  compiled.
- memory: `cache_bytes` is what the cache holds after the run (`cache.nbytes()` for ours; for transformers' caches
  the bytes of their layers' key/value tensors), source in `cache_bytes_source`. On CUDA `cuda_peak_bytes` is
  `torch.cuda.max_memory_allocated()` of one run (peak stats reset before it; max over rounds) and
  `cuda_peak_over_start_bytes` the same minus what was allocated before the run (weights and inputs). On CPU
  `rss_growth_bytes` is the process RSS after the first eager run with the cache still alive minus before it
  (psutil; else the growth of `resource.getrusage` max RSS), source in `rss_source`: allocator reuse makes it
  noisy, a rough figure next to `cache_bytes`.
- host syncs and aten ops (eager, on CPU and GPU alike): `hf_kvcache.evaluation.host_syncs.HostSyncCounter` around
  the prefill forward and `--sync-steps` decode steps; `syncs_per_decode_step` (mean; `sync_ops` says which
  operations), `aten_ops_per_step_per_layer` (every aten op of the whole forward / layers, a proxy for launch
  overhead) and its ratio and difference to DynamicCache. Not counted under compile (a dispatch mode would change
  what dynamo traces).
Output: a table on stdout; `--out DIR` writes `NAME.csv` and `NAME.json` (`--name`, default `gpu_bench`; one row
per cache and mode; the JSON also has the run's settings, environment and, for a CPU run, `"cpu_run": true`).
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import logging
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import itertools  # noqa: E402  (after the path set-up above, like the imports below it)

from stream_ppl import environment  # noqa: E402

import hf_kvcache  # noqa: E402  (registers the cache names)
from hf_kvcache import cache_kwargs  # noqa: E402
from hf_kvcache.cli.eval_commands import parse_cache  # noqa: E402
from hf_kvcache.evaluation.cache_spec import check_cache, make_cache  # noqa: E402
from hf_kvcache.evaluation.host_syncs import HostSyncCounter  # noqa: E402
from hf_kvcache.evaluation.memory import cache_nbytes, format_rows  # noqa: E402

#: default config per registered cache name (budgets as fractions of the prompt); a name registered later without an
#: entry here runs with its own defaults
DEFAULT_CONFIGS: dict[str, dict] = {
    "sink": {"sinks": 4, "budget": 0.5},
    "sliding": {"window": 0.5},
    "h2o": {"budget": 0.5},
    "composite": {"preset": "sinks_heavy_recent", "budget": 0.5},
    "random_eviction": {"budget": 0.5},
    "fp8": {},
    "kivi": {"bits": 4, "group_size": 32, "residual": 32},
}
REFERENCES = ("dynamic", "static")
MODES = ("eager", "compiled")
#: a cache that compiled a new graph at each of this many consecutive warm-up decode steps recompiles every step
RECOMPILE_STREAK = 3

COLUMNS = [
    "cache",
    "name",
    "config",
    "mode",
    "status",
    "reason",
    "ref",
    "prefill_tok_s",
    "prefill_vs_ref",
    "decode_tok_s",
    "decode_vs_ref",
    "compiled_vs_eager_decode",
    "prefill_s",
    "decode_ms_per_step",
    "cache_bytes",
    "cache_bytes_source",
    "rss_growth_bytes",
    "rss_source",
    "cuda_peak_bytes",
    "cuda_peak_over_start_bytes",
    "syncs_prefill",
    "syncs_per_decode_step",
    "sync_ops",
    "aten_ops_per_decode_step",
    "aten_ops_per_step_per_layer",
    "aten_ops_vs_dynamic",
    "extra_aten_ops_per_layer_vs_dynamic",
    "compiled_phases",
    "prefill_compile",
    "decode_compile",
    "graphs",
    "recompiles_timed",
    "graph_breaks",
    "cudagraph_skips",
    "compile_warmup_s",
    "device",
    "dtype",
    "batch",
    "prompt_tokens",
    "new_tokens",
    "rounds",
]


# ---------------------------------------------------------------------------------------------------------------------
# model and inputs
# ---------------------------------------------------------------------------------------------------------------------
def tiny_llama(dtype: torch.dtype, device: str, seed: int = 0):
    """A random 2-layer Llama (head_dim 32, GQA 4:2), seeded: what the test runs on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def load(args, dtype: torch.dtype):
    """(model, token ids [batch, total] on the device)."""
    total = args.prompt_tokens + max(args.new_tokens, args.compile_warmup)
    if args.tiny or args.config:
        if args.tiny:
            model = tiny_llama(dtype, args.device)
        else:  # a published shape with random weights (eval/gpu/random_models.py): speed needs no trained weights
            from gpu.random_models import random_model

            model = random_model(args.config, dtype, args.device, layers=args.layers, max_position_embeddings=total)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(2, model.config.vocab_size, (args.batch, total), generator=g)
        return model, ids.to(args.device)
    from hf_kvcache.sharing.corpus import load_tokens
    from hf_kvcache.sharing.models import load_model

    model, tokenizer = load_model(args.model, dtype=dtype, device=args.device)
    corpus = load_tokens(tokenizer, args.text, max_tokens=args.batch * total)
    ids = corpus[0, : args.batch * total].reshape(args.batch, total)  # different text in every row
    return model, ids.to(args.device)


def resolve_specs(args) -> list[tuple[str, str, dict]]:
    """[(label, name, config)]: the references first, then --cache (or every registered cache with its default)."""
    texts = args.cache or [
        name
        + (":" + ",".join(f"{k}={v}" for k, v in DEFAULT_CONFIGS[name].items()) if DEFAULT_CONFIGS.get(name) else "")
        for name in hf_kvcache.CACHE_IMPLEMENTATIONS
    ]
    specs = [(name, name, {}) for name in args.references]
    for text in texts:
        label, name, config = parse_cache(text)
        if name in args.references and not config:
            continue  # always there
        check_cache(name, config, context_len=args.prompt_tokens, where=f"--cache {text}")
        if any(label == s[0] for s in specs):
            raise SystemExit(f"--cache {text!r} given twice")
        specs.append((label, name, config))
    return specs


# ---------------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------------
class Runner:
    """One cache spec: builds fresh caches and runs prefill + decode through eager or compiled forwards (compiled:
    `prefill_fn` and `decode_fn`, each its own compiled wrapper; a phase that did not compile runs eagerly)."""

    def __init__(self, model, ids, spec, args):
        self.model, self.ids, self.args = model, ids, args
        self.label, self.name, self.config = spec
        self.total = ids.shape[1]
        self.cuda = args.device.startswith("cuda")
        self.prefill_fn = self.decode_fn = None
        self.last_cache = None
        self.bytes_source = None

    def new_cache(self):
        cache = make_cache(
            self.model, self.name, self.config, context_len=self.args.prompt_tokens, total_len=self.total
        )
        self.bytes_source = (
            "cache.nbytes()" if callable(getattr(cache, "nbytes", None)) else "key/value tensors of the layers"
        )
        return cache

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def call(self, fn, cache, tokens, **kw):
        if fn is not self.model.forward and self.args.compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        return fn(input_ids=tokens, **cache_kwargs(cache), use_cache=True, **kw)

    @torch.inference_mode()
    def run(self, mode: str, steps: int, after_step=None) -> dict:
        """A fresh cache, prefill, `steps` decode steps. Returns seconds, memory; keeps the cache in `last_cache`.
        In compiled mode an exception is re-raised as `PhaseError` naming the phase."""
        eager = self.model.forward
        prefill_fn = eager if mode == "eager" else (self.prefill_fn or eager)
        decode_fn = eager if mode == "eager" else (self.decode_fn or eager)
        p = self.args.prompt_tokens
        cache = self.new_cache()
        out = {}
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start_alloc = torch.cuda.memory_allocated()
        self.sync()
        t0 = time.perf_counter()
        try:
            self.call(prefill_fn, cache, self.ids[:, :p], logits_to_keep=1)
        except Exception as err:
            raise (PhaseError("prefill", err) if prefill_fn is not eager else err) from err
        self.sync()
        t1 = time.perf_counter()
        try:
            for i in range(steps):
                self.call(decode_fn, cache, self.ids[:, p + i : p + i + 1])
                if after_step is not None:
                    after_step(i)
        except Exception as err:
            raise (PhaseError("decode", err) if decode_fn is not eager else err) from err
        self.sync()
        t2 = time.perf_counter()
        out["prefill_s"], out["decode_s"] = t1 - t0, t2 - t1
        if self.cuda:
            out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
            out["cuda_peak_over_start_bytes"] = out["cuda_peak_bytes"] - start_alloc
        out["cache_bytes"] = cache_nbytes(cache)
        self.last_cache = cache
        return out


class PhaseError(Exception):
    def __init__(self, phase: str, err: BaseException):
        super().__init__(f"{phase}: {err}")
        self.phase, self.err = phase, err


class _RecompilesEveryStep(Exception):
    def __init__(self, steps: int):
        super().__init__(steps)
        self.steps = steps


def make_forward(model, label: str):
    """`forward(**kw) -> model.forward(**kw)` with a code object of its own (dynamo caches compiled graphs, guards and
    recompile counts per code object: one per cache and phase keeps them independent)."""

    def forward(**kwargs):
        return model.forward(**kwargs)

    safe = "".join(c if c.isalnum() else "_" for c in label)
    code = forward.__code__.replace(co_name=f"forward_{safe}")
    return types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _user_line(message: str) -> str:
    """The last `File ..., line N` of dynamo's "from user code" trace, preferring our package's frames."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip().startswith("File ")]
    ours = [ln for ln in lines if "hf_kvcache" in ln]
    pick = (ours or lines or [""])[-1]
    return pick.replace(str(ROOT) + "/", "")


def _guard_reason(*codes) -> str | None:
    """Why the newest compiled graph was rejected at the last recompile: dynamo records, per recompile, one
    "frame/entry: guard" line for each existing graph; the highest entry index is the most recent graph."""
    import re

    from torch._dynamo.utils import guard_failures

    best, best_key = None, None
    for c in codes:
        for pos, r in enumerate(guard_failures.get(c) or []):
            m = re.match(r"(\d+)/(\d+): ", r)
            text = r[m.end() :] if m else r
            if text.startswith("len(kwargs)"):  # prefill vs decode keywords: says nothing
                continue
            key = (int(m.group(2)) if m else -1, pos)
            if best_key is None or key >= best_key:
                best, best_key = text, key
    if best is None:
        return None
    return _short(best.split("\n")[0].replace(str(ROOT) + "/", ""), 400)


def _classify(err: BaseException, graphs: int, codes) -> tuple[str, str]:
    """(status, reason) of a compile failure."""
    import torch._dynamo

    if isinstance(err, _RecompilesEveryStep):
        return "recompiles", (
            f"a new graph at each of the last {RECOMPILE_STREAK} warm-up decode steps ({graphs} "
            f"graphs after {err.steps} steps); last guard failure: {_guard_reason(*codes)}"
        )
    if isinstance(err, torch._dynamo.exc.FailOnRecompileLimitHit):
        return "recompiles", (
            f"dynamo recompile limit hit ({graphs} graphs); last guard failure: {_guard_reason(*codes)}"
        )
    text = str(err)
    first = _short(text.splitlines()[0] if text else "", 220)
    if isinstance(err, torch._dynamo.exc.Unsupported):
        return "graph_break", f"{first} at {_user_line(text)}"
    if "data-dependent" in text:  # a guard on a tensor's value (`if float(t) < 0`): a graph break without fullgraph
        caused = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("Caused by:")]
        where = _short(caused[0], 200) if caused else f"at {_user_line(text)}"
        return "graph_break", f"{type(err).__name__}: {_short(first, 160)} {where}".replace(str(ROOT) + "/", "")
    reason = f"{type(err).__name__}: {first}"
    if "from user code" in text:
        reason += f" at {_user_line(text)}"
    return "error", reason


class CudagraphSkips(logging.Handler):
    """Context manager collecting inductor's "skipping cudagraphs due to ..." warnings (reduce-overhead mode). Inductor
    logs them for CUDA graphs only; for other devices it just bumps `counters["inductor"]["cudagraph_skips"]`."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []
        self.logger = torch._logging.getArtifactLogger("torch._inductor.cudagraph_utils", "cudagraphs")

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self) -> CudagraphSkips:
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)


def compile_cache(runner: Runner, args) -> dict:
    """Compile the prefill and decode forwards of a cache, warm up, classify each phase. A phase that fails is
    reported and runs eagerly (transformers' `generate` compiles the decode step only: a cache whose prefill does
    not compile still gets compiled decode timings)."""
    mode = None if args.compile_mode == "default" else args.compile_mode
    fwd = {ph: make_forward(runner.model, f"{runner.label}_{ph}") for ph in ("prefill", "decode")}
    runner.prefill_fn = torch.compile(fwd["prefill"], fullgraph=True, backend=args.compile_backend, mode=mode)
    runner.decode_fn = torch.compile(fwd["decode"], fullgraph=True, backend=args.compile_backend, mode=mode)
    codes = [f.__code__ for f in fwd.values()]
    phases = {"prefill": ("ok", None), "decode": ("ok", None)}
    g0, s0 = _graphs(), _cudagraph_skips()
    t0 = time.perf_counter()

    per_step: list[int] = []

    def after_step(i):
        per_step.append(_graphs())
        recent = per_step[-RECOMPILE_STREAK - 1 :]
        if len(recent) > RECOMPILE_STREAK and all(b > a for a, b in itertools.pairwise(recent)):
            raise _RecompilesEveryStep(len(per_step))

    while runner.prefill_fn is not None or runner.decode_fn is not None:
        per_step.clear()
        try:
            runner.run("compiled", args.compile_warmup, after_step=after_step)
            break
        except PhaseError as failure:
            phases[failure.phase] = _classify(failure.err, _graphs() - g0, codes)
            setattr(runner, f"{failure.phase}_fn", None)  # that phase runs eagerly from now on; try the other
    status = {"prefill": phases["prefill"][0], "decode": phases["decode"][0]}
    overall = (
        "ok" if set(status.values()) == {"ok"} else next(s for ph in ("decode", "prefill") if (s := status[ph]) != "ok")
    )
    reason = "; ".join(f"{ph}: {r}" for ph, (s, r) in phases.items() if s != "ok") or None
    compiled = [ph for ph in ("prefill", "decode") if getattr(runner, f"{ph}_fn") is not None]
    return {
        "status": overall,
        "reason": reason,
        "phases": status,
        "compiled_phases": "+".join(compiled) or "none",
        "graph_breaks": None,
        "compile_warmup_s": time.perf_counter() - t0,
        "graphs": _graphs() - g0,
        "cudagraph_skips": _cudagraph_skips() - s0,
        "codes": codes,
    }


def explain_breaks(runner: Runner, args) -> dict | None:
    """Graph breaks `torch._dynamo.explain` finds (no fullgraph) in a prefill and one decode step of a fresh cache.
    It resets dynamo, so it runs after every compiled timing."""
    import torch._dynamo

    try:
        fwd = make_forward(runner.model, "explain_" + runner.label)
        cache = runner.new_cache()
        p = args.prompt_tokens
        found = {}
        with torch.inference_mode():
            for phase, tokens in (("prefill", runner.ids[:, :p]), ("decode", runner.ids[:, p : p + 1])):
                out = torch._dynamo.explain(fwd)(input_ids=tokens, **cache_kwargs(cache), use_cache=True)
                reasons = []
                for r in out.break_reasons:
                    where = r.user_stack[-1] if r.user_stack else None
                    loc = f" at {Path(where.filename).name}:{where.lineno}" if where is not None else ""
                    reasons.append(_short(r.reason.splitlines()[0], 160) + loc)
                found[phase] = {"count": out.graph_break_count, "reasons": sorted(set(reasons))[:5]}
        return found
    except Exception as err:
        return {"error": f"explain failed: {type(err).__name__}: {_short(str(err), 160)}"}


# ---------------------------------------------------------------------------------------------------------------------
# memory and syncs
# ---------------------------------------------------------------------------------------------------------------------
def rss_probe():
    """(name, function returning bytes): psutil RSS, else getrusage's max RSS."""
    try:
        import psutil

        proc = psutil.Process()
        return "psutil RSS after - before", lambda: proc.memory_info().rss
    except ImportError:
        import resource

        return "getrusage max RSS growth", lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def count_syncs(runner: Runner, steps: int) -> dict:
    """Host syncs of the prefill forward and of `steps` decode steps (after one uncounted step), aten ops, under
    `torch.no_grad` (as `generate` runs)."""
    cache = runner.new_cache()
    p = runner.args.prompt_tokens
    layers = runner.model.config.get_text_config(decoder=True).num_hidden_layers
    # no_grad, not inference_mode: under inference_mode `.item()` / `bool(t)` dispatch as aten.item /
    # aten.is_nonzero without reaching aten._local_scalar_dense, and HostSyncCounter would not see them
    with torch.no_grad():
        with HostSyncCounter() as prefill:
            runner.model(input_ids=runner.ids[:, :p], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        runner.model(input_ids=runner.ids[:, p : p + 1], **cache_kwargs(cache), use_cache=True)
        with HostSyncCounter() as decode:
            for i in range(1, steps + 1):
                runner.model(input_ids=runner.ids[:, p + i : p + i + 1], **cache_kwargs(cache), use_cache=True)
    return {
        "syncs_prefill": prefill.syncs,
        "syncs_per_decode_step": decode.syncs / steps,
        "sync_ops": dict(decode.by_name),
        "aten_ops_per_decode_step": decode.ops / steps,
        "aten_ops_per_step_per_layer": decode.ops / steps / layers,
    }


# ---------------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="Hub id, local path, or smollm2 (offline, the default)")
    parser.add_argument("--tiny", action="store_true", help="a random 2-layer Llama instead of --model (tests)")
    parser.add_argument(
        "--config",
        default=None,
        help="instead of --model: random weights in a published shape "
        "(eval/gpu/random_models.py: smollm2-135m, llama-3.1-8b, qwen3-8b), random token ids",
    )
    parser.add_argument("--layers", type=int, default=None, help="with --config: keep the first N layers")
    parser.add_argument(
        "--references",
        default=",".join(REFERENCES),
        help="reference caches run beside the others (default dynamic,static; compiled rows need "
        "static, eager rows dynamic)",
    )
    parser.add_argument("--text", default="pydoc", help="prompt source for --model (hf_kvcache.sharing.corpus)")
    parser.add_argument(
        "--cache",
        action="append",
        metavar="NAME:key=value,...",
        help="a cache to measure (repeatable); default: every registered cache with a default config. "
        "DynamicCache and StaticCache always run as references",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float16", "float32"],
        help="default: bfloat16 on CUDA, float32 on CPU",
    )
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default: 1024 on CUDA, 128 on CPU")
    parser.add_argument("--new-tokens", type=int, default=None, help="decode steps; default: 128 on CUDA, 16 on CPU")
    parser.add_argument("--batch", type=int, default=None, help="default: 4 on CUDA, 1 on CPU")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds; default: 5 on CUDA, 3 on CPU")
    parser.add_argument("--modes", default="eager,compiled", help="comma-separated subset of eager,compiled")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend; 'eager' traces with dynamo only (graph breaks and recompiles "
        "are still found, fast: what the test uses)",
    )
    parser.add_argument(
        "--compile-mode",
        default="default",
        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        help="torch.compile mode; reduce-overhead = CUDA graphs (CUDA only)",
    )
    parser.add_argument("--compile-warmup", type=int, default=5, help="decode steps of the compile warm-up")
    parser.add_argument("--sync-steps", type=int, default=4, help="decode steps counted for host syncs (0: skip)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on CPU)")
    parser.add_argument("--out", type=Path, default=None, help="write NAME.csv and NAME.json here")
    parser.add_argument("--name", default="gpu_bench", help="output file stem (default gpu_bench)")
    parser.add_argument(
        "--decode-bandwidth",
        type=int,
        nargs="+",
        metavar="TOKENS",
        default=None,
        help="instead of the table above: issue 28's decode-against-what-it-reads table at these "
        "context lengths (eval/bench_decode_bandwidth.py on --device in --dtype: ms/token vs "
        "DynamicCache, and the attention kernel's bytes/s against a plain read)",
    )
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available in this torch ({torch.__version__})")
    defaults = dict(
        prompt_tokens=(1024, 128), new_tokens=(128, 16), batch=(4, 1), rounds=(5, 3), dtype=("bfloat16", "float32")
    )
    for key, (on_cuda, on_cpu) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, on_cuda if cuda else on_cpu)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes: choose from {MODES}, got {args.modes}")
    for key in ("prompt_tokens", "new_tokens", "batch", "rounds", "compile_warmup"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.sync_steps < 0:
        parser.error("--sync-steps must be >= 0 (0: no host-sync count)")
    args.references = tuple(r.strip() for r in args.references.split(",") if r.strip())
    needed = {"eager": "dynamic", "compiled": "static"}
    if set(args.references) - set(REFERENCES) or any(needed[m] not in args.references for m in args.modes):
        parser.error(
            f"--references: a subset of {REFERENCES} holding the reference of each mode in --modes "
            f"({', '.join(f'{m}: {needed[m]}' for m in args.modes)}), got {args.references}"
        )
    if args.config is not None:
        from gpu.random_models import PUBLISHED

        if args.tiny or args.config not in PUBLISHED:
            parser.error(f"--config: one of {sorted(PUBLISHED)}, and not with --tiny; got {args.config!r}")
    elif args.layers is not None:
        parser.error("--layers needs --config (the published shape whose first N layers to keep)")
    if args.compile_warmup <= RECOMPILE_STREAK:
        parser.error(f"--compile-warmup must be > {RECOMPILE_STREAK} (to tell per-step recompiles apart)")
    return args


def decode_bandwidth(args) -> dict:
    """The decode-against-what-it-reads table (eval/bench_decode_bandwidth.py) on this device and dtype, written as
    OUT/NAME_decode_bandwidth.{json,csv,png}."""
    import bench_decode_bandwidth

    out = (args.out or ROOT / "eval" / "results") / f"{args.name}_decode_bandwidth"
    bench_decode_bandwidth.main(
        [
            "--device",
            args.device,
            "--dtype",
            args.dtype,
            "--model",
            args.model,
            "--rounds",
            str(args.rounds),
            "--threads",
            str(args.threads or 1),
            "--out",
            str(out),
            "--lengths",
            *map(str, args.decode_bandwidth),
        ]
    )
    return json.loads(out.with_suffix(".json").read_text())


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.decode_bandwidth:
        return decode_bandwidth(args)
    cuda = args.device.startswith("cuda")
    if args.threads or not cuda:
        torch.set_num_threads(args.threads or 1)
    import transformers

    transformers.logging.set_verbosity_error()
    dtype = getattr(torch, args.dtype)
    specs = resolve_specs(args)
    model, ids = load(args, dtype)
    runners = {label: Runner(model, ids, (label, name, config), args) for label, name, config in specs}
    labels = list(runners)
    rss_source, rss_now = rss_probe()
    t_start = time.perf_counter()

    # eager warm-up (also absorbs one-time allocations before RSS is read), then RSS and sync counts per cache
    runners["dynamic"].run("eager", min(2, args.new_tokens))
    gc.collect()
    memo: dict[str, dict] = {label: {} for label in labels}
    errors: dict[str, str] = {}
    for label in labels:
        r = runners[label]
        try:
            gc.collect()
            before = rss_now()
            r.run("eager", args.new_tokens)
            memo[label]["rss_growth_bytes"] = rss_now() - before
            if args.sync_steps:
                memo[label].update(count_syncs(r, args.sync_steps))
        except Exception as err:
            errors[label] = f"{type(err).__name__}: {_short(str(err), 250)}"
        r.last_cache = None
    print(f"eager warm-up, RSS and sync counts: {time.perf_counter() - t_start:.1f} s", flush=True)

    compile_info: dict[str, dict] = {}
    if "compiled" in args.modes:
        with CudagraphSkips() as capture:
            for label in labels:
                if label in errors:
                    continue
                n0 = len(capture.messages)
                t0 = time.perf_counter()
                compile_info[label] = compile_cache(runners[label], args)
                skipped = sorted(set(capture.messages[n0:]))
                if skipped:
                    compile_info[label]["cudagraph_reason"] = _short("; ".join(skipped), 300)
                elif compile_info[label]["cudagraph_skips"] and args.compile_mode == "reduce-overhead":
                    compile_info[label]["cudagraph_reason"] = (
                        f"{compile_info[label]['cudagraph_skips']} graph(s) without CUDA graphs (inductor gives no "
                        f"reason for non-CUDA devices)"
                    )
                print(
                    f"compile {label}: {compile_info[label]['status']} ({time.perf_counter() - t0:.1f} s, "
                    f"{compile_info[label]['graphs']} graphs)",
                    flush=True,
                )

    # interleaved rounds over every runnable (cache, mode)
    entries = [
        (label, mode)
        for mode in args.modes
        for label in labels
        if label not in errors
        and (mode == "eager" or compile_info.get(label, {}).get("compiled_phases", "none") != "none")
    ]
    samples = {e: [] for e in entries}
    graphs_timed = {label: 0 for label in labels}
    t0 = time.perf_counter()
    for rnd in range(args.rounds):
        order = entries[rnd % len(entries) :] + entries[: rnd % len(entries)]
        for label, mode in order:
            g0 = _graphs()
            samples[(label, mode)].append(runners[label].run(mode, args.new_tokens))
            runners[label].last_cache = None
            if mode == "compiled":
                graphs_timed[label] += _graphs() - g0
        print(f"round {rnd + 1}/{args.rounds} ({time.perf_counter() - t0:.0f} s)", flush=True)

    for label, ci in compile_info.items():
        if "graph_break" in ci["phases"].values():  # torch._dynamo.explain resets dynamo: only now
            ci["graph_breaks"] = explain_breaks(runners[label], args)

    rows = build_rows(args, specs, runners, samples, memo, errors, compile_info, graphs_timed, rss_source)
    info = {
        "what": "prefill / decode throughput eager and compiled, memory, host syncs and aten ops per decode step, "
        "every cache vs DynamicCache (eager) and StaticCache (compiled), interleaved in one run",
        "cpu_run": not cuda,
        "note": (
            "CPU run: throughput ratios and compiled speed-ups on a shared CPU say little about a GPU; the "
            "compile statuses, sync counts and op counts carry over"
            if not cuda
            else "CUDA run"
        ),
        "model": (
            "tiny random Llama (2 layers)"
            if args.tiny
            else f"random {args.config} ({model.config.num_hidden_layers} layers)"
            if args.config
            else args.model
        ),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "seconds": round(time.perf_counter() - t_start, 1),
        "environment": {**environment(), **gpu_environment(args)},
        "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "rows": rows,
    }
    print_table(rows, args)
    if args.out is not None:
        write(args.out, args.name, rows, info)
    return info


def gpu_environment(args) -> dict:
    env = {"device": args.device, "torch_threads": torch.get_num_threads()}
    if args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(args.device)
        env["cuda"] = torch.version.cuda
    return env


def _median(xs):
    return statistics.median(xs) if xs else None


def build_rows(args, specs, runners, samples, memo, errors, compile_info, graphs_timed, rss_source) -> list[dict]:
    b, p, n = args.batch, args.prompt_tokens, args.new_tokens
    refs = {"eager": "dynamic", "compiled": "static"}
    dyn = memo.get("dynamic", {})
    rows = []
    for label, name, config in specs:
        for mode in args.modes:
            s = samples.get((label, mode), [])
            ref = refs[mode]
            rs = samples.get((ref, mode), [])
            row = {c: None for c in COLUMNS}
            row.update(
                cache=label,
                name=name,
                config=json.dumps(config, sort_keys=True),
                mode=mode,
                ref=ref,
                device=args.device,
                dtype=args.dtype,
                batch=b,
                prompt_tokens=p,
                new_tokens=n,
                rounds=len(s),
                status="ok",
                cache_bytes_source=runners[label].bytes_source,
            )
            if label in errors:
                row.update(status="error", reason=f"eager run failed: {errors[label]}")
            elif mode == "compiled":
                ci = compile_info[label]
                row.update(
                    status=ci["status"],
                    reason=ci["reason"],
                    graphs=ci["graphs"],
                    compiled_phases=ci["compiled_phases"],
                    prefill_compile=ci["phases"]["prefill"],
                    decode_compile=ci["phases"]["decode"],
                    graph_breaks=json.dumps(ci["graph_breaks"]) if ci["graph_breaks"] else None,
                    cudagraph_skips=ci["cudagraph_skips"],
                    compile_warmup_s=round(ci["compile_warmup_s"], 2),
                )
                if ci.get("cudagraph_reason"):
                    row["reason"] = "; ".join(
                        x for x in (row["reason"], "CUDA graphs skipped: " + ci["cudagraph_reason"]) if x
                    )
                if s:
                    row["recompiles_timed"] = graphs_timed[label]
                    if graphs_timed[label]:
                        row["status"] = "recompiles"
                        row["reason"] = (
                            f"{graphs_timed[label]} graphs compiled during the timed rounds; last guard "
                            f"failure: {_guard_reason(*ci['codes'])}"
                        )
            if s:
                # compiled rows: only the phases that compiled (a phase that did not ran eagerly, not a compiled time)
                timed = (
                    {"prefill", "decode"} if mode == "eager" else set(compile_info[label]["compiled_phases"].split("+"))
                )
                ref_timed = (
                    {"prefill", "decode"}
                    if mode == "eager" or ref not in compile_info
                    else set(compile_info[ref]["compiled_phases"].split("+"))
                )
                row["cache_bytes"] = s[-1]["cache_bytes"]
                if "prefill" in timed:
                    prefill = _median([x["prefill_s"] for x in s])
                    row.update(prefill_s=round(prefill, 5), prefill_tok_s=round(b * p / prefill, 1))
                    if rs and len(rs) == len(s) and "prefill" in ref_timed:
                        row["prefill_vs_ref"] = round(
                            _median([r["prefill_s"] / x["prefill_s"] for x, r in zip(s, rs)]), 3
                        )
                if "decode" in timed:
                    decode = _median([x["decode_s"] for x in s])
                    row.update(decode_ms_per_step=round(1000 * decode / n, 3), decode_tok_s=round(b * n / decode, 1))
                    if rs and len(rs) == len(s) and "decode" in ref_timed:
                        row["decode_vs_ref"] = round(_median([r["decode_s"] / x["decode_s"] for x, r in zip(s, rs)]), 3)
                if "cuda_peak_bytes" in s[0]:
                    row["cuda_peak_bytes"] = max(x["cuda_peak_bytes"] for x in s)
                    row["cuda_peak_over_start_bytes"] = max(x["cuda_peak_over_start_bytes"] for x in s)
                eager = samples.get((label, "eager"), [])
                if mode == "compiled" and "decode" in timed and len(eager) == len(s):
                    row["compiled_vs_eager_decode"] = round(
                        _median([e["decode_s"] / x["decode_s"] for x, e in zip(s, eager)]), 3
                    )
            if mode == "eager" and label not in errors:
                m = memo[label]
                row.update(
                    rss_growth_bytes=m.get("rss_growth_bytes"),
                    rss_source=rss_source,
                    syncs_prefill=m.get("syncs_prefill"),
                    syncs_per_decode_step=m.get("syncs_per_decode_step"),
                    sync_ops=json.dumps(m.get("sync_ops", {}), sort_keys=True),
                    aten_ops_per_decode_step=m.get("aten_ops_per_decode_step"),
                    aten_ops_per_step_per_layer=(
                        round(m["aten_ops_per_step_per_layer"], 2) if "aten_ops_per_step_per_layer" in m else None
                    ),
                )
                if dyn.get("aten_ops_per_decode_step"):
                    row["aten_ops_vs_dynamic"] = round(
                        m["aten_ops_per_decode_step"] / dyn["aten_ops_per_decode_step"], 3
                    )
                    row["extra_aten_ops_per_layer_vs_dynamic"] = round(
                        m["aten_ops_per_step_per_layer"] - dyn["aten_ops_per_step_per_layer"], 2
                    )
            rows.append(row)
    return rows


def print_table(rows: list[dict], args) -> None:
    print(
        f"\n{args.rounds} interleaved rounds, medians; batch {args.batch}, prompt {args.prompt_tokens}, "
        f"{args.new_tokens} decode steps, {args.dtype} on {args.device}; ratios: > 1 is faster than ref\n"
    )
    cols = [
        ("cache", "cache"),
        ("mode", "mode"),
        ("status", "status"),
        ("prefill_tok_s", "prefill tok/s"),
        ("prefill_vs_ref", "x ref"),
        ("decode_tok_s", "decode tok/s"),
        ("decode_vs_ref", "x ref"),
        ("ref", "ref"),
        ("compiled_vs_eager_decode", "compiled/eager"),
        ("compiled_phases", "compiled"),
        ("cache_bytes", "cache_bytes"),
        ("cuda_peak_over_start_bytes", "cuda peak-start bytes")
        if args.device.startswith("cuda")
        else ("rss_growth_bytes", "rss_growth_bytes"),
        ("syncs_per_decode_step", "syncs/step"),
        ("aten_ops_per_step_per_layer", "ops/step/layer"),
        ("aten_ops_vs_dynamic", "ops x dyn"),
    ]

    def cell(key, v):
        if v is None:
            return ""
        if key.endswith("tok_s"):
            return f"{v:.0f}" if v >= 100 else f"{v:.1f}"
        return v

    shown = [{k: cell(k, v) for k, v in r.items()} for r in rows]
    print(format_rows(shown, cols))
    notes = [r for r in rows if r["reason"]]
    if notes:
        print()
        for r in notes:
            print(f"- {r['cache']} [{r['mode']}] {r['status']}: {r['reason']}")


def write(out: Path, name: str, rows: list[dict], info: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (out / f"{name}.json").write_text(json.dumps(info, indent=1, default=str) + "\n")
    print(f"\nwrote {out / (name + '.csv')} and {out / (name + '.json')}")


if __name__ == "__main__":
    main()
