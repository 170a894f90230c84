"""Question answering over records (the JSON-records probe of hf_kvcache.evaluation.retrieval grown up): a table of
similar customer records, one per line, fills the context; the question asks one field of the record with a given
id. Distractors share the target's name or date, or have an id one digit away, so the answer needs the exact row.
Scored "part" (the field's value appears in the output), as RULER scores its QA tasks.
"""

from __future__ import annotations

from ..retrieval import CITIES, make_records, record_line
from .sample import Sample, fit, rng_for

VARIANTS = {"qa_records_city": "city", "qa_records_code": "code"}
HEADER = (
    "Below is a list of customer records, one per line. Each record has an id, a name, a date, a city and a "
    "code. Several records share names, dates or similar ids: match the id exactly.\n\n"
)


def qa_records(name: str, context_len: int, seed: int, count) -> Sample:
    field_name = VARIANTS[name]
    rng = rng_for(name, context_len, seed)
    records, target = make_records(rng, max(8, context_len // 20))
    depth = rng.random()
    question = f'\nQuestion: what is the {field_name} of the record with id "{target["id"]}"?'
    prefix = f' Answer: the {field_name} of the record with id "{target["id"]}" is'

    def build(n: int) -> str:
        shown = records[:n]
        at = int(round(depth * n))
        return HEADER + "".join(record_line(r) for r in shown[:at] + [target] + shown[at:])

    n = fit(build, len(records), context_len - count(question + prefix) - 2, count)
    return Sample(
        name,
        build(n),
        question,
        prefix,
        [str(target[field_name])],
        "part",
        max_new_tokens=12,
        meta={"records": n + 1, "depth": depth, "id": target["id"]},
        chance=1 / len(CITIES) if field_name == "city" else 0.0,
    )
