"""Retrieval probes: lengths, needle positions, distractors, scoring, and the prefill-then-question protocol."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_model
from eval_helpers import char_tokenizer
from transformers import DynamicCache

from hf_kvcache import SinkCache
from hf_kvcache.evaluation.retrieval import (
    PASSKEY_HEADER,
    RECORDS_HEADER,
    make_probe,
    run_probe,
    run_retrieval,
    score_answer,
    summarize,
)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.mark.parametrize("kind", ["passkey", "records"])
@pytest.mark.parametrize("length", [1500, 4000])
def test_probe_fits_the_length_and_places_the_needle(tok, kind, length):
    depths = {}
    for position in ("early", "middle", "late"):
        p = make_probe(kind, length, position, seed=1, tokenizer=tok)
        n = len(tok(p.prompt, add_special_tokens=False).input_ids)
        assert 0.85 * length <= n <= length, (n, length)
        needle = f"The pass key is {p.answer}" if kind == "passkey" else f'"id": "{p.meta["id"]}"'
        assert p.context.count(needle) == 1
        header = len(PASSKEY_HEADER if kind == "passkey" else RECORDS_HEADER)
        depths[position] = (p.context.index(needle) - header) / (len(p.context) - header)
        assert p.answer not in p.question
    assert depths["early"] < 0.2 < depths["middle"] < 0.6 < depths["late"], depths
    # deterministic for a seed, different across seeds
    assert make_probe(kind, length, "middle", 1, tok).prompt == make_probe(kind, length, "middle", 1, tok).prompt
    assert make_probe(kind, length, "middle", 2, tok).answer != make_probe(kind, length, "middle", 1, tok).answer


def test_records_have_distractors_sharing_name_date_and_near_ids():
    p = make_probe("records", 2048, "middle", seed=3)  # no tokenizer: ~4 characters per token
    lines = [json.loads(line) for line in p.context.splitlines() if line.startswith("{")]
    target = next(r for r in lines if r["id"] == p.meta["id"])
    assert len(lines) == p.meta["records"] and lines.index(target) == p.meta["index"]
    others = [r for r in lines if r is not target]
    assert sum(r["name"] == target["name"] for r in others) >= 3
    assert sum(r["date"] == target["date"] for r in others) >= 3
    near = [r for r in others if sum(a != b for a, b in zip(r["id"], target["id"])) == 1]
    assert len(near) >= 3
    assert len({r["id"] for r in lines}) == len(lines) and len({r["code"] for r in lines}) == len(lines)


def test_scoring():
    p = make_probe("records", 500, "early", seed=0)
    code, rid = p.meta["code"], p.meta["id"]
    assert score_answer(p, json.dumps({"id": rid, "code": code})) == {"exact": 1, "parsed": 1, "value_match": 1}
    assert score_answer(p, f'{{"id": "{rid}", "code": "{code}"}} trailing') == {
        "exact": 1,
        "parsed": 1,
        "value_match": 1,
    }
    assert score_answer(p, f'{{"id": "{rid}", "code": 1{code}}}')["exact"] == 0
    assert score_answer(p, f"{{'id': '{rid}', 'code': {code}}}") == {"exact": 0, "parsed": 0, "value_match": 1}
    assert score_answer(p, "no idea") == {"exact": 0, "parsed": 0, "value_match": 0}
    k = make_probe("passkey", 500, "late", seed=0)
    assert score_answer(k, f" {k.answer}. The")["exact"] == 1
    assert score_answer(k, f" 0{k.answer}")["exact"] == 0
    with pytest.raises(ValueError, match="Unknown position"):
        make_probe("passkey", 500, "start")
    with pytest.raises(ValueError, match="Unknown probe kind"):
        make_probe("needle", 500)


def test_question_goes_through_the_compressed_cache(tok):
    """The context is prefilled (and evicted down to the budget) before the question is fed: generation with the
    full cache equals plain `generate` on the whole prompt, and an evicting cache really changes the output."""
    model = build_model("llama", seed=2)
    p = make_probe("passkey", 400, "early", seed=0, tokenizer=tok)
    ids = tok(p.prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=8, do_sample=False)
    expected = tok.decode(plain[0, ids.shape[1] :])
    full = run_probe(model, tok, p, DynamicCache(config=model.config))
    assert full["output"] == expected and full["prompt_tokens"] == ids.shape[1]
    cache = SinkCache(model, sinks=2, budget=32)
    small = run_probe(model, tok, p, cache)
    assert cache.get_seq_length() == ids.shape[1] + 7 and cache.layers[0].used <= 32
    assert small["output"] != expected
    rows = run_retrieval(
        model,
        tok,
        lambda: DynamicCache(config=model.config),
        kinds=["passkey", "records"],
        context_lens=[300],
        positions=["early", "late"],
        samples=2,
    )
    assert len(rows) == 8
    summary = summarize(rows)
    assert {(s["kind"], s["position"], s["n"]) for s in summary} == {
        (k, pos, 2) for k in ("passkey", "records") for pos in ("early", "late")
    }


def test_records_probe_with_a_fixed_number_of_records_in_filler():
    from hf_kvcache.evaluation.retrieval import make_probe

    depths = {}
    for position in ("early", "middle", "late"):
        probe = make_probe("records", 4096, position, seed=1, n_records=20)
        assert probe.meta["records"] == 20
        from hf_kvcache.evaluation.retrieval import RECORDS_HEADER

        body = probe.context[len(RECORDS_HEADER) :]
        assert probe.context.startswith(RECORDS_HEADER) and body.count('"code": ') == 20
        assert len(probe.prompt) // 4 <= 4096  # fits (no tokenizer: ~4 characters per token)
        assert f'"id": "{probe.meta["id"]}"' in probe.context
        depths[position] = probe.context.index(f'"id": "{probe.meta["id"]}"') / len(probe.context)
    assert depths["early"] < 0.25 < depths["middle"] < 0.75 < depths["late"]
    with pytest.raises(ValueError, match="n_records"):
        make_probe("records", 4096, "early", n_records=1)
