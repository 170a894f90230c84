"""The demo: a small budget sweep on the offline SmolLM2 and corpus, and a table of what each cache holds, how fast it
decodes and how often it agrees with the full cache.

Each row (a cache at a budget) prefills the prompt once into a fresh cache, then from copies of that cache:
- free-running: `model.generate` continues greedily with the prefilled cache (`cache=`), and
  `generated_agreement` is the fraction of positions where its tokens equal the full cache's;
- teacher-forced: the full cache's continuation is fed one token per forward through the compressed cache, and
  `top1_agreement` is the fraction of positions whose argmax equals the full cache's (the full row needs no such pass:
  it would replay its own greedy output).
`decode_tokens_per_s` is the free-running generation's speed (its one-token forwards through the cache).
A progress bar per row counts its forwards; `seconds` / `cpu_seconds` are the row's wall and process CPU time.
`hf_kvcache.evaluation.demo_report` writes the rows as CSV / JSON and plots quality against bytes held.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..integration.cache_argument import cache_kwargs
from .cache_spec import make_cache
from .memory import cache_nbytes

#: each evicting cache runs at these fractions of the prompt
BUDGET_FRACTIONS = (0.125, 0.25, 0.5)


@dataclass
class DemoRow:
    cache: str
    family: str  # the cache without its budget: one line of the summary plot
    budget: str
    bytes_held: int
    decode_tokens_per_s: float  # generate's one-token forwards through the cache, after the prompt
    generated_agreement: float  # fraction of positions where free-running greedy output equals the full cache's
    top1_agreement: float  # teacher-forced on the full cache's continuation: argmax equal to the full cache's
    seconds: float  # wall time of the row (prefill, generation, teacher-forced pass)
    cpu_seconds: float  # process CPU time of the row (all threads)
    not_run: str = ""  # why the row could not run here (a missing optional backend); its figures are then NaN


def demo_specs(prompt_len: int) -> list[tuple[str, str, dict, str, str]]:
    """(label, family, cache name, cache_config, budget) for the sweep: each evicting cache at 1/8, 1/4 and 1/2 of
    the prompt (in tokens), then the quantized keep-all caches (budget "all": every token, fewer bytes each)."""
    specs = [("full (DynamicCache)", "full", "dynamic", {}, "all")]
    for fraction in BUDGET_FRACTIONS:
        budget = int(prompt_len * fraction)
        specs.append((f"sink 4+{budget - 4}", "sink", "sink", {"sinks": 4, "window": budget - 4}, str(budget)))
        specs.append((f"sliding {budget}", "sliding", "sliding", {"window": budget}, str(budget)))
        specs.append((f"h2o {budget}", "h2o", "h2o", {"budget": budget}, str(budget)))
        specs.append(
            (
                f"composite fp8 {budget}",
                "composite fp8",
                "composite",
                {"preset": "sinks_heavy_recent", "budget": budget},
                str(budget),
            )
        )
    specs.append(("fp8 (E4M3, Hadamard)", "fp8", "fp8", {}, "all"))
    specs.append(("kivi int4", "kivi int4", "kivi", {"bits": 4}, "all"))
    return specs


class _Ticks(StoppingCriteria):
    """Advances a progress bar once per generated token; never stops generation."""

    def __init__(self, bar):
        self.bar = bar

    def __call__(self, input_ids, scores, **kwargs):
        if self.bar is not None:
            self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _row_bar(label: str, total: int, progress: bool):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"{label:<22}", unit="fwd", leave=True)


@torch.no_grad()
def _run_row(model, prompt, cache, new_tokens: int, reference, pad: int, bar):
    """(generated [1, new_tokens], decode tokens/s, teacher-forced argmax [1, new_tokens] or None) for one fresh
    cache; `reference` None: this is the full cache, whose output is the reference."""
    logits = model(input_ids=prompt, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits
    first = logits[:, -1].argmax(-1, keepdim=True)
    if bar is not None:
        bar.update(1)
    forced_cache = copy.deepcopy(cache) if reference is not None else None
    start = time.perf_counter()
    out = model.generate(
        torch.cat((prompt, first), 1),
        **cache_kwargs(cache),
        max_new_tokens=new_tokens - 1,
        min_new_tokens=new_tokens - 1,
        do_sample=False,
        pad_token_id=pad,
        stopping_criteria=StoppingCriteriaList([_Ticks(bar)]),
    )
    speed = (new_tokens - 1) / (time.perf_counter() - start)
    generated = out[:, prompt.shape[1] :]
    if reference is None:
        return generated, speed, None
    preds = [first[:, 0]]
    for i in range(new_tokens - 1):
        step = model(input_ids=reference[:, i : i + 1], **cache_kwargs(forced_cache), use_cache=True).logits
        preds.append(step[:, -1].argmax(-1))
        if bar is not None:
            bar.update(1)
    return generated, speed, torch.stack(preds, 1)


@torch.no_grad()
def run_demo(model, tokenizer, prompt_ids: torch.Tensor, new_tokens: int = 32, progress: bool = False) -> list[DemoRow]:
    """One row per cache of `demo_specs` (the first is the full cache, the reference); `progress`: a tqdm bar a row."""
    import hf_kvcache  # noqa: F401  (registers the cache names)

    if new_tokens < 2:
        raise ValueError(f"`new_tokens` must be >= 2 (one token from the prefill, the rest decoded), got {new_tokens}.")
    pad = tokenizer.pad_token_id
    prompt_len = prompt_ids.shape[1]
    model.generate(prompt_ids[:, :64], max_new_tokens=4, do_sample=False, pad_token_id=pad)  # warm-up
    rows, reference = [], None
    for label, family, name, config, budget in demo_specs(prompt_len):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            cache = make_cache(model, name, config, context_len=prompt_len, total_len=prompt_len + new_tokens)
        except ImportError as missing:  # an optional backend (e.g. KIVI's packing): said in the table, not fatal
            nan = float("nan")
            rows.append(
                DemoRow(
                    cache=label,
                    family=family,
                    budget=budget,
                    bytes_held=0,
                    decode_tokens_per_s=nan,
                    generated_agreement=nan,
                    top1_agreement=nan,
                    seconds=0.0,
                    cpu_seconds=0.0,
                    not_run=str(missing),
                )
            )
            continue
        bar = _row_bar(label, 1 + (new_tokens - 1) * (1 if reference is None else 2), progress)
        generated, speed, forced = _run_row(model, prompt_ids, cache, new_tokens, reference, pad, bar)
        if reference is None:  # the full cache: its greedy output is the reference (teacher-forced, it is itself)
            reference = forced = generated
        rows.append(
            DemoRow(
                cache=label,
                family=family,
                budget=budget,
                bytes_held=cache_nbytes(cache),
                decode_tokens_per_s=speed,
                generated_agreement=float((generated == reference).float().mean()),
                top1_agreement=float((forced == reference).float().mean()),
                seconds=time.perf_counter() - wall,
                cpu_seconds=time.process_time() - cpu,
            )
        )
        if bar is not None:
            bar.close()
    return rows


def format_table(rows: list[DemoRow]) -> str:
    full = rows[0].bytes_held
    header = (
        f"{'cache':<24}{'budget':>8}{'bytes held':>14}{'vs full':>9}{'decode tok/s':>14}{'gen agree':>11}"
        f"{'top-1':>8}{'row s':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        if r.not_run:
            lines.append(f"{r.cache:<24}{r.budget:>8}  not run: {r.not_run}")
            continue
        lines.append(
            f"{r.cache:<24}{r.budget:>8}{r.bytes_held:>14,}{r.bytes_held / full:>8.2f}x{r.decode_tokens_per_s:>14.1f}"
            f"{r.generated_agreement:>11.2%}{r.top1_agreement:>8.2%}{r.seconds:>8.1f}"
        )
    return "\n".join(lines)
