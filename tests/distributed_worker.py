"""What each rank runs for tests/test_distributed.py: our caches under transformers' own tensor parallelism.

    python -m torch.distributed.run --nproc-per-node N tests/distributed_worker.py MODELS_DIR CASES_JSON OUT_DIR

Under torchrun (WORLD_SIZE set) every rank loads each model MODELS_DIR/<case["model"]> the cases name with
`from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))` (transformers' own tensor parallelism:
the model's `base_model_tp_plan`, gloo on CPU, NCCL on GPUs), runs every case of CASES_JSON through greedy
`generate` and writes OUT_DIR/rank{R}.json. The single-process reference calls `run_cases` on a model loaded the
ordinary way, so both sides run exactly the same code.

A case is {"id", "model" (a subdirectory of MODELS_DIR), "cache" (a name of hf_kvcache.CACHE_IMPLEMENTATIONS or
"dynamic"), "config" (cache_config), "padded" (bool: left-pad the second row)}. Its result (`run_case`) holds what the
test checks: the generated tokens
and per-step logits, the cache's KV head count per layer (`layer.heads`, and dim 1 of every per-row tensor held by
the layer's store and policy), `cache.nbytes()`, the TP rank and size the cache read from the model and the global
index of each layer's first KV head (`cache.tensor_parallel`), or the error if generation raised. Nothing here asserts:
the test
does, against the single-process run.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

BATCH, PROMPT, NEW_TOKENS, PAD, VOCAB = 2, 24, 8, 0, 128
PADDED_SHORT_ROW = 18  # real tokens of the second row of a padded case


def prompt(padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ids [BATCH, PROMPT] (ids 2..VOCAB-1) and attention mask; `padded` left-pads the second row."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(2, VOCAB, (BATCH, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        ids[1, : PROMPT - PADDED_SHORT_ROW] = PAD
        mask[1, : PROMPT - PADDED_SHORT_ROW] = 0
    return ids, mask


def build_cache(model, case: dict):
    from transformers import DynamicCache

    import hf_kvcache

    if case["cache"] == "dynamic":
        return DynamicCache(config=model.config)
    return hf_kvcache.build_cache(case["cache"], model, case.get("config") or {})


def _tensors(obj, depth: int = 0, seen: set | None = None, skip: tuple[str, ...] = ()):
    """Every torch.Tensor reachable from `obj` through attributes (except those named in `skip`), dicts, lists and
    tuples (not inside tensors)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 5:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if isinstance(obj, dict):
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("hf_kvcache", "optimum", "hqq")):
        children = [value for name, value in vars(obj).items() if name not in skip]
    else:
        return
    for child in children:
        yield from _tensors(child, depth + 1, seen, skip)


def head_dims(obj, batch: int) -> list[int]:
    """Sorted distinct sizes of dim 1 of the per-row tensors ([batch or 2*batch, H, ...], 3-D or more) held by
    `obj`: for a store these are its KV heads; for a policy its heads or 1 (state shared by all heads)."""
    return sorted({t.shape[1] for t in _tensors(obj) if t.dim() >= 3 and t.shape[0] in (batch, 2 * batch)})


def describe_cache(cache, batch: int) -> dict:
    """KV heads of every layer of `cache` as the layer, its store and its policy see them, and its bytes."""
    from transformers import DynamicCache

    if isinstance(cache, DynamicCache):
        return {
            "heads": [layer.keys.shape[1] for layer in cache.layers],
            "store_heads": [sorted({layer.keys.shape[1], layer.values.shape[1]}) for layer in cache.layers],
            "policy_heads": [[] for _ in cache.layers],
            "nbytes": sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers),
        }
    tp = cache.tensor_parallel  # what the cache read from the model: rank and size of its TP group
    return {
        "heads": [layer.heads for layer in cache.layers],
        "store_heads": [head_dims(layer.store, batch) for layer in cache.layers],
        "policy_heads": [head_dims(layer.policy, batch) for layer in cache.layers],
        "nbytes": cache.nbytes(),
        "tensor_parallel": [tp.rank, tp.size],
        "head_offsets": [tp.head_offset(layer.heads) for layer in cache.layers],
    }


def run_case(model, case: dict) -> dict:
    """Greedy generation of NEW_TOKENS tokens with the case's cache; never raises (errors are reported)."""
    from hf_kvcache import cache_kwargs

    result = {"id": case["id"]}
    try:
        ids, mask = prompt(case.get("padded", False))
        cache = build_cache(model, case)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                **cache_kwargs(cache),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=PAD,
                output_scores=True,
                return_dict_in_generate=True,
            )
        result["tokens"] = out.sequences[:, PROMPT:].tolist()
        result["logits"] = torch.stack(out.scores, 1).float().tolist()  # [B, steps, vocab]
        result.update(describe_cache(cache, BATCH))
    except Exception as error:  # reported to the test, which asserts on it
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc()
    return result


def run_cases(model, cases: list[dict]) -> dict[str, dict]:
    return {case["id"]: run_case(model, case) for case in cases}


KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")


def sharding_facts(model) -> dict:
    """What transformers did to the model: TP size and the local rows of the first layer's key projection."""
    name, module = next((n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in KEY_PROJECTIONS)
    weight = module.weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return {
        "tp_size": getattr(model, "_tp_size", None) or 1,
        "key_projection": name,
        "key_projection_local_rows": local.shape[0],
        "key_projection_is_dtensor": type(weight).__name__ == "DTensor",
    }


def main(models_dir: str, cases_path: str, out_dir: str) -> None:
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import hf_kvcache  # noqa: F401  (registers the cache names)

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    with open(cases_path) as f:
        cases = json.load(f)
    report = {"models": {}, "cases": {}}
    for name in dict.fromkeys(case["model"] for case in cases):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.join(models_dir, name), dtype=torch.float32, distributed_config=DistributedConfig(tp_plan="auto")
        ).eval()
        report["models"][name] = sharding_facts(model)
        report["cases"].update(run_cases(model, [case for case in cases if case["model"] == name]))
    report["rank"], report["world"] = torch.distributed.get_rank(), torch.distributed.get_world_size()
    path = os.path.join(out_dir, f"rank{report['rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 4 or "WORLD_SIZE" not in os.environ:
        sys.exit("usage: python -m torch.distributed.run --nproc-per-node N distributed_worker.py MODEL_DIR CASES OUT")
    main(*sys.argv[1:])
