"""Support matrix: every architecture of tests/model_zoo.py x every cache name in hf_kvcache.CACHE_IMPLEMENTATIONS.

Each (architecture, cache) cell runs five checks, one test each:
- `equal` (float32): at a budget that keeps every token, greedy `generate` (batch 2, left padding, 12-token prompt,
  6 new tokens) gives DynamicCache's tokens with step logits within `LOGIT_ATOL`. Quantized keep-all caches (fp8,
  kivi) cannot be identical; for them, along DynamicCache's greedy continuation fed back token by token
  (teacher forcing), the next-token distributions must stay within `KL_MEAN_MAX` (mean KL(dynamic || cache) over
  the 12 predicted positions) and `KL_MAX` (at each position). Top-1 agreement is reported, not required: these
  random models have near ties (top-2 probability margins down to 3e-4), so it flips under 4-bit noise.
- `budget` (float32): at budget 8 with a 16-token prompt (eviction happens), generation runs with finite logits and
  `cache.nbytes()` is the same after 4 and after 12 new tokens, at least the budget's tokens' keys and values at the
  stored precision and at most `BOUND_FACTOR` times their full-precision bytes; layers that keep transformers' own
  sliding-window layer add their bytes (as DynamicCache holds them) to both bounds. Prompt-only caches (kvzip)
  hold the budget plus the appended tokens: at least the budget's bytes (as above), at most `BOUND_FACTOR` times the
  full-precision bytes of budget + new tokens, never less after 12 new tokens than after 4. Keep-all quantized caches
  instead must grow with the stream and stay below `QUANTIZED_MAX_RATIO` of the full-precision bytes of the same
  tokens (full-attention layers; plus the sliding layers' bytes).
- `evict` (float32; caches with deterministic eviction: sink, sliding, composite sinks + window): one decode step
  after a 14-token prompt that overflowed 2 sinks + a 6-token window equals a reference rebuilt from DynamicCache
  (see `evict_reference`), within `EVICT_ATOL`: checks which tokens are kept and the sinks' re-positioning
  ("positions inside the cache"), which the other checks cannot see. Other caches: not applicable (skipped).
- `bfloat16`, `float16`: smoke run at the small budget on CPU: runs, finite logits. Skipped (reason recorded) when
  the architecture itself (DynamicCache, same prompt) does not run or gives non-finite logits in that dtype.

A check is "refused" when the cache raises ValueError/NotImplementedError while being built or, from hf_kvcache
code, during the first forward (before any token is generated); the reason is the message's first line. Anything
else (another exception, a failed check) is BROKEN and fails the test unless listed in KNOWN_FAILURES with its
diagnosis (then xfail).

docs/support_matrix.md is generated from these results: the last test renders it and compares (only when the whole
matrix ran in this session; it skips with the reason otherwise). `HF_KVCACHE_WRITE_MATRIX=1` rewrites the file
instead (`scripts/support_matrix.py`). Independently of that comparison, every cell check that the committed table
lists as supported must still pass, so `-k` selections also catch regressions.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import model_zoo
import pytest
import torch
import transformers
from conftest import planted_surrogate, skip_unless_locked_versions
from transformers import DynamicCache

import hf_kvcache
from hf_kvcache import cache_kwargs
from hf_kvcache.caches.scorers import ScorerCache

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "support_matrix.md"
WRITE = os.environ.get("HF_KVCACHE_WRITE_MATRIX") == "1"
LIBRARY_DIR = str(Path(hf_kvcache.__file__).resolve().parent)

ARCHS = list(model_zoo.ZOO)
CACHES = list(hf_kvcache.CACHE_IMPLEMENTATIONS)
CHECKS = ("equal", "budget", "evict", "bfloat16", "float16")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

EQUAL_ROWS, EQUAL_NEW = (12, 9), 6  # prompt lengths of the two rows (left padded), new tokens
BUDGET_ROWS, BUDGET = (16, 11), 8
SHORT_NEW, LONG_NEW = 4, 12

LOGIT_ATOL = 1e-3  # exact caches: step logits vs DynamicCache (float32)
KL_MEAN_MAX = 0.05  # quantized caches: mean KL(dynamic || cache) over the teacher-forced positions
KL_MAX = 0.5  # quantized caches: KL at any one of them (a wrong mask or position gives ~1-4 on these models)
BOUND_FACTOR = 2.0  # evicting caches: nbytes <= BOUND_FACTOR x full-precision bytes of BUDGET tokens
QUANTIZED_MAX_RATIO = 0.75  # keep-all quantized caches: nbytes <= this x full-precision bytes of the same tokens
EVICT_SINKS, EVICT_WINDOW, EVICT_PROMPT = 2, 6, 14  # `evict` check: 6 prompt tokens evicted before the decode step
EVICT_ATOL = 1e-4


@dataclass(frozen=True)
class Spec:
    full: dict  # a budget that keeps every token of the `equal` check (12 + 6 tokens)
    small: dict  # BUDGET tokens (keep-all caches: their own config)
    criterion: str  # "exact" or "kl"
    memory: str  # "bounded" (evicting), "prompt" (the prompt compressed, then appended) or "grows" (keep-all)
    min_bytes_per_value: float  # stored precision of the smallest region at the small budget (bytes per value)
    label: str  # short description of the two configs for the legend
    evict: tuple[dict, int] | None = None  # `evict` check: (config, sinks it keeps), for caches whose eviction
    # is deterministic (sinks + window); None: not applicable (score- or seed-driven eviction, keep-all)


KVZIP_REQUEST = {"first": [5, 6, 7], "next": [8, 9], "suffix": [10]}
PLANTED = "planted surrogate"  # replaced by `planted_surrogate(model)` when the cache is built
_SINKS_WINDOW = [{"role": "sinks", "tokens": 4}, {"role": "window", "start": 0, "end": 32}]
SPECS: dict[str, Spec] = {
    "sink": Spec(
        {"sinks": 4, "window": 60},
        {"sinks": 2, "window": 6},
        "exact",
        "bounded",
        4,
        "sinks 4 + window 60 / 2 + 6",
        ({"sinks": EVICT_SINKS, "window": EVICT_WINDOW}, EVICT_SINKS),
    ),
    "sliding": Spec(
        {"window": 64}, {"window": 8}, "exact", "bounded", 4, "window 64 / 8", ({"window": EVICT_WINDOW}, 0)
    ),
    "h2o": Spec(
        {"heavy": 32, "recent": 32}, {"heavy": 4, "recent": 4}, "exact", "bounded", 4, "heavy 32 + recent 32 / 4 + 4"
    ),
    "random_eviction": Spec(
        {"heavy": 32, "recent": 32}, {"heavy": 4, "recent": 4}, "exact", "bounded", 4, "heavy 32 + recent 32 / 4 + 4"
    ),
    "composite": Spec(
        {"regions": _SINKS_WINDOW + [{"role": "heavy", "tokens": 32}]},
        {"preset": "sinks_heavy_recent", "budget": BUDGET},
        "exact",
        "bounded",
        1,
        "full-precision sinks 4 + window 32 + heavy 32 / preset sinks_heavy_recent, budget 8 "
        "(4 full-precision sinks, recent and heavy in FP8)",
        (
            {
                "regions": [
                    {"role": "sinks", "tokens": EVICT_SINKS},
                    {"role": "window", "start": 0, "end": EVICT_WINDOW},
                ]
            },
            EVICT_SINKS,
        ),
    ),
    "fp8": Spec({}, {}, "kl", "grows", 1, "defaults (E4M3 per token, Hadamard keys)"),
    "kivi": Spec(
        {"bits": 4, "group_size": 8, "residual": 0},
        {"bits": 4, "group_size": 8, "residual": 0},
        "kl",
        "grows",
        0.5,
        "int4, group 8, residual 0",
    ),
    **{
        name: Spec({"budget": 64}, {"budget": BUDGET}, "exact", "bounded", 4, f"budget 64 / {BUDGET}")
        for name in ("knorm", "keydiff", "tova")
    },
    # query covariance [heads, head_dim, head_dim] per layer does not scale with the budget: on these tiny models it
    # alone passes the 2x-budget bound, so the small config uses the mean only
    "expected_attention": Spec(
        {"budget": 64},
        {"budget": BUDGET, "use_covariance": False},
        "exact",
        "bounded",
        4,
        f"budget 64 / {BUDGET} (query mean only)",
    ),
    "snapkv": Spec(
        {"budget": 64},
        {"budget": BUDGET, "window": 2},
        "exact",
        "bounded",
        4,
        f"budget 64 (window 64) / {BUDGET} (window 2)",
    ),
    # scorers added to hf_kvcache.scorers.registry: their cache with the scorer's settings for a few tokens
    **{
        cls.cache_name: Spec(
            {"budget": 64}, {"budget": BUDGET, **cls.scorer_class.small}, "exact", "bounded", 4, f"budget 64 / {BUDGET}"
        )
        for cls in hf_kvcache.CACHE_IMPLEMENTATIONS.values()
        if issubclass(cls, ScorerCache)
    },
    # the reconstruction request as ids: these random models have no tokenizer
    "kvzip": Spec(
        {"budget": 64, "request_ids": KVZIP_REQUEST},
        {"budget": BUDGET, "request_ids": KVZIP_REQUEST},
        "exact",
        "prompt",
        4,
        f"budget 64 / {BUDGET} of the prompt, then appended (request as ids)",
    ),
    # a linear surrogate with random weights shaped for each model (`planted`): these random models have none trained
    "kvzap": Spec(
        {"budget": 64, "surrogate": PLANTED},
        {"budget": BUDGET, "surrogate": PLANTED},
        "exact",
        "prompt",
        4,
        f"budget 64 / {BUDGET} of the prompt, then appended (a planted surrogate)",
    ),
}

# (arch, cache, check) -> diagnosis, for BROKEN results we know about (fnmatch patterns allowed, e.g. "*").
# Each entry says where in hf_kvcache the failure comes from; the test xfails on them instead of failing.
KNOWN_FAILURES: dict[tuple[str, str, str], str] = {}


# -- results of this session ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    status: str  # "ok", "refused", "broken", "skipped" (dtype the architecture cannot run), "n/a"
    detail: str = ""


RESULTS: dict[tuple[str, str, str], Result] = {}
ALL_KEYS = [(a, c, k) for a in ARCHS for c in CACHES for k in CHECKS]


class Refused(Exception):
    pass


class Broken(Exception):
    pass


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0].strip() if text else type(error).__name__
    if len(line) <= 220:
        return line
    cut = line[:220].rfind(". ")  # whole sentences where possible
    return line[: cut + 1] if cut > 80 else line[:217] + "..."


def _raised_in_library(error: BaseException) -> bool:
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(LIBRARY_DIR)


def known_failure(arch: str, cache: str, check: str) -> str | None:
    for (a, c, k), diagnosis in KNOWN_FAILURES.items():
        if fnmatch.fnmatchcase(arch, a) and fnmatch.fnmatchcase(cache, c) and fnmatch.fnmatchcase(check, k):
            return diagnosis
    return None


# -- inputs and references --------------------------------------------------------------------------------------
def prompt(rows: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded batch of random ids (never pad 0 or bos 1): (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    width = max(rows)
    ids = torch.full((len(rows), width), model_zoo.PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, n in enumerate(rows):
        ids[i, width - n :] = torch.randint(2, model_zoo.VOCAB, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids, mask


def generate(model, ids, mask, new, cache=None):
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            **cache_kwargs(cache),
            max_new_tokens=new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )


def teacher_forced(model, cache, seq, mask, prompt_len):
    """Logits [B, n, V] predicting seq[:, prompt_len:], the prompt prefilled then one token per forward."""
    mask = torch.cat((mask, torch.ones(mask.shape[0], seq.shape[1] - mask.shape[1], dtype=mask.dtype)), 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = []
    with torch.no_grad():
        logits = model(
            seq[:, :prompt_len],
            attention_mask=mask[:, :prompt_len],
            position_ids=pos[:, :prompt_len],
            **cache_kwargs(cache),
            use_cache=True,
        ).logits
        out.append(logits[:, -1:])
        for t in range(prompt_len, seq.shape[1] - 1):
            out.append(
                model(
                    seq[:, t : t + 1],
                    attention_mask=mask[:, : t + 1],
                    position_ids=pos[:, t : t + 1],
                    **cache_kwargs(cache),
                    use_cache=True,
                ).logits
            )
    return torch.cat(out, 1).float()


@dataclass
class Reference:
    ids: torch.Tensor
    mask: torch.Tensor
    sequences: torch.Tensor
    logits: torch.Tensor  # [B, new, V] step logits of generate
    forced: torch.Tensor  # [B, new, V] teacher-forced logits along `sequences`


@functools.cache
def reference(arch: str) -> Reference:
    """DynamicCache results on the `equal` prompt (float32), on a model that never sees our caches."""
    model = model_zoo.build(arch)
    ids, mask = prompt(EQUAL_ROWS, seed=1)
    out = generate(model, ids, mask, EQUAL_NEW)
    forced = teacher_forced(model, DynamicCache(config=model.config), out.sequences, mask, ids.shape[1])
    return Reference(ids, mask, out.sequences, torch.stack(out.logits, 1).float(), forced)


@functools.cache
def kv_bytes(arch: str) -> tuple[int, int]:
    """(float32 key + value bytes of one token of the batch summed over the full-attention layers, bytes the sliding
    layers hold once their window is full): read from the tensors a DynamicCache holds after the 16-token prompt,
    so MLA's cached latents count as they are and sliding layers as transformers keeps them (window - 1 tokens,
    already full here: the zoo's windows are 8)."""
    model = model_zoo.build(arch)
    ids, mask = prompt(BUDGET_ROWS, seed=2)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
    per_token = sliding = 0
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            assert layer.keys.shape[-2] == layer.sliding_window - 1 < ids.shape[1]
            sliding += layer.keys.nbytes + layer.values.nbytes
        elif hasattr(layer, "keys") and layer.keys is None:  # a KV-sharing (dummy) layer: it holds nothing
            continue
        elif not hasattr(layer, "keys"):  # linear attention / convolution: fixed-size states, counted with `sliding`
            states = [t for d in (layer.conv_states, layer.recurrent_states) for t in d.values() if t is not None]
            assert states, f"{arch}: a layer without keys holds no state either"
            sliding += sum(t.nbytes for t in states)
        else:
            (b, hk, _, dk), (_, hv, _, dv) = layer.keys.shape, layer.values.shape
            per_token += b * (hk * dk + hv * dv) * 4
    return per_token, sliding


