"""Tiny, seeded, randomly initialised models of the architectures our users run, with their special features ON.

One function per architecture returns a fresh model in eval mode (float32 by default, `dtype=` for others), built
from a config written here (nothing is downloaded). Sizes: hidden 64, 4 query heads (2 KV heads where the
architecture has grouped-query attention), head size 16, 2 layers (one sliding and one full layer for hybrid
models), vocab 128. Sliding windows are 8 tokens, shorter than the test prompts, so sliding layers really slide.

`features(model)` describes what the built model actually has, read from its config and modules (not from what a
function meant to set), so the support matrix never claims a feature the model does not have. `ZOO` maps the
architecture id to its function; `attn_implementation(arch)` is the attention the matrix runs (sdpa, or eager
where the architecture does not support sdpa: Gemma 2 softcapping, GPT-OSS sinks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers
from conftest import COMMON as CONFTEST_COMMON

VOCAB = 128
PAD = 0
BOS = 1
WINDOW = 8  # sliding window of sliding layers (shorter than the prompts)

COMMON = {**CONFTEST_COMMON, "max_position_embeddings": 256}  # the unit tests' tiny shape, a shorter context
HYBRID = ["sliding_attention", "full_attention"]


def _build(config_cls, model_cls, seed: int, dtype: torch.dtype, drop=(), **overrides):
    kwargs = {**COMMON, **overrides}
    for key in drop:
        kwargs.pop(key, None)
    config = config_cls(**kwargs)
    attn = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if dtype != torch.float32:
        model = model.to(dtype)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = BOS
    return model


# -- one function per architecture ------------------------------------------------------------------------------
def llama(seed=0, dtype=torch.float32):
    """Llama 3.x: GQA, `llama3` RoPE frequency scaling."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return _build(
        transformers.LlamaConfig, transformers.LlamaForCausalLM, seed, dtype, head_dim=16, rope_parameters=rope
    )


def mistral(seed=0, dtype=torch.float32):
    """Mistral with `sliding_window` set (every layer slides; no layer_types)."""
    return _build(
        transformers.MistralConfig, transformers.MistralForCausalLM, seed, dtype, head_dim=16, sliding_window=WINDOW
    )


def ministral(seed=0, dtype=torch.float32):
    """Ministral: `sliding_window` set, layer_types derived by the config (sliding layers)."""
    return _build(
        transformers.MinistralConfig, transformers.MinistralForCausalLM, seed, dtype, head_dim=16, sliding_window=WINDOW
    )


def qwen2(seed=0, dtype=torch.float32):
    """Qwen2: GQA, q/k/v biases, no sliding window (as the released models)."""
    return _build(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, seed, dtype)


def qwen3(seed=0, dtype=torch.float32):
    """Qwen3: QK-norm, explicit head_dim."""
    return _build(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, seed, dtype, head_dim=16)


def qwen3_moe(seed=0, dtype=torch.float32):
    """Qwen3-MoE: QK-norm and sparse MoE MLPs (4 experts, top-2) in every layer."""
    return _build(
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        seed,
        dtype,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def gemma(seed=0, dtype=torch.float32):
    """Gemma: multi-query attention (1 KV head), scaled embeddings."""
    return _build(
        transformers.GemmaConfig, transformers.GemmaForCausalLM, seed, dtype, head_dim=16, num_key_value_heads=1
    )


def gemma2(seed=0, dtype=torch.float32):
    """Gemma 2: attention and final logit softcapping, sliding + full layers (eager: sdpa cannot softcap)."""
    return _build(
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        seed,
        dtype,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=HYBRID,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    )


def gemma3(seed=0, dtype=torch.float32):
    """Gemma 3 (text): sliding + full layers with their own RoPE bases (10K local, 1M global), QK-norm."""
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    }
    return _build(
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        seed,
        dtype,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=HYBRID,
        rope_parameters=rope,
    )


