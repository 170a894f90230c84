"""Local lm-eval tasks built from hf_kvcache's retrieval probes: generated on the fly, nothing downloaded.

Lengths are approximate (about 4 characters per token, no tokenizer needed): pass `--metadata` to change them,
e.g. --metadata '{"context_tokens": 4096, "n_docs": 30}'. Metadata keys: context_tokens (default 1024), n_docs
(default 30), seed (default 0). Needle positions cycle through early, middle and late.
"""

from __future__ import annotations

import json
import random

import datasets

from hf_kvcache.evaluation.retrieval import POSITIONS, Probe, make_probe, score_answer

POS = list(POSITIONS)


def _docs(kind: str, context_tokens=1024, n_docs=30, seed=0, **_):
    docs = []
    for i in range(int(n_docs)):
        position = POS[i % len(POS)]
        p = make_probe(kind, int(context_tokens), position, int(seed) + i)
        doc = {
            "context": p.context,
            "question": p.question,
            "answer": p.answer,
            "position": position,
            "meta": json.dumps(p.meta),
        }
        if kind == "passkey":
            rng = random.Random(f"choices-{seed}-{i}")
            choices = {p.meta["key"]}
            while len(choices) < 4:
                choices.add(rng.randint(10000, 99999))
            choices = sorted(choices)
            doc["choices"] = [f" {c}" for c in choices]
            doc["label"] = choices.index(p.meta["key"])
        docs.append(doc)
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def passkey_dataset(**kwargs):
    return _docs("passkey", **kwargs)


def records_dataset(**kwargs):
    return _docs("records", **kwargs)


def records_process_results(doc, results):
    probe = Probe(
        "records", doc["context"], doc["question"], doc["answer"], doc["position"], 0.0, json.loads(doc["meta"])
    )
    text = results[0].strip().split("\n")[0]
    s = score_answer(probe, text)
    return {"exact_match": s["exact"], "json_parse": s["parsed"], "value_match": s["value_match"]}