@functools.cache
def dtype_unsupported(arch: str, dtype_name: str) -> str | None:
    """Why the architecture itself (DynamicCache) cannot run the smoke prompt in this dtype on CPU, or None."""
    try:
        model = model_zoo.build(arch, dtype=DTYPES[dtype_name])
        ids, mask = prompt(BUDGET_ROWS, seed=2)
        out = generate(model, ids, mask, SHORT_NEW)
    except Exception as error:
        return f"DynamicCache raises {type(error).__name__}: {first_line(error)}"
    if not torch.stack(out.logits).isfinite().all():
        return "DynamicCache gives non-finite logits"
    return None


# -- the checks -------------------------------------------------------------------------------------------------
def build_cache(model, name: str, config: dict):
    config = copy.deepcopy(config)
    if config.get("surrogate") == PLANTED:
        config["surrogate"] = planted_surrogate(model)
    try:
        return hf_kvcache.build_cache(name, model, config)
    except (ValueError, NotImplementedError) as error:
        raise Refused(first_line(error)) from error
    except Exception as error:
        raise Broken(f"building the cache: {type(error).__name__}: {first_line(error)}") from error


def run(model, fn):
    """Run `fn` (model forwards through the cache); classify its exceptions."""
    forwards = [0]
    handle = model.register_forward_hook(lambda *args: forwards.__setitem__(0, forwards[0] + 1))
    try:
        return fn()
    except (ValueError, NotImplementedError) as error:
        if forwards[0] == 0 and _raised_in_library(error):
            raise Refused(first_line(error)) from error
        raise Broken(f"{type(error).__name__}: {first_line(error)}") from error
    except (Refused, Broken):
        raise
    except Exception as error:
        raise Broken(f"{type(error).__name__}: {first_line(error)}") from error
    finally:
        handle.remove()


