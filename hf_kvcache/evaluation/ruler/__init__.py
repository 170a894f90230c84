"""A RULER-style task suite generated offline (Hsieh et al., arXiv 2404.06654): every sample is made from a seed and
the offline corpus, so the suite needs no download and any model id can run it.

    from hf_kvcache.evaluation.ruler import TASKS, make_sample, score
    sample = make_sample("niah_single_2", context_len=2048, seed=0, tokenizer=tokenizer)
    score(model_output, sample.answers, sample.metric)

One module per task family: `niah` (needle in a haystack: single, multi-key, multi-value, multi-query),
`variable_tracking`, `word_extraction` (common / frequent words), `qa` (questions over records). A sample's prompt
fits `context_len` tokens of the model's tokenizer (context + question + answer prefix).
"""

from __future__ import annotations

from collections.abc import Callable

from . import niah, qa, variable_tracking, word_extraction
from .sample import METRICS, Sample, score, token_counter

#: task name -> the function making one sample (name, context_len, seed, token counter)
TASKS: dict[str, Callable[..., Sample]] = {
    **{name: niah.niah for name in niah.VARIANTS},
    **{name: variable_tracking.variable_tracking for name in variable_tracking.VARIANTS},
    "cwe": word_extraction.common_words,
    "fwe": word_extraction.frequent_words,
    **{name: qa.qa_records for name in qa.VARIANTS},
}

__all__ = ["METRICS", "Sample", "TASKS", "make_sample", "score"]


def make_sample(task: str, context_len: int, seed: int, tokenizer) -> Sample:
    """Sample `seed` of `task` for a prompt of at most `context_len` tokens of `tokenizer` (None: ~4 characters per
    token)."""
    if task not in TASKS:
        raise ValueError(f"`task` must be one of {sorted(TASKS)}, got {task!r}.")
    if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len < 256:
        raise ValueError(f"`context_len` must be an integer >= 256 (tokens), got {context_len!r}.")
    return TASKS[task](task, context_len, seed, token_counter(tokenizer))