def gpt_oss(seed=0, dtype=torch.float32):
    """GPT-OSS: attention sinks, sliding + full layers, MoE (4 experts, top-2), YaRN RoPE (eager: sinks)."""
    rope = {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 8,
        "rope_theta": 150000.0,
    }  # 8 x 32 = max_position_embeddings
    return _build(
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        seed,
        dtype,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=HYBRID,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        rope_parameters=rope,
    )


def cohere2(seed=0, dtype=torch.float32):
    """Cohere2 (Command R7B / A): sliding layers with RoPE + full layers without positions, logit scale."""
    return _build(
        transformers.Cohere2Config,
        transformers.Cohere2ForCausalLM,
        seed,
        dtype,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=HYBRID,
        logit_scale=0.5,
    )


def phi3(seed=0, dtype=torch.float32):
    """Phi-3 / Phi-4-mini: fused qkv projection, partial rotary (75% of the head, as Phi-4-mini)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    return _build(transformers.Phi3Config, transformers.Phi3ForCausalLM, seed, dtype, rope_parameters=rope)


def olmo2(seed=0, dtype=torch.float32):
    """OLMo 2: QK-norm over the whole projection, post-norm blocks."""
    return _build(transformers.Olmo2Config, transformers.Olmo2ForCausalLM, seed, dtype)


def olmo3(seed=0, dtype=torch.float32):
    """OLMo 3: sliding + full layers, QK-norm."""
    return _build(
        transformers.Olmo3Config, transformers.Olmo3ForCausalLM, seed, dtype, sliding_window=WINDOW, layer_types=HYBRID
    )


def smollm3(seed=0, dtype=torch.float32):
    """SmolLM3: NoPE layers (every 2nd layer here has no RoPE)."""
    return _build(transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, seed, dtype, no_rope_layer_interval=2)


def deepseek_v3(seed=0, dtype=torch.float32):
    """DeepSeek-V3: MLA (q/kv LoRA ranks, key head 24 = 16 nope + 8 rope, value head 16), dense then MoE layer."""
    return _build(
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        seed,
        dtype,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        num_mtp_layers=0,
    )


def minicpm3(seed=0, dtype=torch.float32):
    """MiniCPM3: MLA (q/kv LoRA ranks, key head 24, value head 16), scaled embeddings and residuals."""
    return _build(
        transformers.MiniCPM3Config,
        transformers.MiniCPM3ForCausalLM,
        seed,
        dtype,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )


def granite(seed=0, dtype=torch.float32):
    """Granite 3: attention multiplier (replaces 1/sqrt(head_dim)), embedding and residual multipliers (Granite-3
    values; logits_scaling stays 1: with 8 these tiny logits would be near-uniform and the checks blind)."""
    return _build(
        transformers.GraniteConfig,
        transformers.GraniteForCausalLM,
        seed,
        dtype,
        attention_multiplier=0.0625,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
    )


def glm4(seed=0, dtype=torch.float32):
    """GLM-4: partial rotary (50%, interleaved halves), q/k/v biases, sandwich norms."""
    return _build(transformers.Glm4Config, transformers.Glm4ForCausalLM, seed, dtype, head_dim=16)


def starcoder2(seed=0, dtype=torch.float32):
    """Starcoder2: `sliding_window` set (as the released 3B/7B/15B), biases, LayerNorm."""
    return _build(transformers.Starcoder2Config, transformers.Starcoder2ForCausalLM, seed, dtype, sliding_window=WINDOW)


def gpt_neox(seed=0, dtype=torch.float32):
    """GPT-NeoX (Pythia): partial rotary (25%), parallel residual, no GQA."""
    return _build(
        transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, seed, dtype, drop=("num_key_value_heads",)
    )


def stablelm(seed=0, dtype=torch.float32):
    """StableLM 2: partial rotary (25%), per-head QK LayerNorm (as StableLM-2-12B)."""
    return _build(transformers.StableLmConfig, transformers.StableLmForCausalLM, seed, dtype, qk_layernorm=True)


def qwen3_next(seed=0, dtype=torch.float32):
    """Qwen3-Next: gated DeltaNet linear-attention layers (their recurrent and conv states stay transformers'
    layers) + gated full-attention layers with partial rotary (25%) and QK-norm, sparse MoE with a shared expert."""
    return _build(
        transformers.Qwen3NextConfig,
        transformers.Qwen3NextForCausalLM,
        seed,
        dtype,
        head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )


def lfm2(seed=0, dtype=torch.float32):
    """LFM2 (Liquid): short gated convolution layers (conv state: transformers' layer) + GQA attention layers with
    QK-norm."""
    return _build(
        transformers.Lfm2Config,
        transformers.Lfm2ForCausalLM,
        seed,
        dtype,
        head_dim=16,
        layer_types=["conv", "full_attention"],
        block_dim=64,
        block_ff_dim=128,
        conv_L_cache=3,
    )


def diffllama(seed=0, dtype=torch.float32):
    """DiffLlama: differential attention, two softmaxes over the same keys, its values regrouped into two halves
    after the cache update (so attention never sees the cached values as they are)."""
    return _build(transformers.DiffLlamaConfig, transformers.DiffLlamaForCausalLM, seed, dtype, head_dim=16)


def gemma4(seed=0, dtype=torch.float32):
    """Gemma 4 (text): a heterogeneous config (full layers with their own head_dim 32, sliding layers 16), proportional
    partial RoPE on full layers, per-layer input embeddings, and KV sharing: the last two layers attend to the keys
    and values of the last sliding and full layers before them (4 layers, so each type has a producer)."""
    return _build(
        transformers.Gemma4TextConfig,
        transformers.Gemma4ForCausalLM,
        seed,
        dtype,
        head_dim=16,
        global_head_dim=32,
        num_hidden_layers=4,
        sliding_window=WINDOW,
        layer_types=HYBRID * 2,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=16,
    )


def gemma3n(seed=0, dtype=torch.float32):
    """Gemma 3n (text): AltUp and Laurel blocks, per-layer input embeddings, QK-norm without value scale, and KV
    sharing: the last two layers attend to the keys and values of the last sliding and full layers before them."""
    return _build(
        transformers.Gemma3nTextConfig,
        transformers.Gemma3nForCausalLM,
        seed,
        dtype,
        head_dim=16,
        num_hidden_layers=4,
        sliding_window=WINDOW,
        layer_types=HYBRID * 2,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=16,
        altup_num_inputs=2,
        laurel_rank=8,
        activation_sparsity_pattern=[0.0] * 4,
    )


def nanochat(seed=0, dtype=torch.float32):
    """NanoChat: its RoPE turns the other way (rotate_half is (x2, -x1)), QK-norm without weights."""
    return _build(transformers.NanoChatConfig, transformers.NanoChatForCausalLM, seed, dtype, head_dim=16)


ZOO: dict[str, Callable[..., torch.nn.Module]] = {
    "llama": llama,
    "mistral": mistral,
    "ministral": ministral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "qwen3_moe": qwen3_moe,
    "gemma": gemma,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "gpt_oss": gpt_oss,
    "cohere2": cohere2,
    "phi3": phi3,
    "olmo2": olmo2,
    "olmo3": olmo3,
    "smollm3": smollm3,
    "deepseek_v3": deepseek_v3,
    "minicpm3": minicpm3,
    "granite": granite,
    "glm4": glm4,
    "starcoder2": starcoder2,
    "gpt_neox": gpt_neox,
    "stablelm": stablelm,
    "qwen3_next": qwen3_next,
    "lfm2": lfm2,
    "diffllama": diffllama,
    "gemma4": gemma4,
    "gemma3n": gemma3n,
    "nanochat": nanochat,
}


def build(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    return ZOO[arch](seed=seed, dtype=dtype)


# -- what the built model really has ----------------------------------------------------------------------------
def _rope_parameters(config) -> dict:
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type
        return rope
    return {"all": rope}


def features(model) -> list[str]:
    """Notable features of a built model, each read from its config or modules."""
    config = model.config
    out = []
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "kv_lora_rank", None):
        k_dim = getattr(config, "qk_head_dim", None) or (config.qk_nope_head_dim + config.qk_rope_head_dim)
        out.append(
            f"MLA (q/kv ranks {config.q_lora_rank}/{config.kv_lora_rank}, K head {k_dim} != V head "
            f"{config.v_head_dim}; cached: latent {config.kv_lora_rank} as keys, RoPE part "
            f"{config.qk_rope_head_dim} as values, 1 head)"
        )
    elif kv_heads == 1:
        out.append("MQA")
    elif kv_heads < heads:
        out.append(f"GQA {heads}/{kv_heads}")
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types is not None and "sliding_attention" in layer_types:
        kinds = "+".join(t.replace("_attention", "") for t in dict.fromkeys(layer_types))
        out.append(f"layers {kinds} (window {window})")
    elif layer_types is not None and set(layer_types) - {"full_attention"}:
        kinds = "+".join(t.replace("_attention", "") for t in dict.fromkeys(layer_types))
        others = "+".join(t.replace("_attention", "") for t in dict.fromkeys(layer_types) if t != "full_attention")
        out.append(f"layers {kinds} ({others} layers keep transformers' own state)")
    elif layer_types is None and window and getattr(config, "use_sliding_window", True):
        out.append(f"sliding window {window} (all layers)")
    ropes = _rope_parameters(config)
    types = {kind: r.get("rope_type", "default") for kind, r in ropes.items() if r}
    for _kind, rope_type in types.items():
        if rope_type != "default":
            out.append(f"RoPE {rope_type}")
    thetas = {kind: r.get("rope_theta") for kind, r in ropes.items() if r}
    if len(set(thetas.values())) > 1:
        out.append("RoPE bases " + "/".join(f"{k.replace('_attention', '')} {v:g}" for k, v in thetas.items()))
    partial = {r.get("partial_rotary_factor") for r in ropes.values() if r}
    partial.discard(None)
    partial.discard(1.0)
    if partial:
        out.append(f"partial rotary {min(partial):g}")
    no_rope = getattr(config, "no_rope_layers", None)
    if no_rope is not None and not all(no_rope):
        out.append(f"NoPE layers {[i for i, r in enumerate(no_rope) if not r]}")
    if type(config).__name__ == "Cohere2Config" and layer_types is not None and "full_attention" in layer_types:
        out.append("full layers without RoPE")  # Cohere2Attention applies RoPE on sliding layers only
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        out.append(
            f"softcapping (attn {getattr(config, 'attn_logit_softcapping', None)}, final "
            f"{getattr(config, 'final_logit_softcapping', None)})"
        )
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    params = {name.rsplit(".", 1)[-1] for name, _ in model.named_parameters()}
    if "sinks" in params:
        out.append("attention sinks")
    if {"q_norm", "k_norm"} <= names or {"q_layernorm", "k_layernorm"} <= names:
        out.append("QK-norm")
    experts = (
        getattr(config, "num_experts", None)
        or getattr(config, "num_local_experts", None)
        or getattr(config, "n_routed_experts", None)
    )
    if experts and "experts" in names:
        out.append(f"MoE {experts}x top-{config.num_experts_per_tok}")
    if getattr(config, "is_heterogeneous", False):
        dims = sorted({layer.head_dim for layer in config.per_layer_config})
        out.append(f"head_dim per layer {dims}")
    shared = getattr(config, "num_kv_shared_layers", 0)
    if shared:
        out.append(f"KV sharing (last {shared} layers reuse earlier layers' keys / values)")
    if type(config).__name__ == "NanoChatConfig":
        out.append("RoPE turning the other way")
    if type(config).__name__ == "DiffLlamaConfig":
        out.append("differential attention (values regrouped after the cache)")
    if getattr(config, "attention_multiplier", None) not in (None, 1.0):
        out.append(f"attention multiplier {config.attention_multiplier:g}")
    return out