def check_finite(out, what: str) -> None:
    logits = torch.stack(out.logits)
    if not logits.isfinite().all():
        raise Broken(f"{what}: non-finite logits")


def check_equal(arch: str, name: str) -> str:
    spec, ref = SPECS[name], reference(arch)
    model = model_zoo.build(arch)
    cache = build_cache(model, name, spec.full)
    out = run(model, lambda: generate(model, ref.ids, ref.mask, EQUAL_NEW, cache))
    check_finite(out, "generate")
    got = out.sequences[:, ref.ids.shape[1] :]
    want = ref.sequences[:, ref.ids.shape[1] :]
    if spec.criterion == "exact":
        if not torch.equal(got, want):
            row, step = (got != want).nonzero()[0].tolist()
            raise Broken(
                f"tokens differ from DynamicCache: row {row}, new token {step}: "
                f"{got[row, step].item()} vs {want[row, step].item()}"
            )
        diff = (torch.stack(out.logits, 1).float() - ref.logits).abs().max().item()
        if diff > LOGIT_ATOL:
            raise Broken(f"same tokens but step logits differ from DynamicCache by {diff:.2e} > {LOGIT_ATOL}")
        return f"same tokens, max |logit diff| {diff:.1e}"
    forced_cache = build_cache(model, name, spec.full)
    forced = run(model, lambda: teacher_forced(model, forced_cache, ref.sequences, ref.mask, ref.ids.shape[1]))
    if not forced.isfinite().all():
        raise Broken("teacher-forced logits not finite")
    logp_ref, logp = ref.forced.log_softmax(-1), forced.log_softmax(-1)
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
    top1 = (ref.forced.argmax(-1) == forced.argmax(-1)).float().mean().item()
    detail = f"mean KL {kl.mean().item():.1e}, max {kl.max().item():.1e}, top-1 agreement {top1:.2f}"
    if kl.mean().item() > KL_MEAN_MAX or kl.max().item() > KL_MAX:
        raise Broken(f"teacher-forced {detail} (bounds: mean KL <= {KL_MEAN_MAX}, max KL <= {KL_MAX})")
    return detail


