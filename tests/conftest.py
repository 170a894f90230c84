"""Shared fixtures: tiny, seeded, randomly initialised decoder-only models (no Hub access, CPU, float32).

Weights use a larger init range than the transformers default so that attention is far from uniform: with the
default 0.02 every query attends almost uniformly and position or eviction bugs would hide under the tolerances.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

import hf_kvcache  # noqa: F401  (registers the cache names)
from hf_kvcache import cache_kwargs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers.logging.set_verbosity_error()
torch.set_num_threads(1)  # tiny models: threading overhead dominates on CPU

VOCAB = 128
PAD = 0

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=None,
    tie_word_embeddings=False,
)

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {}),
    # extra: partial rotary (25%), its own eager attention function; not in the default parametrization
    "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, {}),
}
ARCH_NAMES = ("llama", "qwen2", "qwen3", "mistral", "phi3")


def build_config(arch: str = "llama", attn: str = "sdpa", **overrides):
    config_cls, _, extra = ARCHS[arch]
    kwargs = {**COMMON, **extra, **overrides}
    if arch == "gpt_neox":
        kwargs.pop("num_key_value_heads")  # no grouped-query attention in GPT-NeoX
    config = config_cls(**kwargs)
    config._attn_implementation = attn
    return config


def build_model(arch: str = "llama", attn: str = "sdpa", seed: int = 0, **overrides):
    """A fresh tiny model of `arch`, deterministic for a given seed. Each call returns a new object, so tests that
    enable the attention bridge never leak that state into others."""
    _, model_cls, _ = ARCHS[arch]
    config = build_config(arch, attn, **overrides)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = 1
    return model


@pytest.fixture
def make_model():
    """Factory fixture: make_model(arch="llama", attn="sdpa", seed=0, **config_overrides)."""
    return build_model


@pytest.fixture(params=ARCH_NAMES)
def arch(request):
    return request.param


@pytest.fixture
def model(arch):
    return build_model(arch)


@pytest.fixture
def llama():
    return build_model("llama")


@pytest.fixture
def llama_eager():
    return build_model("llama", attn="eager")


def locked_version(package: str) -> str:
    """The version of `package` in requirements/lock.txt: the one `make test` installs and the docs are made with."""
    lock = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "requirements", "lock.txt")
    with open(lock, encoding="utf-8") as f:
        return next(line.split("==", 1)[1].strip() for line in f if line.startswith(f"{package}=="))


def skip_unless_locked_versions(doc: str) -> None:
    """Generated docs tables are compared on the lock's transformers and torch only: they quote messages and versions
    of those releases (the cache argument's name, the versions in the header). CI runs the full suite on the lock."""
    for package, installed in (("transformers", transformers.__version__), ("torch", torch.__version__)):
        locked = locked_version(package)
        if installed.split("+")[0] != locked:
            pytest.skip(f"{doc} is generated with the locked {package} {locked}; this is {installed}")


def offline_model(name: str):
    """(model, tokenizer) of an offline model ("smollm2", "gemma3": hf_kvcache.sharing.models), or the test skips
    saying what is missing."""
    from hf_kvcache.sharing.models import load_model

    try:
        return load_model(name)
    except (FileNotFoundError, ImportError) as error:
        pytest.skip(f"offline {name} not available: {error}")


def planted_surrogate(model, seed: int = 0):
    """A KVzap surrogate with random linear predictors shaped for `model` (its layers, the KV heads the cache holds,
    its hidden size): its predictions are what a KVzap cache must rank by."""
    from hf_kvcache.common.architecture import layer_kv_shape
    from hf_kvcache.scorers.kvzap_surrogate import Surrogate

    config = model.config.get_text_config()
    heads = layer_kv_shape(config, 0)[0]  # (1 for latent attention: the latent is one head)
    g = torch.Generator().manual_seed(seed)
    weights = {
        i: {"weight": torch.randn(heads, config.hidden_size, generator=g), "bias": torch.zeros(heads)}
        for i in range(config.num_hidden_layers)
    }
    return Surrogate("linear", weights, {"num_layers": config.num_hidden_layers, "model": "tiny"})


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Token ids avoiding the pad (0) and bos (1) ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch, length), generator=g)


def left_pad(rows: list[torch.Tensor], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D id tensors to a batch: (input_ids, attention_mask)."""
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.numel() :] = r
        mask[i, width - r.numel() :] = 1
    return ids, mask


def teacher_forced_logits(model, cache, ids, prompt: int, chunk: int | None = None) -> torch.Tensor:
    """Prefill `ids[:, :prompt]` into `cache` (in `chunk`-token forwards if given), then feed the rest one token per
    forward; the last-position logits of those one-token forwards, [B, len - prompt, vocab]."""
    logits = []
    with torch.no_grad():
        step = chunk or prompt
        for start in range(0, prompt, step):
            model(input_ids=ids[:, start : min(prompt, start + step)], **cache_kwargs(cache))
        for t in range(prompt, ids.shape[1]):
            logits.append(model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache)).logits[:, -1])
    return torch.stack(logits, 1)


def greedy_decode_syncs(model, cache, ids, mask, steps: int) -> list[dict]:
    """Prefill `ids` (left-padded, `mask`) into `cache`, then `steps` greedy one-token forwards; per decode step, the
    host-device syncs counted (`{op: count}`; empty when none)."""
    from hf_kvcache.evaluation.host_syncs import HostSyncCounter

    counts = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache))
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            mask = torch.cat((mask, torch.ones_like(mask[:, :1])), 1)
            with HostSyncCounter() as counter:
                out = model(
                    input_ids=token,
                    attention_mask=mask,
                    position_ids=(mask.cumsum(-1) - 1)[:, -1:],
                    **cache_kwargs(cache),
                )
            counts.append(dict(counter.by_name) if counter.syncs else {})
    return counts


def masked_step(model, cache, ids, mask):
    """A forward of `ids` [B, q] after the tokens of `mask`, position ids from the mask: (last logits, new mask)."""
    mask = torch.cat((mask, torch.ones_like(ids)), 1)
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache))
    return out.logits[:, -1], mask


def policy_free_nbytes(cache) -> int:
    """Bytes of every compressed layer's store, slot positions and validity: all a prompt-mode cache may hold once its
    prompt is compressed (no scores, stream indices, observation ring, query statistics, scorer state or key copies)."""
    return sum(
        layer.store.nbytes() + layer.slot_valid.nbytes + (0 if layer.slot_pos is None else layer.slot_pos.nbytes)
        for layer in cache.compressed_layers
    )


@pytest.fixture
def ids_factory():
    return random_ids
