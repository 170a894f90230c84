"""Models with random weights in the shapes of published ones, built offline from the published config values (no
download, no weights to carry): what the GPU acceptance run's correctness and speed stages need, since neither
depends on trained weights (references are computed on the same random model; speed depends on shapes only).

    model = random_model("llama-3.1-8b", dtype=torch.bfloat16, device="cuda", layers=4)

`layers` keeps the first N layers of the published depth (speed per token scales with layers; the ratios to
DynamicCache barely move, and a lent GPU has minutes): the result's `config.num_hidden_layers` says how many.
Weights are drawn on the target device (`initializer_range` of the config), seeded.
"""

from __future__ import annotations

import torch

#: published config values (config.json of each model on the Hub), written here so nothing is downloaded
PUBLISHED: dict[str, dict] = {
    "smollm2-135m": dict(  # HuggingFaceTB/SmolLM2-135M-Instruct
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    ),
    "llama-3.1-8b": dict(  # meta-llama/Llama-3.1-8B
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen3-8b": dict(  # Qwen/Qwen3-8B
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
}


def published_config(name: str, layers: int | None = None, max_position_embeddings: int | None = None):
    """The transformers config of `name` (a key of PUBLISHED), with the first `layers` layers, attention `sdpa`;
    `max_position_embeddings` raised when a run needs longer contexts (Qwen3-8B publishes 40960)."""
    if name not in PUBLISHED:
        raise ValueError(f"`name` must be one of {sorted(PUBLISHED)}, got {name!r}.")
    values = dict(PUBLISHED[name])
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= values["num_hidden_layers"]:
            raise ValueError(
                f"`layers` must be an integer in [1, {values['num_hidden_layers']}] for {name}, got {layers!r}."
            )
        values["num_hidden_layers"] = layers
    if max_position_embeddings is not None and max_position_embeddings > values["max_position_embeddings"]:
        values["max_position_embeddings"] = max_position_embeddings
    from transformers import AutoConfig

    model_type = values.pop("model_type")
    rope = {"rope_theta": values.pop("rope_theta"), **values.pop("rope_scaling", {"rope_type": "default"})}
    config = AutoConfig.for_model(model_type, **values)
    _set_rope(config, rope)
    config._attn_implementation = "sdpa"
    return config


def _set_rope(config, rope: dict) -> None:
    """RoPE settings on the config: `rope_parameters` (transformers 5) or the older `rope_theta` / `rope_scaling`."""
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = dict(rope)
    else:  # pragma: no cover - transformers 4
        config.rope_theta = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            config.rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}


def random_model(
    name: str,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    layers: int | None = None,
    max_position_embeddings: int | None = None,
    seed: int = 0,
):
    """A causal LM of `name`'s published shape with seeded random weights in `dtype` on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    config = published_config(name, layers, max_position_embeddings)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def save_tiny(directory: str, name: str = "smollm2-135m", layers: int = 2) -> str:
    """A random `name` of `layers` layers with the offline SmolLM2's tokenizer, saved to `directory` (what the CPU
    run of the serve stage loads: `hf-kvcache serve-bench --model DIRECTORY`, seconds instead of minutes)."""
    from transformers import AutoTokenizer

    from hf_kvcache.sharing.models import convert_smollm2

    random_model(name, torch.float32, "cpu", layers=layers).save_pretrained(directory)
    AutoTokenizer.from_pretrained(str(convert_smollm2())).save_pretrained(directory)
    return directory


if __name__ == "__main__":
    import sys

    print(save_tiny(*sys.argv[1:2]))
