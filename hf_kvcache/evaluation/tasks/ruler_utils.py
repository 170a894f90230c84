"""lm-eval task files for the generated RULER-style suite (hf_kvcache.evaluation.ruler): the same samples as
`hf-kvcache ruler`, generated on the fly, nothing downloaded; `lm-eval --model hf-kvcache --tasks kvcache_ruler`.

Metadata keys (`--metadata '{...}'`): context_tokens (default 2048), n_docs (default 50), seed (default 0),
tokenizer (a name or path whose tokenizer measures the lengths; default about 4 characters per token). Scored as
RULER scores (`score`: the share of the references in the answer, or whether one is there).
"""

from __future__ import annotations

import json

import datasets

from hf_kvcache.evaluation.ruler import TASKS, make_sample, score


def dataset(task: str, context_tokens=2048, n_docs=50, seed=0, tokenizer=None, **_):
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    docs = []
    for i in range(int(n_docs)):
        sample = make_sample(task, int(context_tokens), int(seed) + i, tokenizer)
        docs.append(
            {
                "context": sample.context,
                "question": sample.question,
                "answer_prefix": sample.answer_prefix,
                "answers": json.dumps(sample.answers),
                "metric": sample.metric,
            }
        )
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def process_results(doc, results):
    return {"score": score(results[0], json.loads(doc["answers"]), doc["metric"])}


def _dataset_function(task: str):
    def make(**kwargs):
        return dataset(task, **kwargs)

    make.__name__ = f"{task}_dataset"
    return make


for _task in TASKS:  # niah_single_1_dataset, ... as the task files name them
    globals()[f"{_task}_dataset"] = _dataset_function(_task)
