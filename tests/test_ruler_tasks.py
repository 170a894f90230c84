"""The generated RULER-style suite (hf_kvcache.evaluation.ruler): every task at a tiny size, seeded, within its token
length, its answers in its context, scored as RULER scores; and one run of the protocol through a cache."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_model
from test_generation_modes import tiny_chat_tokenizer

from hf_kvcache import KVzipCache
from hf_kvcache.evaluation.ruler import TASKS, make_sample, score
from hf_kvcache.evaluation.ruler.haystack import weave
from hf_kvcache.evaluation.ruler.protocol import prompt_parts, run_sample

TOKENIZER = tiny_chat_tokenizer()  # one token per character: lengths are exact and small prompts still hold a task


def _tokens(text: str) -> int:
    return len(TOKENIZER(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_task_fits_its_length_holds_its_answers_and_is_seeded(task):
    length = 6000 if task == "cwe" else 3000  # (characters here: the common words alone are ~2K)
    sample = make_sample(task, length, seed=1, tokenizer=TOKENIZER)
    total = _tokens(sample.context + sample.question + sample.answer_prefix)
    assert length * 0.8 <= total <= length  # filled to the length, never over it
    assert sample.answers and sample.metric in ("all", "part")
    if task == "fwe":  # the three most frequent coded words, counted in the context
        assert all(sample.context.count(w) >= count for w, count in zip(sample.answers, sample.meta["top_counts"]))
    else:
        assert all(answer in sample.context for answer in sample.answers)
    assert sample.to_dict() == make_sample(task, length, seed=1, tokenizer=TOKENIZER).to_dict()
    assert make_sample(task, length, seed=2, tokenizer=TOKENIZER).answers != sample.answers


def test_needles_sit_at_their_depths_and_distractors_are_there():
    sample = make_sample("niah_multikey_1", 4000, seed=3, tokenizer=TOKENIZER)
    keys, asked = sample.meta["keys"], sample.meta["asked"]
    assert len(keys) == 4 and asked == keys[:1]
    assert all(f"for {key} is:" in sample.context for key in keys)  # three distractor needles
    assert weave(["a", "b", "c", "d"], ["X", "Y"], [0.0, 0.5]) == "X a b Y c d"


def test_ruler_string_match():
    assert score("The numbers are 123 and 456.", ["123", "456", "789"], "all") == pytest.approx(2 / 3)
    assert score("it is LYON", ["Lyon"], "part") == 1.0
    assert score("no idea", ["Lyon", "Oslo"], "part") == 0.0
    with pytest.raises(ValueError, match="`metric` must be one of"):
        score("x", ["x"], "exact")


def test_bad_task_and_length_name_the_parameter():
    with pytest.raises(ValueError, match="`task` must be one of"):
        make_sample("niah_single_9", 2048, 0, TOKENIZER)
    with pytest.raises(ValueError, match="`context_len` must be an integer >= 256"):
        make_sample("vt", 100, 0, TOKENIZER)
    with pytest.raises(ValueError, match="does not fit in"):
        make_sample("cwe", 400, 0, TOKENIZER)


def test_protocols_put_the_question_where_they_say():
    sample = make_sample("niah_single_1", 1500, seed=0, tokenizer=TOKENIZER)
    agnostic, tail = prompt_parts(sample, "agnostic")
    aware, _ = prompt_parts(sample, "aware")
    assert agnostic == sample.context and tail == sample.question + sample.answer_prefix
    assert aware.startswith(sample.question.strip()) and aware.endswith(sample.context)
    with pytest.raises(ValueError, match="`protocol` must be one of"):
        prompt_parts(sample, "blind")


def test_a_sample_runs_through_a_compressing_cache():
    """The agnostic protocol through KVzip: the context is compressed before the question (end_prompt), the answer is
    generated and scored; the cache held the budget plus the question and answer."""
    model = build_model("llama", vocab_size=TOKENIZER.vocab_size)
    sample = make_sample("qa_records_code", 600, seed=0, tokenizer=TOKENIZER)
    cache = KVzipCache(model, budget=0.25, tokenizer=TOKENIZER, head_budget="uniform", layer_budget="uniform")
    result = run_sample(model, TOKENIZER, sample, cache)
    assert 0.0 <= result["score"] <= 1.0 and result["answers"] == sample.answers
    context = len(TOKENIZER(sample.context, add_special_tokens=False).input_ids)
    layer = cache.layers[0]
    held = int(layer.slot_valid[0, 0, : layer.used].sum())
    assert held == round(0.25 * context) + result["prompt_tokens"] - context + sample.max_new_tokens - 1
    assert torch.isfinite(torch.tensor(result["score"]))


def test_the_board_runs_resumes_and_summarizes(tmp_path):
    from hf_kvcache.evaluation.cache_spec import make_cache
    from hf_kvcache.evaluation.ruler.board import Method, jobs, plot_board, run_board, summarize

    model = build_model("llama", vocab_size=TOKENIZER.vocab_size)
    methods = [
        Method("SnapKV prompt", "snapkv", {"compress": "prompt", "window": 4}),
        Method("StreamingLLM prompt", "sink", {"sinks": 2, "compress": "prompt"}, budget_key="window"),
        Method("FP8", "fp8", {}, budget_key=None),
    ]
    plan = dict(
        compressions=[0.0, 0.5],
        protocols=["agnostic"],
        tasks=["niah_single_1", "qa_records_code"],
        lengths=[600],
        samples=2,
    )
    build = lambda name, config, context: make_cache(model, name, config, context)
    path = run_board(model, TOKENIZER, build, methods, out=tmp_path, **plan)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 2 * 2 * (1 + 2 + 1)  # tasks x seeds x (full + two budgets at 50% + FP8 at its ratio)
    assert {r["config"].get("window") for r in records if r["cache"] == "sink"} == {0.5}  # (of the context's tokens)
    fp8 = [r for r in records if r["method"] == "FP8"]
    # measured: 1 byte codes + a scale per token and head against float32 keys and values
    assert {r["point"] for r in fp8} == {"fixed"} and all(0.6 < r["compression"] < 0.75 for r in fp8)
    run_board(model, TOKENIZER, build, methods, out=tmp_path, **plan)  # resumed: nothing to do
    assert len(path.read_text().splitlines()) == len(records)
    text = path.read_text()
    path.write_text(text[: len(text) - 40])  # killed while writing the last answer: it is run again
    run_board(model, TOKENIZER, build, methods, out=tmp_path, **plan)
    assert [json.loads(line)["key"] for line in path.read_text().splitlines()] == [r["key"] for r in records]
    summary = summarize(path)
    assert len(summary["cells"]) == 2 * 4 and all(c["n"] == 2 for c in summary["cells"])
    board = {(r["method"], r["compression"]): r for r in summary["board"]}
    fp8_mean = sum(r["compression"] for r in fp8) / len(fp8)
    assert set(board) == {("full", 0.0), ("SnapKV prompt", 0.5), ("StreamingLLM prompt", 0.5), ("FP8", fp8_mean)}
    cells = [c for c in summary["cells"] if c["method"] == "full"]
    assert board[("full", 0.0)]["score"] == pytest.approx(sum(c["score"] for c in cells) / 2)
    plot_board(summary["board"], tmp_path / "board.png", "tiny")
    assert (tmp_path / "board.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="`compressions`: each must be in"):
        list(jobs(methods, [1.0], ["agnostic"], ["vt"], [600], 1))


def test_the_ruler_command_names_a_bad_task(capsys):
    from hf_kvcache.cli.app import main

    assert main(["ruler", "--tasks", "niah_single_9"]) == 2
    assert "--tasks: ['niah_single_9'] are not tasks" in capsys.readouterr().err


def test_only_and_exclude_select_the_full_cache_by_its_label(monkeypatch):
    """`--only KVzip KIVI` runs those two alone: the full cache (compression 0) is the method labelled "full", so
    processes split by method (eval/ruler_offline_gpu.sh: `--exclude KVzip KIVI` beside `--only KVzip KIVI`) run it
    once; `--only full` runs it alone; a filter that leaves nothing names every label, "full" included."""
    from hf_kvcache.cli.app import main
    from hf_kvcache.cli.ruler_command import select_methods
    from hf_kvcache.evaluation.ruler import board
    from hf_kvcache.evaluation.ruler.board import DEFAULT_METHODS, FULL_LABEL
    from hf_kvcache.sharing import models

    every = [m.label for m in DEFAULT_METHODS]
    left, full = select_methods(DEFAULT_METHODS, ["KVzip", "KIVI"], [])
    assert ([m.label for m in left], full) == (["KVzip (model-wide)", "KIVI int4"], False)
    left, full = select_methods(DEFAULT_METHODS, [], ["KVzip", "KIVI"])
    assert ([m.label for m in left], full) == ([x for x in every if x not in ("KVzip (model-wide)", "KIVI int4")], True)
    assert select_methods(DEFAULT_METHODS, [FULL_LABEL], []) == ([], True)
    assert select_methods(DEFAULT_METHODS, [], [FULL_LABEL]) == (DEFAULT_METHODS, False)
    with pytest.raises(ValueError, match=r"no method left of \[.*'KIVI int4', 'full'\]"):
        select_methods(DEFAULT_METHODS, ["NoSuchMethod"], [])

    planned = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # (the command sets it: not for the later tests)
    monkeypatch.setattr(models, "load_model", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(
        board,
        "run_board",
        lambda model, tok, build, methods, compressions, *args, **kwargs: planned.append(
            ([m.label for m in methods], compressions)
        ),
    )
    for flags, full_runs in ((["--only", "KVzip", "KIVI"], False), (["--exclude", "KVzip", "KIVI"], True)):
        assert main(["ruler", "--shard", "0/2", "--quiet", *flags]) == 0
        methods, compressions = planned.pop()
        assert (0.0 in compressions) is full_runs and [c for c in compressions if c] == [0.25, 0.5, 0.75, 0.9]
        assert ("KIVI int4" in methods) is not full_runs


def _same_tail(task, length, seeds, count):
    """`count` samples of `task` whose question + answer prefix have one token length (a batch of them)."""
    from hf_kvcache.evaluation.ruler.protocol import tail_length

    by_tail = {}
    for seed in seeds:
        sample = make_sample(task, length, seed, TOKENIZER)
        by_tail.setdefault(tail_length(TOKENIZER, sample), []).append(sample)
    return max(by_tail.values(), key=len)[:count]


@pytest.mark.parametrize(
    "name, config",
    [
        ("dynamic", {}),
        ("snapkv", {"compress": "prompt", "budget": 150, "window": 4}),
        ("h2o", {"compress": "always", "budget": 150}),
        ("sink", {"sinks": 2, "window": 150}),
        ("kvzip", {"budget": 150, "head_budget": "adaptive", "layer_budget": "uniform"}),
        ("fp8", {}),
    ],
)
def test_a_batch_answers_each_sample_as_alone(name, config):
    """run_batch left-pads the contexts (of different token lengths) and feeds the equal-length tails: every row's
    answer is the one its sample gets alone through the same cache. (Not so for KIVI, whose token blocks follow the
    padded stream, nor for KVzip's model-wide layer shares, averaged over the rows: the board runs those alone.)"""
    from hf_kvcache.evaluation.cache_spec import make_cache
    from hf_kvcache.evaluation.ruler.protocol import run_batch

    model = build_model("llama", vocab_size=TOKENIZER.vocab_size)
    if name == "kvzip":
        config = {**config, "tokenizer": TOKENIZER}
    samples = _same_tail("niah_single_2", 600, range(12), 3)
    contexts = {_tokens(s.context) for s in samples}
    assert len(samples) == 3 and len(contexts) > 1  # padding really happens
    batched = run_batch(model, TOKENIZER, samples, make_cache(model, name, config))
    for sample, row in zip(samples, batched):
        alone = run_sample(model, TOKENIZER, sample, make_cache(model, name, config))
        assert row == alone


def test_a_batch_refuses_tails_of_different_lengths():
    from hf_kvcache.evaluation.ruler.protocol import run_batch, tail_length

    samples = [make_sample("niah_single_2", 600, seed, TOKENIZER) for seed in range(6)]
    assert len({tail_length(TOKENIZER, s) for s in samples}) > 1
    model = build_model("llama", vocab_size=TOKENIZER.vocab_size)
    with pytest.raises(ValueError, match="one token length in a batch"):
        run_batch(model, TOKENIZER, samples, None)


def test_the_board_in_batches_and_shards_writes_what_one_process_writes(tmp_path):
    """Two shards with batches of 4 answer the same jobs as one unbatched process, with the same scores; a failing
    cache is recorded in errors.jsonl under `keep_going` and the run goes on."""
    from hf_kvcache.evaluation.cache_spec import make_cache
    from hf_kvcache.evaluation.ruler.board import Method, load_samples, records, result_files, run_board, summarize

    model = build_model("llama", vocab_size=TOKENIZER.vocab_size)
    methods = [
        Method("SnapKV prompt", "snapkv", {"compress": "prompt", "window": 4}),
        Method("H2O always", "h2o", {"compress": "always"}),
        Method("KIVI", "kivi", {"group_size": 16}, budget_key=None, batchable=False),
    ]
    plan = dict(compressions=[0.0, 0.5], protocols=["agnostic"], tasks=["qa_records_code"], lengths=[600], samples=5)
    build = lambda name, config, context: make_cache(model, name, config, context)
    one = run_board(model, TOKENIZER, build, methods, out=tmp_path / "one", **plan)
    for i in range(2):
        run_board(model, TOKENIZER, build, methods, out=tmp_path / "two", batch_size=4, shard=(i, 2), **plan)
    assert [p.name for p in result_files(tmp_path / "two")] == ["results.0of2.jsonl", "results.1of2.jsonl"]
    # the samples are made once: shard 0 wrote them all (its cells cover every seed), shard 1 read them back
    assert len(load_samples(tmp_path / "two")) == 5 and not (tmp_path / "two" / "samples.1of2.jsonl").exists()
    assert load_samples(tmp_path / "two")["qa_records_code", 600, 3] == make_sample(
        "qa_records_code", 600, 3, TOKENIZER
    )
    alone = {r["key"]: r for r in records(one)}
    batched = {r["key"]: r for r in records(tmp_path / "two")}
    assert set(batched) == set(alone) and len(alone) == 5 * 4
    assert max(r["batch"] for r in batched.values()) > 1
    assert {r["batch"] for r in batched.values() if r["method"] == "KIVI"} == {1}
    # the batch's budget is its mean context's: rows then keep the same number of tokens as alone, up to rounding
    for key, r in batched.items():
        if r["budget_context"] == alone[key]["budget_context"]:
            assert r["output"] == alone[key]["output"], key
    assert summarize(tmp_path / "two")["board"][0]["samples"] == 5

    def failing(name, config, context):
        if name == "h2o":
            raise RuntimeError("no kernel for this device")
        return build(name, config, context)

    run_board(model, TOKENIZER, failing, methods, out=tmp_path / "err", batch_size=5, keep_going=True, **plan)
    errors = [json.loads(line) for line in (tmp_path / "err" / "errors.jsonl").read_text().splitlines()]
    assert {e["method"] for e in errors} == {"H2O always"} and errors[0]["error"].startswith("RuntimeError")
    assert {r["method"] for r in records(tmp_path / "err")} == {"full", "SnapKV prompt", "KIVI"}
    with pytest.raises(RuntimeError, match="no kernel"):
        run_board(model, TOKENIZER, failing, methods, out=tmp_path / "raise", **plan)


def test_a_batch_out_of_device_memory_runs_as_halves(tmp_path, monkeypatch):
    from hf_kvcache.evaluation.cache_spec import make_cache
    from hf_kvcache.evaluation.ruler import board

    real = board.run_batch

    def small_device(model, tokenizer, samples, cache, protocol):
        if len(samples) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, tokenizer, samples, cache, protocol)

    monkeypatch.setattr(board, "run_batch", small_device)
    model = build_model("llama", vocab_size=TOKENIZER.vocab_size)
    board.run_board(
        model,
        TOKENIZER,
        lambda name, config, context: make_cache(model, name, config, context),
        [],
        [0.0],
        ["agnostic"],
        ["qa_records_code"],
        [600],
        5,
        tmp_path,
        batch_size=5,
    )
    rows = board.records(tmp_path)
    assert sorted(r["seed"] for r in rows) == list(range(5)) and max(r["batch"] for r in rows) == 2


def test_the_protocol_keeps_generate_from_compiling_by_itself(monkeypatch):
    """On CUDA, transformers' generate compiles the forward whenever the cache is compileable, recompiling per batch
    size: the protocol turns that off (it measures answers, not speed)."""
    model = build_model("llama", vocab_size=TOKENIZER.vocab_size)
    seen = {}
    real = model.generate

    def generate(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", generate)
    run_sample(model, TOKENIZER, make_sample("qa_records_code", 600, 0, TOKENIZER), None)
    assert seen["disable_compile"] is True