def check_budget(arch: str, name: str) -> str:
    spec = SPECS[name]
    model = model_zoo.build(arch)
    ids, mask = prompt(BUDGET_ROWS, seed=2)
    sizes = {}
    for new in (SHORT_NEW, LONG_NEW):
        cache = build_cache(model, name, spec.small)
        out = run(model, lambda: generate(model, ids, mask, new, cache))
        check_finite(out, f"{new} new tokens")
        if out.sequences.shape != (2, ids.shape[1] + new):
            raise Broken(f"generate returned shape {tuple(out.sequences.shape)}")
        sizes[new] = cache.nbytes()
    short, long = sizes[SHORT_NEW], sizes[LONG_NEW]
    per_token, sliding = kv_bytes(arch)  # sliding layers keep transformers' own layer: `sliding` bytes, constant
    if spec.memory == "bounded" or per_token == 0:  # evicting, or nothing but sliding layers to hold
        low = BUDGET * per_token * spec.min_bytes_per_value / 4 + sliding
        high = BOUND_FACTOR * (BUDGET * per_token + sliding)
        if short != long:
            raise Broken(f"nbytes grows with the stream: {short} after {SHORT_NEW} new tokens, {long} after {LONG_NEW}")
        if not low <= long <= high:
            raise Broken(
                f"nbytes {long} outside [{low:.0f}, {high:.0f}] implied by budget {BUDGET}"
                + (f" and the sliding layers' {sliding}" if sliding else "")
            )
        return f"nbytes {long} = {long / (BUDGET * per_token + sliding):.2f} x full-precision budget"
    if spec.memory == "prompt":  # the compressed prompt, then every new token appended
        low = BUDGET * per_token * spec.min_bytes_per_value / 4 + sliding
        high = BOUND_FACTOR * ((BUDGET + LONG_NEW) * per_token + sliding)
        if not (short <= long and low <= long <= high):
            raise Broken(
                f"nbytes {short} -> {long}: a compressed prompt plus appended tokens must stay in "
                f"[{low:.0f}, {high:.0f}] and never shrink"
            )
        return (
            f"nbytes {long} = {long / ((BUDGET + LONG_NEW - 1) * per_token + sliding):.2f} x full-precision "
            "budget + appended tokens"
        )
    tokens = ids.shape[1] + LONG_NEW - 1  # the last generated token is never fed back
    full = tokens * per_token
    if not short < long <= QUANTIZED_MAX_RATIO * full + sliding:
        raise Broken(
            f"nbytes {short} -> {long} (keep-all: must grow and stay <= {QUANTIZED_MAX_RATIO} x {full}"
            + (f" + the sliding layers' {sliding})" if sliding else ")")
        )
    return f"nbytes {long} = {(long - sliding) / full:.2f} x full precision (full-attention layers)"


