"""Retrieval probes, generated locally (no downloads), at a chosen context length and needle position.

- passkey: a 5-digit pass key stated once inside repeated filler text; the question asks for it. Exact match of the
  first number in the answer.
- records: N similar records, one line each (id, name, date, city, code); the question asks for the `code` of one
  record by its id, answered in strict JSON `{"id": "...", "code": NNNNN}`. Distractors share the target's name,
  its date, or an id that differs in one character. Metrics: JSON parse rate (the answer's first {...} parses and
  has both keys), exact match (the parsed id and code are the target's) and, for small models that do not keep
  to the format, value match (the first 5-digit number of the answer is the target's code).

The needle (pass key sentence or target record) sits at a depth of the context: early (10%), middle (50%), late
(90%), or any float in [0, 1].

Protocol (`run_probe`): the context is prefilled into the cache (one forward, or chunks of `prefill_chunk`) and
compressed; then the question is fed through the compressed cache and the answer generated greedily with
`model.generate(**cache_kwargs(cache))`. So the question never sees evicted tokens: this is the question-agnostic
setting (a real prompt cache compressed before the query arrives).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ..integration.cache_argument import cache_kwargs

__all__ = [
    "KINDS",
    "POSITIONS",
    "Probe",
    "make_probe",
    "passkey_probe",
    "records_probe",
    "run_probe",
    "run_retrieval",
    "score_answer",
]

POSITIONS = {"early": 0.1, "middle": 0.5, "late": 0.9}
KINDS = ("passkey", "records")

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_HEADER = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
FIRST = ["Maria", "John", "Aiko", "Omar", "Lena", "Carlos", "Priya", "Tom", "Fatima", "Ivan", "Chen", "Sara"]
LAST = ["Keller", "Smith", "Tanaka", "Haddad", "Novak", "Garcia", "Patel", "Brown", "Rossi", "Ivanova", "Wei", "Lind"]
CITIES = ["Lyon", "Osaka", "Cairo", "Quito", "Oslo", "Pune", "Perth", "Leeds", "Porto", "Graz", "Turku", "Malmo"]
RECORDS_HEADER = (
    "Below is a list of customer records, one per line. Each record has an id, a name, a date, a city and a code. "
    "Several records share names, dates or similar ids: match the id exactly.\n"
    'Answer with JSON only, in the form {"id": "<id>", "code": <code>}. For example, for a record with id '
    '"ZQ-1111-11" and code 12345 the answer is {"id": "ZQ-1111-11", "code": 12345}.\n\n'
)


@dataclass
class Probe:
    kind: str
    context: str  # everything before the question (prefilled and compressed)
    question: str  # fed through the compressed cache, then the answer is generated
    answer: str
    position: str
    depth: float
    meta: dict = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return self.context + self.question


def _depth(position) -> tuple[str, float]:
    if isinstance(position, str):
        if position not in POSITIONS:
            raise ValueError(f"Unknown position {position!r}; use one of {list(POSITIONS)} or a float in [0, 1].")
        return position, POSITIONS[position]
    depth = float(position)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"A needle depth must be in [0, 1], got {position!r}.")
    return f"{depth:.2f}", depth


def _counter(tokenizer) -> Callable[[str], int]:
    """Token count of a text: by the tokenizer, or ~4 characters per token without one."""
    if tokenizer is None:
        return lambda text: max(1, len(text) // 4)
    return lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)


def longest_fit(build: Callable[[int], str], most: int, budget: int, count: Callable[[str], int]) -> int:
    """The largest n in [1, most] with count(build(n)) <= budget, by binary search (build grows with n); 1 when even
    that does not fit (callers that must fit check it)."""
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(build(mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _fill(units: list[str], build: Callable[[list[str]], str], budget: int, count: Callable[[str], int]) -> list[str]:
    """Largest prefix of `units` whose built text fits `budget` tokens."""
    return units[: longest_fit(lambda n: build(units[:n]), len(units), budget, count)]


def passkey_probe(context_len: int, position="middle", seed: int = 0, tokenizer=None) -> Probe:
    """Pass key in filler text; the whole prompt (context + question) fits in `context_len` tokens."""
    name, depth = _depth(position)
    rng = random.Random(f"passkey-{seed}-{context_len}-{name}")
    key = rng.randint(10000, 99999)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question = "\nWhat is the pass key? The pass key is"
    count = _counter(tokenizer)
    budget = context_len - count(question) - 2
    per_unit = max(1, count(FILLER))
    units = [FILLER] * (budget // per_unit + 2)

    def build(fill: list[str]) -> str:
        at = int(round(depth * len(fill)))
        return PASSKEY_HEADER + "".join(fill[:at]) + needle + "".join(fill[at:])

    fill = _fill(units, build, budget, count)
    return Probe("passkey", build(fill), question, str(key), name, depth, {"key": key, "filler_units": len(fill)})


def record_line(r: dict) -> str:
    return (
        f'{{"id": "{r["id"]}", "name": "{r["name"]}", "date": "{r["date"]}", "city": "{r["city"]}", '
        f'"code": {r["code"]}}}\n'
    )


def make_records(rng: random.Random, n: int) -> tuple[list[dict], dict]:
    """`n` records; the target plus distractors sharing its name, date or a near-identical id."""

    def rid():
        return (
            f"{rng.choice('ABCDEFGHKLMNPRSTWXYZ')}{rng.choice('ABCDEFGHKLMNPRSTWXYZ')}-{rng.randint(1000, 9999)}-"
            f"{rng.randint(10, 99)}"
        )

    def date():
        return f"20{rng.randint(10, 24)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"

    used_codes, used_ids = set(), set()

    def code():
        while True:
            c = rng.randint(10000, 99999)
            if c not in used_codes:
                used_codes.add(c)
                return c

    def unique(make):
        while True:
            v = make()
            if v not in used_ids:
                used_ids.add(v)
                return v

    target = {
        "id": unique(rid),
        "name": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
        "date": date(),
        "city": rng.choice(CITIES),
        "code": code(),
    }
    out = []
    for i in range(n - 1):
        r = {
            "id": unique(rid),
            "name": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
            "date": date(),
            "city": rng.choice(CITIES),
            "code": code(),
        }
        kind = i % 4
        if kind == 0:
            r["name"] = target["name"]
        elif kind == 1:
            r["date"] = target["date"]
        elif kind == 2:  # the same id but one character

            def near():
                s = list(target["id"])
                j = rng.choice([k for k, ch in enumerate(s) if ch.isdigit()])
                s[j] = str((int(s[j]) + rng.randint(1, 9)) % 10)
                return "".join(s)

            r["id"] = unique(near)
        out.append(r)
    rng.shuffle(out)
    return out, target


def records_probe(
    context_len: int, position="middle", seed: int = 0, tokenizer=None, n_records: int | None = None
) -> Probe:
    """Similar records; the question asks for the code of the target record, in strict JSON.

    By default the context is all records (as many as fit). With `n_records`, exactly that many records (the target
    included) are spread evenly through filler text that fills the context, the target at the requested depth."""
    name, depth = _depth(position)
    rng = random.Random(f"records-{seed}-{context_len}-{name}")
    count = _counter(tokenizer)
    if n_records is not None:
        return _sparse_records_probe(context_len, name, depth, rng, count, n_records)
    line_tokens = max(
        1, count('{"id": "AB-1234-56", "name": "Maria Keller", "date": "2019-04-12", "city": "Lyon", "code": 12345}\n')
    )
    n = max(4, (context_len - count(RECORDS_HEADER)) // line_tokens + 4)
    records, target = make_records(rng, n)
    question = f'\nQuestion: what is the code of the record with id "{target["id"]}"? Answer with JSON only.\nAnswer: '
    budget = context_len - count(question) - 2

    def build(rs: list[dict]) -> str:
        at = int(round(depth * len(rs)))
        return RECORDS_HEADER + "".join(record_line(r) for r in rs[:at] + [target] + rs[at:])

    kept = _fill(records, build, budget, count)
    shown = kept[: int(round(depth * len(kept)))] + [target] + kept[int(round(depth * len(kept))) :]
    answer = json.dumps({"id": target["id"], "code": target["code"]})
    return Probe(
        "records",
        build(kept),
        question,
        answer,
        name,
        depth,
        {"id": target["id"], "code": target["code"], "records": len(shown), "index": shown.index(target)},
    )


def _sparse_records_probe(context_len: int, name: str, depth: float, rng: random.Random, count, n_records: int):
    if isinstance(n_records, bool) or not isinstance(n_records, int) or n_records < 2:
        raise ValueError(
            f"`n_records` must be an integer >= 2 (the target and at least one distractor), got {n_records!r}."
        )
    distractors, target = make_records(rng, n_records)
    at = int(round(depth * len(distractors)))
    shown = distractors[:at] + [target] + distractors[at:]
    question = f'\nQuestion: what is the code of the record with id "{target["id"]}"? Answer with JSON only.\nAnswer: '
    budget = context_len - count(question) - 2
    units = [FILLER] * (budget // max(1, count(FILLER)) + 2)

    def build(fill: list[str]) -> str:
        # record i goes before filler unit round((i + 0.5) * len(fill) / n): evenly spread, in order
        slots = [int(round((i + 0.5) * len(fill) / len(shown))) for i in range(len(shown))]
        parts, r = [RECORDS_HEADER], 0
        for u in range(len(fill) + 1):
            while r < len(shown) and slots[r] == u:
                parts.append(record_line(shown[r]))
                r += 1
            if u < len(fill):
                parts.append(fill[u])
        return "".join(parts)

    fill = _fill(units, build, budget, count)
    if count(build(fill)) > budget:
        raise ValueError(f"{n_records} records do not fit in {context_len} tokens.")
    answer = json.dumps({"id": target["id"], "code": target["code"]})
    return Probe(
        "records",
        build(fill),
        question,
        answer,
        name,
        depth,
        {
            "id": target["id"],
            "code": target["code"],
            "records": len(shown),
            "index": shown.index(target),
            "filler_units": len(fill),
        },
    )


def make_probe(
    kind: str, context_len: int, position="middle", seed: int = 0, tokenizer=None, n_records: int | None = None
) -> Probe:
    if kind == "passkey":
        return passkey_probe(context_len, position, seed, tokenizer)
    if kind == "records":
        return records_probe(context_len, position, seed, tokenizer, n_records)
    raise ValueError(f"Unknown probe kind {kind!r}; use one of {list(KINDS)}.")


_JSON = re.compile(r"\{[^{}]*\}")


def score_answer(probe: Probe, text: str) -> dict:
    """{"exact": 0/1, "parsed": 0/1} for a generated answer."""
    if probe.kind == "passkey":
        m = re.search(r"\d+", text)
        exact = int(bool(m) and m.group() == probe.answer)
        return {"exact": exact, "parsed": int(bool(m)), "value_match": exact}
    m = _JSON.search(text)
    parsed = None
    if m:
        try:
            parsed = json.loads(m.group())
        except json.JSONDecodeError:
            parsed = None
    ok = isinstance(parsed, dict) and "id" in parsed and "code" in parsed
    exact = ok and str(parsed["id"]) == probe.meta["id"] and str(parsed["code"]).strip() == str(probe.meta["code"])
    number = re.search(r"(?<![\d-])\d{5}(?![\d-])", text)  # lenient: the first 5-digit number, JSON or not
    return {
        "exact": int(bool(exact)),
        "parsed": int(ok),
        "value_match": int(bool(number) and number.group() == str(probe.meta["code"])),
    }


def split_prompt(probe: Probe, tokenizer=None, chat: bool = False) -> tuple[str, str]:
    """(context text, question text) as fed to the model. With `chat`, the probe is the user turn of the
    tokenizer's chat template (the template's head goes with the context, its tail with the question)."""
    if not chat:
        return probe.context, probe.question
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("`chat=True` needs a tokenizer with a chat template.")
    question = probe.question.rsplit("\nAnswer:", 1)[0]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": probe.context + question}], tokenize=False, add_generation_prompt=True
    )
    at = text.rindex(question)
    return text[:at], text[at:]


@torch.inference_mode()
def run_probe(
    model,
    tokenizer,
    probe: Probe,
    cache,
    max_new_tokens: int | None = None,
    prefill_chunk: int | None = None,
    chat: bool = False,
) -> dict:
    """Prefill the context into `cache`, feed the question through it, generate greedily; score the answer."""
    from .divergence import prefill

    device = next(model.parameters()).device
    context_text, question_text = split_prompt(probe, tokenizer, chat)
    ctx = tokenizer(context_text, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
    question = tokenizer(question_text, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
    prefill(model, ctx, cache, prefill_chunk)
    ids = torch.cat([ctx, question], 1)
    if max_new_tokens is None:
        max_new_tokens = 8 if probe.kind == "passkey" else 32
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        **cache_kwargs(cache),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    if probe.kind == "records":
        text = text.strip().split("\n")[0]
    return {**score_answer(probe, text), "output": text, "prompt_tokens": int(ids.shape[1])}


def run_retrieval(
    model,
    tokenizer,
    cache_factory: Callable[[], object],
    kinds=KINDS,
    context_lens=(2048,),
    positions=tuple(POSITIONS),
    samples: int = 3,
    seed: int = 0,
    prefill_chunk: int | None = None,
    chat: bool = False,
    progress: bool = False,
    n_records: int | None = None,
) -> list[dict]:
    """One row per (kind, context length, position, sample) with exact/parsed, the output and the probe's answer."""
    jobs = [(k, c, p, s) for k in kinds for c in context_lens for p in positions for s in range(samples)]
    if progress:
        from tqdm.auto import tqdm

        jobs = tqdm(jobs, desc="probes", leave=False)
    rows = []
    for kind, context_len, position, s in jobs:
        probe = make_probe(kind, context_len, position, seed + s, tokenizer, n_records)
        result = run_probe(model, tokenizer, probe, cache_factory(), prefill_chunk=prefill_chunk, chat=chat)
        rows.append(
            {
                "kind": kind,
                "context_len": context_len,
                "position": probe.position,
                "sample": s,
                "answer": probe.answer,
                **result,
            }
        )
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Exact-match and parse rates per (kind, context length, position)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kind"], r["context_len"], r["position"]), []).append(r)
    return [
        {
            "kind": k,
            "context_len": c,
            "position": p,
            "n": len(rs),
            "exact_match": sum(r["exact"] for r in rs) / len(rs),
            "parse_rate": sum(r["parsed"] for r in rs) / len(rs),
            "value_match": sum(r["value_match"] for r in rs) / len(rs),
        }
        for (k, c, p), rs in groups.items()
    ]


def probe_dict(probe: Probe) -> dict:
    return asdict(probe)
