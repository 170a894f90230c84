"""How a sample is run through a cache: the protocols the field uses.

- "agnostic" (question-agnostic, kvpress's protocol): the context is prefilled into the cache and compressed at the
  end of its prefill (`cache.end_prompt()`: prompt-mode caches place it there; KVzip compresses before the question);
  then the question and the answer prefix are fed uncompressed and the answer generated greedily.
- "aware" (question-aware, an upper bound): the question is also put before the context, so the compression can
  see what will be asked.
Decode-time eviction is the same "agnostic" run with a cache built with `compress="always"`: the budget then holds
through the question and the answer too.
"""

from __future__ import annotations

import torch

from ...integration.cache_argument import cache_kwargs
from .sample import Sample, score

PROTOCOLS = ("agnostic", "aware")


def prompt_parts(sample: Sample, protocol: str) -> tuple[str, str]:
    """(text compressed as the context, text fed after it) for `protocol`."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"`protocol` must be one of {PROTOCOLS}, got {protocol!r}.")
    context = sample.context if protocol == "agnostic" else sample.question.strip() + "\n\n" + sample.context
    return context, sample.question + sample.answer_prefix


def tail_length(tokenizer, sample: Sample, protocol: str = "agnostic") -> int:
    """Tokens fed after the context (question + answer prefix): samples batched together must share it."""
    return len(tokenizer(prompt_parts(sample, protocol)[1], add_special_tokens=False).input_ids)


@torch.inference_mode()
def run_batch(model, tokenizer, samples: list[Sample], cache, protocol: str = "agnostic") -> list[dict]:
    """Generate the answers to `samples` through `cache` (a fresh one, built for this batch) and score them.

    The contexts are left-padded to one width (padding is never kept by our caches, and rows with padding generate
    as they would alone: tests/test_batching.py), prefilled with their padding mask and position ids, and compressed
    at `end_prompt()`; the tails must then have one token length (`tail_length`), so every row's context ends at the
    same column and the question is fed with no padding inside the sequence. One sample is the batch of one."""
    if not samples:
        raise ValueError("`samples` must hold at least one sample.")
    device = next(model.parameters()).device
    parts = [prompt_parts(sample, protocol) for sample in samples]
    contexts = [tokenizer(c, add_special_tokens=False).input_ids for c, _ in parts]
    tails = [tokenizer(t, add_special_tokens=False).input_ids for _, t in parts]
    if len({len(t) for t in tails}) != 1:
        raise ValueError(
            f"`samples`: the question + answer prefix must have one token length in a batch, got "
            f"{sorted({len(t) for t in tails})}; batch samples by `tail_length`."
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(c) for c in contexts)
    context = torch.tensor([[pad] * (width - len(c)) + c for c in contexts], device=device)
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    model(
        input_ids=context,
        attention_mask=mask,
        position_ids=positions,
        **cache_kwargs(cache),
        use_cache=True,
        logits_to_keep=1,
    )
    if hasattr(cache, "end_prompt"):
        cache.end_prompt()
    ids = torch.cat((context, torch.tensor(tails, device=device)), 1)
    mask = torch.cat((mask, torch.ones_like(ids[:, width:])), 1)
    # disable_compile: on CUDA, generate compiles the forward by itself for a compileable cache (ours evicting into
    # fixed slots are), recompiling for every new batch size: on an H200 that made the board several times slower
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        **cache_kwargs(cache),
        do_sample=False,
        max_new_tokens=max(s.max_new_tokens for s in samples),
        pad_token_id=pad,
        disable_compile=True,
    )
    results = []
    for row, sample in enumerate(samples):
        text = tokenizer.decode(out[row, ids.shape[1] :], skip_special_tokens=True)
        results.append(
            {
                "task": sample.task,
                "score": score(text, sample.answers, sample.metric),
                "output": text,
                "answers": sample.answers,
                "prompt_tokens": len(contexts[row]) + len(tails[row]),
                "chance": sample.chance,
            }
        )
    return results


def run_sample(model, tokenizer, sample: Sample, cache, protocol: str = "agnostic") -> dict:
    """Generate the answer to `sample` through `cache` (a fresh one per sample) and score it."""
    return run_batch(model, tokenizer, [sample], cache, protocol)[0]