def evict_reference(arch: str, ids: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """Logits of the decode step after a prompt longer than sinks + window, rebuilt from DynamicCache: the
    full-attention layers hold the first `sinks` tokens' keys/values recomputed at the positions just before the
    window ("positions inside the cache": exact, since sinks attend only to sinks, so their states do not depend on
    a common shift) and the last window - 1 prompt tokens' keys/values of a normal prefill (computed with every
    token visible, as our caches' prefill does); sliding layers keep the model's own window, and linear-attention /
    convolution layers their state after every token."""
    model = model_zoo.build(arch)
    length = ids.shape[1] - 1
    shift = length - (window - 1) - sinks
    with torch.no_grad():
        prefill = DynamicCache(config=model.config)
        model(ids[:, :length], **cache_kwargs(prefill), use_cache=True)
        moved = DynamicCache(config=model.config)
        if sinks:
            model(
                ids[:, :sinks],
                position_ids=torch.arange(shift, shift + sinks)[None],
                **cache_kwargs(moved),
                use_cache=True,
            )
        for i, layer in enumerate(prefill.layers):
            if getattr(layer, "is_sliding", False) or getattr(layer, "keys", None) is None:  # (linear, dummy layers)
                continue
            keep = slice(length - (window - 1), length)
            parts_k, parts_v = [layer.keys[:, :, keep]], [layer.values[:, :, keep]]
            if sinks:
                parts_k.insert(0, moved.layers[i].keys)
                parts_v.insert(0, moved.layers[i].values)
            layer.keys, layer.values = torch.cat(parts_k, -2), torch.cat(parts_v, -2)
        return (
            model(ids[:, length:], position_ids=torch.tensor([[length]]), **cache_kwargs(prefill), use_cache=True)
            .logits[:, -1]
            .float()
        )


def check_evict(arch: str, name: str) -> str:
    spec = SPECS[name]
    if spec.evict is None:
        raise _NotApplicable()
    config, sinks = spec.evict
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, model_zoo.VOCAB, (1, EVICT_PROMPT + 1), generator=g)
    model = model_zoo.build(arch)
    cache = build_cache(model, name, config)

    def stream():
        with torch.no_grad():
            model(ids[:, :EVICT_PROMPT], **cache_kwargs(cache), use_cache=True)
            return model(ids[:, EVICT_PROMPT:], **cache_kwargs(cache), use_cache=True).logits[:, -1].float()

    got = run(model, stream)
    try:
        want = evict_reference(arch, ids, sinks, EVICT_WINDOW)
    except Exception as error:
        raise Broken(f"reference failed ({type(error).__name__}: {first_line(error)})") from error
    diff = (got - want).abs().max().item()
    if not diff <= EVICT_ATOL:
        raise Broken(
            f"decode step after eviction differs from the rebuilt DynamicCache by {diff:.2e} "
            f"(> {EVICT_ATOL:g}; {sinks} sinks moved by {EVICT_PROMPT - (EVICT_WINDOW - 1) - sinks})"
        )
    return f"max |logit diff| {diff:.1e}"


