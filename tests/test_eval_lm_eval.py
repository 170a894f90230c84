"""The lm-eval adapter (`--model hf-kvcache`) against lm-eval's own `hf` model, on the local probe tasks."""

from __future__ import annotations

import pytest

lm_eval = pytest.importorskip("lm_eval")

from conftest import build_model  # noqa: E402
from eval_helpers import char_tokenizer  # noqa: E402

from hf_kvcache.evaluation.lm_eval_adapter import TASKS_DIR, HFKVCacheLM  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager, get_task_dict

    tok = char_tokenizer()
    model = build_model("llama", seed=4)
    ref = HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu")
    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"context_tokens": 90, "n_docs": 4})
    tasks = get_task_dict(["kvcache_passkey", "kvcache_records"], tm)
    for task in tasks.values():
        task.build_all_requests(limit=4, rank=0, world_size=1)
    return tok, model, ref, tasks


def _requests(task):
    return [inst for inst in task.instances]


def test_registered_with_lm_eval():
    from lm_eval.api.registry import get_model

    assert get_model("hf-kvcache") is HFKVCacheLM


@pytest.mark.parametrize("cache", ["dynamic", "hf_kvcache_full"])
def test_loglikelihoods_equal_hf_model_with_full_cache(setup, cache):
    tok, model, ref, tasks = setup
    requests = _requests(tasks["kvcache_passkey"])
    assert len(requests) == 16  # 4 documents x 4 choices
    expected = ref.loglikelihood(requests, disable_tqdm=True)
    ours = HFKVCacheLM(pretrained=model, tokenizer=tok, cache=cache, device="cpu")
    got = ours.loglikelihood(requests, disable_tqdm=True)
    assert [g for _, g in got] == [g for _, g in expected]
    diffs = [abs(a - b) for (a, _), (b, _) in zip(got, expected)]
    assert max(diffs) < 1e-4, diffs
    # several tokens per continuation (5 digits and a space): the continuation really runs through the cache
    assert all(len(tok(inst.args[1]).input_ids) == 6 for inst in requests)


def test_compressed_cache_changes_loglikelihoods(setup):
    tok, model, ref, tasks = setup
    requests = _requests(tasks["kvcache_passkey"])
    expected = ref.loglikelihood(requests, disable_tqdm=True)
    ours = HFKVCacheLM(
        pretrained=model, tokenizer=tok, cache="sink", cache_config='{"sinks": 2, "budget": 16}', device="cpu"
    )
    got = ours.loglikelihood(requests, disable_tqdm=True)
    assert max(abs(a - b) for (a, _), (b, _) in zip(got, expected)) > 0.1
    # decode_tail=0 is refused; a larger tail still agrees with the full cache
    with pytest.raises(ValueError, match="decode_tail"):
        HFKVCacheLM(pretrained=model, tokenizer=tok, cache="dynamic", decode_tail=0)
    tail = HFKVCacheLM(
        pretrained=model, tokenizer=tok, cache="dynamic", decode_tail=5, cont_chunk=3, prefill_chunk=17
    ).loglikelihood(requests, disable_tqdm=True)
    assert max(abs(a - b) for (a, _), (b, _) in zip(tail, expected)) < 1e-4


def test_generation_equals_hf_model_with_full_cache(setup):
    tok, model, ref, tasks = setup
    requests = _requests(tasks["kvcache_records"])
    for inst in requests:  # short generations for a fast test
        inst.arguments = (inst.arguments[0], {**inst.arguments[1], "max_gen_toks": 6, "until": ["}"]})
    expected = ref.generate_until(requests, disable_tqdm=True)
    got = HFKVCacheLM(pretrained=model, tokenizer=tok, cache="dynamic").generate_until(requests, disable_tqdm=True)
    assert got == expected and any(expected)
    sink = HFKVCacheLM(pretrained=model, tokenizer=tok, cache="sink", cache_config="sinks:2;budget:12")
    out = sink.generate_until(requests, disable_tqdm=True)
    assert len(out) == len(requests) and out != expected


def test_bad_cache_fails_before_loading():
    with pytest.raises(ValueError, match="unknown cache 'sinc'"):
        HFKVCacheLM(pretrained="/no/such/model", cache="sinc")
    with pytest.raises(ValueError, match="batch_size=1"):
        HFKVCacheLM(pretrained=build_model("llama"), tokenizer=char_tokenizer(), batch_size=4)


def test_records_task_scoring(setup):
    from hf_kvcache.evaluation.tasks.kvcache_utils import records_dataset, records_process_results

    doc = records_dataset(context_tokens=200, n_docs=1)["test"][0]
    right = doc["answer"]
    assert records_process_results(doc, [" " + right + "\nmore"]) == {
        "exact_match": 1,
        "json_parse": 1,
        "value_match": 1,
    }
    code = right.split('"code": ')[1].rstrip("}")
    assert records_process_results(doc, [f"The code is {code}."]) == {
        "exact_match": 0,
        "json_parse": 0,
        "value_match": 1,
    }
    assert records_process_results(doc, ['{"id": "XX-0000-00", "code": 1}'])["json_parse"] == 1
    assert records_process_results(doc, ['{"id": "XX-0000-00", "code": 1}'])["exact_match"] == 0


def test_the_generated_ruler_tasks_run_under_lm_eval():
    """One task file per generated task (kvcache_ruler_*, group kvcache_ruler); a task's generations through the
    full cache equal lm-eval's own `hf` model, and its score is RULER's string match."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager, get_task_dict

    from hf_kvcache.evaluation.ruler import TASKS
    from hf_kvcache.evaluation.tasks import ruler_utils

    assert {p.stem for p in TASKS_DIR.glob("kvcache_ruler_*.yaml")} == {f"kvcache_ruler_{t}" for t in TASKS}
    tok, model = char_tokenizer(), build_model("llama", seed=4)
    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"context_tokens": 256, "n_docs": 2})
    task = get_task_dict(["kvcache_ruler_qa_records_code"], tm)["kvcache_ruler_qa_records_code"]
    task.build_all_requests(limit=2, rank=0, world_size=1)
    requests = list(task.instances)
    for inst in requests:  # short generations for a fast test
        inst.arguments = (inst.arguments[0], {**inst.arguments[1], "max_gen_toks": 6})
    expected = HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu").generate_until(
        requests, disable_tqdm=True
    )
    got = HFKVCacheLM(pretrained=model, tokenizer=tok, cache="dynamic").generate_until(requests, disable_tqdm=True)
    assert got == expected and len(got) == 2
    doc = requests[0].doc
    answer = ruler_utils.json.loads(doc["answers"])[0]
    assert ruler_utils.process_results(doc, [f"it is {answer}"]) == {"score": 1.0}
    assert ruler_utils.process_results(doc, ["no idea"]) == {"score": 0.0}
