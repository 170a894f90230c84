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


@torch.inference_mode()
def run_sample(model, tokenizer, sample: Sample, cache, protocol: str = "agnostic") -> dict:
    """Generate the answer to `sample` through `cache` (a fresh one per sample) and score it."""
    device = next(model.parameters()).device
    context_text, tail_text = prompt_parts(sample, protocol)
    context = tokenizer(context_text, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
    tail = tokenizer(tail_text, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
    model(input_ids=context, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    if hasattr(cache, "end_prompt"):
        cache.end_prompt()
    ids = torch.cat((context, tail), 1)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache),
                         max_new_tokens=sample.max_new_tokens, do_sample=False, pad_token_id=pad)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return {"task": sample.task, "score": score(text, sample.answers, sample.metric), "output": text,
            "answers": sample.answers, "prompt_tokens": int(ids.shape[1]), "chance": sample.chance}