def check_dtype(arch: str, name: str, dtype_name: str) -> str:
    reason = dtype_unsupported(arch, dtype_name)
    if reason is not None:
        raise _Skip(reason)
    model = model_zoo.build(arch, dtype=DTYPES[dtype_name])
    ids, mask = prompt(BUDGET_ROWS, seed=2)
    cache = build_cache(model, name, SPECS[name].small)
    out = run(model, lambda: generate(model, ids, mask, SHORT_NEW, cache))
    check_finite(out, dtype_name)
    return "finite"


class _Skip(Exception):
    pass


class _NotApplicable(Exception):
    pass


def evaluate(arch: str, name: str, check: str) -> Result:
    try:
        if check == "equal":
            detail = check_equal(arch, name)
        elif check == "budget":
            detail = check_budget(arch, name)
        elif check == "evict":
            detail = check_evict(arch, name)
        else:
            detail = check_dtype(arch, name, check)
    except Refused as error:
        return Result("refused", str(error))
    except Broken as error:
        return Result("broken", str(error))
    except _Skip as error:
        return Result("skipped", str(error))
    except _NotApplicable:
        return Result("n/a", "not applicable to this cache")
    return Result("ok", detail)


# -- the committed table ----------------------------------------------------------------------------------------
ABBREV = {"equal": "equal", "budget": "budget", "evict": "evict", "bfloat16": "bf16", "float16": "fp16"}


def render_cell(results: list[Result]) -> tuple[str, str | None]:
    """Cell text (without its note number) and the note, from the results of one cell's checks (CHECKS order)."""
    named = list(zip(CHECKS, results))
    broken = [(c, r) for c, r in named if r.status == "broken"]
    if broken:
        return "BROKEN", "BROKEN (diagnosed in the test's KNOWN_FAILURES): " + "; ".join(
            f"{ABBREV[c]}: {r.detail}" for c, r in broken
        )
    refused = [(c, r) for c, r in named if r.status == "refused"]
    ok = [c for c, r in named if r.status == "ok"]
    if not refused:
        return "yes", None
    reasons = list(dict.fromkeys(r.detail for _, r in refused))
    note = "refused: " + " / ".join(reasons)
    if not ok:
        return "refused", note
    return f"yes ({', '.join(ABBREV[c] for c in ok)}), refused ({', '.join(ABBREV[c] for c, _ in refused)})", note


