"""hf_kvcache caches under transformers' own tensor parallelism: each rank's cache holds only its shard of KV heads.

    # GPUs (NCCL): one process per GPU; the model's own `base_model_tp_plan` shards q/k/v by head
    torchrun --nproc-per-node 4 examples/tensor_parallel.py --model Qwen/Qwen2.5-7B-Instruct \\
        --cache sink:budget=512 --cache h2o:budget=512 --prompt "Summarise the plot of Hamlet." --new-tokens 64

    # here, on CPU (gloo), with the default tiny random Llama (8 query heads, 4 KV heads): runs in seconds
    torchrun --nproc-per-node 2 examples/tensor_parallel.py --cache sink:budget=12 --compare

    # layers split over the GPUs of one process instead (accelerate's device_map, no torchrun)
    python examples/tensor_parallel.py --model Qwen/Qwen2.5-7B-Instruct --device-map auto --cache sink:budget=512

Every rank loads the model with `from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`
(the spelling of `tp_plan="auto"` that transformers 5.23 does not deprecate), runs greedy `generate` with each
`--cache` (`NAME` or `NAME:key=value,...`, names of `hf_kvcache.CACHE_IMPLEMENTATIONS` or "dynamic"; budgets in
tokens or fractions of the prompt such as 0.25) and prints, per rank, the KV heads each layer of its cache holds and
`cache.nbytes()`; rank 0 prints the generated tokens (text with a tokenizer). `--compare` also runs the same caches
in one process on rank 0 (the whole model on the CPU: small models only) and reports whether the tokens agree.
Without torchrun it runs in one process. See docs/distributed.md for what is sharded and what was checked.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_kvcache
from hf_kvcache import cache_kwargs
from hf_kvcache.cli.eval_commands import parse_cache
from hf_kvcache.evaluation.cache_spec import make_cache, resolve_config

TINY = "tiny"
DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny_model_dir() -> str:
    """A tiny random Llama (hidden 64, 8 query heads, 4 KV heads, 2 layers), the same weights on every rank."""
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="hf_kvcache_tiny_")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def distributed() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def load(path: str, dtype, tensor_parallel: bool, device_map: str | None = None):
    kwargs = {"dtype": DTYPES[dtype]}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if tensor_parallel:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto")
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def inputs(model, tokenizer, prompt: str | None, prompt_tokens: int) -> dict:
    if tokenizer is not None and prompt is not None:
        encoded = tokenizer(prompt, return_tensors="pt")
    else:  # no tokenizer (the tiny model) or no prompt: seeded random ids, the same on every rank
        g = torch.Generator().manual_seed(0)
        vocab = model.config.get_text_config(decoder=True).vocab_size
        ids = torch.randint(2, vocab, (1, prompt_tokens), generator=g)
        encoded = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return {k: v.to(model.device) for k, v in encoded.items()}


def kv_heads(cache) -> list[int]:
    """KV heads each layer of the cache holds (as the tensors it received say, not the config)."""
    if isinstance(cache, hf_kvcache.KVCache):
        return [layer.heads if layer.is_initialized else 0 for layer in cache.layers]
    return [layer.keys.shape[1] if layer.is_initialized else 0 for layer in cache.layers]


def devices(cache) -> list[str]:
    """The device each layer's cache allocated on (from the first keys it received)."""
    if isinstance(cache, hf_kvcache.KVCache):
        return [str(layer.device) if layer.is_initialized else "-" for layer in cache.layers]
    return [str(layer.keys.device) if layer.is_initialized else "-" for layer in cache.layers]


def nbytes(cache) -> int:
    if isinstance(cache, hf_kvcache.KVCache):
        return cache.nbytes()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


@torch.inference_mode()
def generate(model, batch: dict, name: str, config: dict, new_tokens: int):
    cache = make_cache(model, name, config, context_len=batch["input_ids"].shape[1])
    pad = model.generation_config.pad_token_id
    out = model.generate(
        **batch,
        **cache_kwargs(cache),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad if pad is not None else 0,
    )
    return out[:, batch["input_ids"].shape[1] :].cpu(), cache


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=TINY, help="model id or path (default: a tiny random Llama)")
    parser.add_argument(
        "--cache",
        action="append",
        help="NAME or NAME:key=value,... (repeatable; default: sink with budget = half the prompt, and dynamic)",
    )
    parser.add_argument("--prompt", default=None, help="prompt text (needs a tokenizer; default: random ids)")
    parser.add_argument("--prompt-tokens", type=int, default=24, help="length of the random prompt (default 24)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    parser.add_argument("--compare", action="store_true", help="also run one process on rank 0 and compare tokens")
    parser.add_argument(
        "--device-map",
        default=None,
        help="e.g. 'auto': split the layers over this process's "
        "devices (accelerate) instead of tensor parallelism; not under torchrun",
    )
    args = parser.parse_args(argv)
    if args.device_map is not None and distributed():
        parser.error("--device-map and tensor parallelism (torchrun) are mutually exclusive in transformers")
    if args.prompt_tokens < 1 or args.new_tokens < 1:
        parser.error("--prompt-tokens and --new-tokens must be >= 1")
    specs = [parse_cache(text)[1:] for text in (args.cache or ["sink:budget=0.5", "dynamic"])]
    for name, config in specs:  # fail fast, on every rank, before loading anything
        resolve_config(name, config, context_len=args.prompt_tokens, where=f"--cache {name}")

    transformers.logging.set_verbosity_error()
    path = tiny_model_dir() if args.model == TINY else args.model
    tokenizer = None if args.model == TINY else AutoTokenizer.from_pretrained(path)
    model = load(path, args.dtype, distributed(), args.device_map)
    rank = torch.distributed.get_rank() if distributed() else 0
    world = torch.distributed.get_world_size() if distributed() else 1
    batch = inputs(model, tokenizer, args.prompt, args.prompt_tokens)
    reference = load(path, args.dtype, False) if args.compare and rank == 0 else None

    for name, config in specs:
        tokens, cache = generate(model, batch, name, config, args.new_tokens)
        label = name + (":" + ",".join(f"{k}={v}" for k, v in config.items()) if config else "")
        where = f", devices {devices(cache)}" if args.device_map is not None else ""
        print(
            f"[rank {rank}/{world}] {label}: KV heads per layer {kv_heads(cache)}, nbytes {nbytes(cache)}{where}",
            flush=True,
        )
        if distributed():
            torch.distributed.barrier()
        if rank != 0:
            continue
        shown = tokenizer.decode(tokens[0], skip_special_tokens=True) if tokenizer is not None else tokens[0].tolist()
        print(f"  generated: {shown!r}")
        if reference is not None:
            single_batch = {k: v.to(reference.device) for k, v in batch.items()}
            single_tokens, single_cache = generate(reference, single_batch, name, config, args.new_tokens)
            same = torch.equal(tokens, single_tokens)
            print(
                f"  one process: KV heads {kv_heads(single_cache)}, nbytes {nbytes(single_cache)} (per rank / one "
                f"process = {nbytes(cache) / nbytes(single_cache):.4f}); tokens {'equal' if same else 'DIFFER'}"
            )
    if distributed():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
