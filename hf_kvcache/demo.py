"""The demo: a small budget sweep on the offline SmolLM2 and corpus, one `generate` per cache, and a table of
what each cache holds, how fast it decodes and how often it agrees with the full cache."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .evaluation.memory import cache_nbytes


@dataclass
class DemoRow:
    cache: str
    budget: str
    bytes_held: int
    decode_tokens_per_s: float  # one-token forwards through the cache, after the prompt
    generated_agreement: float  # fraction of positions where free-running greedy output equals the full cache's
    top1_agreement: float  # teacher-forced on the full cache's continuation: argmax equal to the full cache's


def demo_specs(prompt_len: int) -> list[tuple[str, str, dict, str]]:
    """(label, cache_implementation, cache_config, budget) for the sweep: each evicting cache at 1/8, 1/4 and 1/2 of
    the prompt (in tokens), then the quantized keep-all caches (budget "all": every token, fewer bytes each)."""
    specs = [("full (DynamicCache)", "dynamic", {}, "all")]
    for fraction in (0.125, 0.25, 0.5):
        budget = int(prompt_len * fraction)
        specs.append((f"sink 4+{budget - 4}", "sink", {"sinks": 4, "window": budget - 4}, str(budget)))
        specs.append((f"sliding {budget}", "sliding", {"window": budget}, str(budget)))
        specs.append((f"h2o {budget}", "h2o", {"budget": budget}, str(budget)))
        specs.append((f"composite fp8 {budget}", "composite", {"preset": "sinks_heavy_recent", "budget": budget},
                      str(budget)))
    specs.append(("fp8 (E4M3, Hadamard)", "fp8", {}, "all"))
    specs.append(("kivi int4", "kivi", {"bits": 4}, "all"))
    return specs


@torch.no_grad()
def _teacher_forced_argmax(model, prompt, continuation, generation_kwargs) -> tuple[torch.Tensor, float]:
    """Argmax after the prompt and after each continuation token, through the cache `generate` builds; and the
    decode speed (tokens/s) of those one-token forwards."""
    out = model.generate(
        prompt, max_new_tokens=1, do_sample=False, return_dict_in_generate=True, output_logits=True, **generation_kwargs
    )
    cache = out.past_key_values
    preds = [out.logits[0].argmax(-1)]
    start = time.perf_counter()
    for i in range(continuation.shape[1] - 1):
        step = continuation[:, i : i + 1]
        logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits
        preds.append(logits[:, -1].argmax(-1))
    speed = (continuation.shape[1] - 1) / (time.perf_counter() - start)
    return torch.stack(preds, 1), speed


@torch.no_grad()
def run_demo(model, tokenizer, prompt_ids: torch.Tensor, new_tokens: int = 64, progress=None) -> list[DemoRow]:
    import hf_kvcache  # noqa: F401  (registers the cache names)

    pad = tokenizer.pad_token_id
    rows, reference = [], None
    model.generate(prompt_ids[:, :64], max_new_tokens=4, do_sample=False, pad_token_id=pad)  # warm-up
    specs = demo_specs(prompt_ids.shape[1])
    for label, name, config, budget in progress(specs) if progress else specs:
        kwargs = {"cache_implementation": name}
        if config:
            kwargs["cache_config"] = config
        out = model.generate(
            prompt_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            return_dict_in_generate=True, pad_token_id=pad, **kwargs,
        )
        generated = out.sequences[:, prompt_ids.shape[1] :]
        if reference is None:
            reference = generated
            full_argmax = generated
        held = cache_nbytes(out.past_key_values)
        forced, speed = _teacher_forced_argmax(model, prompt_ids, reference, {**kwargs, "pad_token_id": pad})
        rows.append(
            DemoRow(
                cache=label,
                budget=budget,
                bytes_held=held,
                decode_tokens_per_s=speed,
                generated_agreement=float((generated == reference).float().mean()),
                top1_agreement=float((forced == full_argmax).float().mean()),
            )
        )
    return rows


def format_table(rows: list[DemoRow]) -> str:
    full = rows[0].bytes_held
    header = f"{'cache':<24}{'budget':>8}{'bytes held':>14}{'vs full':>9}{'decode tok/s':>14}{'gen agree':>11}{'top-1':>8}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.cache:<24}{r.budget:>8}{r.bytes_held:>14,}{r.bytes_held / full:>8.2f}x{r.decode_tokens_per_s:>14.1f}"
            f"{r.generated_agreement:>11.2%}{r.top1_agreement:>8.2%}"
        )
    return "\n".join(lines)