def parse_cell(text: str) -> set[str]:
    """The checks a committed cell claims to pass."""
    text = re.sub(r"\s*\[\d+\]\s*$", "", text.strip())
    if text == "yes":
        return set(CHECKS)
    match = re.match(r"yes \(([^)]*)\)", text)
    if match:
        full = {v: k for k, v in ABBREV.items()}
        return {full[a.strip()] for a in match.group(1).split(",")}
    return set()


def committed_cells() -> dict[tuple[str, str], set[str]]:
    """(arch, cache) -> checks the committed docs/support_matrix.md lists as working."""
    if not DOC.exists():
        return {}
    header, cells = None, {}
    for line in DOC.read_text().splitlines():
        if not line.startswith("|"):
            continue
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if header is None and parts and parts[0].startswith("architecture"):
            header = [re.sub(r"[`\s]", "", p) for p in parts[1:]]
            continue
        match = re.match(r"`([a-z0-9_]+)`", parts[0])
        if header and match:
            for cache, text in zip(header, parts[1:]):
                cells[(match.group(1), cache)] = parse_cell(text)
    return cells


def _legend_value(value) -> str:
    return json.dumps(value, separators=(", ", ": ")) if value else "defaults"


def render_table(results: dict[tuple[str, str, str], Result]) -> str:
    notes: list[str] = []

    def note_number(text: str) -> int:
        if text not in notes:
            notes.append(text)
        return notes.index(text) + 1

    header = "| architecture: features (attention) | " + " | ".join(f"`{c}`" for c in CACHES) + " |"
    rows = [header, "|" + "---|" * (len(CACHES) + 1)]
    for arch in ARCHS:
        model = model_zoo.build(arch)
        skips = sorted({(k, r.detail) for (a, c, k), r in results.items() if a == arch and r.status == "skipped"})
        label = f"`{arch}`: {', '.join(model_zoo.features(model)) or 'plain'} ({model.config._attn_implementation})"
        if kv_bytes(arch)[0] == 0:
            label += "; no full-attention layer: every layer keeps transformers' sliding layer, nothing is compressed"
        for check, reason in dict(skips).items():
            label += f"; {ABBREV[check]} not run [{note_number(f'{ABBREV[check]} not run: {reason}')}]"
        cells = []
        for cache in CACHES:
            text, note = render_cell([results[(arch, cache, k)] for k in CHECKS])
            cells.append(text if note is None else f"{text} [{note_number(note)}]")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    configs = "; ".join(f"`{c}` {SPECS[c].label}" for c in CACHES)
    lines = [
        "# Support matrix",
        "",
        f"Generated by `scripts/support_matrix.py` from `tests/test_support_matrix.py` (hf_kvcache "
        f"{hf_kvcache.__version__}, transformers {transformers.__version__}, torch {torch.__version__}); do not edit "
        "by hand. Tiny random models of `tests/model_zoo.py` (2 layers, hidden 64, vocab 128), CPU.",
        "",
        f"- **yes**: every check passes. float32, budget keeping every token: greedy `generate` (batch 2, left "
        f"padding, {max(EQUAL_ROWS)}-token prompt, {EQUAL_NEW} new tokens) gives DynamicCache's tokens, step logits "
        f"within {LOGIT_ATOL:g}; for `fp8` and `kivi` (quantized, never identical): along DynamicCache's greedy "
        f"continuation fed back token by token, KL(DynamicCache || cache) of the next-token distributions <= "
        f"{KL_MEAN_MAX:g} on average and <= {KL_MAX:g} at every position (top-1 agreement is not required: random "
        f"tiny models have near ties). float32, budget {BUDGET} with a {max(BUDGET_ROWS)}-token prompt: generation "
        f"runs, logits finite, `nbytes()` equal after {SHORT_NEW} and {LONG_NEW} new tokens and within [budget at "
        f"stored precision, {BOUND_FACTOR:g} x budget at full precision], plus what sliding layers hold (`fp8`/`kivi` "
        f"keep every token: `nbytes()` grows and stays <= {QUANTIZED_MAX_RATIO:g} x full precision). `sink`, "
        f"`sliding`, `composite` (sinks + window), after eviction: a decode step equals DynamicCache rebuilt with "
        f"the kept tokens, sinks re-positioned (within {EVICT_ATOL:g}). bfloat16 and float16 at the small budget: "
        "runs, logits finite.",
        "- **refused [n]**: the cache raises ValueError/NotImplementedError before generating a token; note n is "
        "the message's first line. `yes (...), refused (...)` lists which checks pass and which are refused.",
        "- **BROKEN [n]**: another exception or a failed check (note n); a known failure, documented in "
        "`KNOWN_FAILURES` of the test.",
        f"- Configs (keep-every-token / small budget): {configs}.",
        "",
        *rows,
        "",
        *(f"{i}. {text}" for i, text in enumerate(notes, 1)),
        "",
    ]
    return "\n".join(lines)


