"""What every generated task produces, how it is scored, and how a context is filled to a token length.

A `Sample` is one test item: the `context` (what a cache compresses), the `question` (asked after it, or before it in
the question-aware protocol), the `answer_prefix` the model continues from (RULER's templates end the prompt with the
start of the answer, so small models answer in form), the reference `answers`, and the `metric`:
- "all" (RULER's string_match_all): the share of the references that appear in the prediction (case-insensitive);
- "part" (RULER's string_match_part): 1 if any reference appears in it.
Scores are in [0, 1]; a task's score is the mean over its samples. `chance` is what a model that answers without
reading the context scores in expectation: 0 where the references are random strings, 1/12 for a record's city
(one of 12 cities).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ..retrieval import longest_fit

METRICS = ("all", "part")


@dataclass
class Sample:
    task: str
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    metric: str  # "all" or "part"
    max_new_tokens: int
    meta: dict = field(default_factory=dict)
    chance: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def score(prediction: str, answers: list[str], metric: str) -> float:
    """RULER's string match: "all" = share of `answers` found in `prediction`, "part" = 1 if any is found."""
    if metric not in METRICS:
        raise ValueError(f"`metric` must be one of {METRICS}, got {metric!r}.")
    text = prediction.lower()
    found = [answer.lower() in text for answer in answers]
    return sum(found) / len(found) if metric == "all" else float(any(found))


def token_counter(tokenizer) -> Callable[[str], int]:
    """Token count of a text by the model's tokenizer (the context length is the model's, not characters); without
    one (lm-eval task files that know no model), about 4 characters per token."""
    if tokenizer is None:
        return lambda text: max(1, len(text) // 4)
    return lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)


def fit(build: Callable[[int], str], most: int, budget: int, count: Callable[[str], int]) -> int:
    """The largest n in [1, most] with count(build(n)) <= budget (build grows with n); an error when none fits."""
    if count(build(1)) > budget:
        raise ValueError(
            f"the task does not fit in {budget} tokens even with the least haystack; give a longer `context_len`."
        )
    return longest_fit(build, most, budget, count)


def rng_for(task: str, context_len: int, seed: int) -> random.Random:
    """A generator of its own per (task, length, seed): samples are reproducible and independent of run order."""
    return random.Random(f"ruler-{task}-{context_len}-{seed}")