# -- tests --------------------------------------------------------------------------------------------------------
def test_every_cache_name_has_a_spec():
    assert set(SPECS) == set(hf_kvcache.CACHE_IMPLEMENTATIONS), "add a Spec for every registered cache name"


def test_model_zoo_covers_enough_architectures():
    assert len(ARCHS) >= 15
    for arch in ("gemma2", "gemma3", "gpt_oss", "cohere2", "mistral", "ministral", "olmo3"):
        model = model_zoo.build(arch)
        assert any("slid" in f for f in model_zoo.features(model)), f"{arch}: sliding layers not on"
    for arch in ("deepseek_v3", "minicpm3"):  # the MLA claim of features(): what the cache really receives
        model = model_zoo.build(arch)
        assert any(f.startswith("MLA") for f in model_zoo.features(model))
        cache = DynamicCache(config=model.config)
        ids, mask = prompt(BUDGET_ROWS, seed=2)
        with torch.no_grad():
            model(ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
        keys, values = cache.layers[0].keys, cache.layers[0].values
        assert keys.shape[1] == values.shape[1] == 1
        assert (keys.shape[-1], values.shape[-1]) == (model.config.kv_lora_rank, model.config.qk_rope_head_dim)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("cache_name", CACHES)
@pytest.mark.parametrize("arch", ARCHS)
def test_cell(arch, cache_name, check):
    result = evaluate(arch, cache_name, check)
    RESULTS[(arch, cache_name, check)] = result
    claimed = check in committed_cells().get((arch, cache_name), set())
    if not WRITE and claimed and result.status in ("refused", "broken"):
        pytest.fail(f"docs/support_matrix.md lists this check as working; now {result.status}: {result.detail}")
    if result.status == "broken":
        diagnosis = known_failure(arch, cache_name, check)
        if diagnosis is None:
            pytest.fail(f"BROKEN (not in KNOWN_FAILURES): {result.detail}")
        pytest.xfail(f"known failure: {diagnosis} | observed: {result.detail}")
    if result.status in ("skipped", "n/a"):
        pytest.skip(result.detail)


def _whole_matrix_or_skip():
    missing = [k for k in ALL_KEYS if k not in RESULTS]
    if missing:
        pytest.skip(
            f"only {len(ALL_KEYS) - len(missing)} of {len(ALL_KEYS)} matrix checks ran in this session "
            f"(-k selection or test order); the comparison needs them all"
        )


def test_known_failures_are_current():
    _whole_matrix_or_skip()
    stale = [
        key
        for key in KNOWN_FAILURES
        if not any(
            r.status == "broken"
            and fnmatch.fnmatchcase(a, key[0])
            and fnmatch.fnmatchcase(c, key[1])
            and fnmatch.fnmatchcase(k, key[2])
            for (a, c, k), r in RESULTS.items()
        )
    ]
    assert not stale, f"KNOWN_FAILURES entries that no longer fail (remove them, regenerate the table): {stale}"


def test_docs_table_is_current():
    """Last: renders the table from this session's results; compares with (or, with HF_KVCACHE_WRITE_MATRIX=1,
    writes) docs/support_matrix.md."""
    _whole_matrix_or_skip()
    text = render_table(RESULTS)
    if WRITE:
        DOC.parent.mkdir(parents=True, exist_ok=True)
        DOC.write_text(text)
        return
    skip_unless_locked_versions("docs/support_matrix.md")
    assert DOC.exists(), "docs/support_matrix.md missing: run scripts/support_matrix.py"
    assert DOC.read_text() == text, (
        "docs/support_matrix.md is stale (results changed): run `python scripts/support_matrix.py` and commit it"
    )
