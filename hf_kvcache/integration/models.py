"""Model facts transformers keeps in private attributes or internal modules.

- Tensor parallelism (`from_pretrained(..., tp_plan="auto")` / `distributed_config`): the sharded model records its
  group size in `model._tp_size` and its device mesh in `model._device_mesh` (a "tp" dimension when named).
- RoPE: `modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, device[, layer_type=...])` returns the inverse
  frequencies (and attention factor) a model's rotary embedding is built with (hf_kvcache.rope re-rotates sink
  keys with them).
- Heterogeneous configs (`integrations.heterogeneity`, Gemma 4: its full-attention layers have their own head_dim
  and KV heads): `config.is_heterogeneous`, and `config.per_layer_config[i]` is layer i's view of the config (the
  global value of a per-layer attribute raises instead).
"""

from __future__ import annotations

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .contracts import contract, parameters, require

TP_ATTRIBUTES = "PreTrainedModel._tp_size / _device_mesh"
ROPE = "modeling_rope_utils.ROPE_INIT_FUNCTIONS"
PER_LAYER_CONFIG = "PreTrainedConfig.is_heterogeneous / per_layer_config"


@contract(
    TP_ATTRIBUTES,
    "a model sharded by transformers' tensor parallelism records _tp_size and _device_mesh",
    "hf_kvcache caches under tensor parallelism",
)
def _check_tp() -> str | None:
    from transformers import PreTrainedModel

    missing = [name for name in ("_tp_size", "_device_mesh") if not hasattr(PreTrainedModel, name)]
    return f"PreTrainedModel has no {missing}" if missing else None


@contract(
    ROPE,
    "a dict rope_type -> init function (config, device, layer_type=...) -> (inv_freq, attention factor)",
    "sink re-rotation (SinkCache, composite sinks)",
)
def _check_rope() -> str | None:
    if not isinstance(ROPE_INIT_FUNCTIONS, dict) or "linear" not in ROPE_INIT_FUNCTIONS:
        return "ROPE_INIT_FUNCTIONS is not a dict with 'linear'"
    fn = ROPE_INIT_FUNCTIONS["linear"]
    if parameters(fn)[:2] != ["config", "device"]:
        return f"its functions take {parameters(fn)}, expected (config, device, ...)"
    return None


@contract(
    PER_LAYER_CONFIG,
    "a config says `is_heterogeneous`, and `per_layer_config[i]` reads layer i's attributes "
    "(head_dim, num_key_value_heads, ...) where they differ by layer",
    "every hf_kvcache cache on Gemma 4",
)
def _check_per_layer_config() -> str | None:
    from transformers import PreTrainedConfig

    missing = [name for name in ("is_heterogeneous", "per_layer_config") if not hasattr(PreTrainedConfig, name)]
    return f"PreTrainedConfig has no {missing}" if missing else None


def layer_config(config, index: int):
    """Layer `index`'s view of `config`: its own attributes on a heterogeneous config, else the config itself."""
    if not getattr(config, "is_heterogeneous", False):
        return config
    require(PER_LAYER_CONFIG)
    return config.per_layer_config[index]


def tensor_parallel_size(model) -> int:
    return getattr(model, "_tp_size", None) or 1


def tensor_parallel_mesh(model):
    """The model's TP device mesh (its "tp" dimension when the mesh has named dimensions), or None."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is not None and "tp" in (getattr(mesh, "mesh_dim_names", None) or ()):
        mesh = mesh["tp"]
    return mesh


def rope_inverse_frequencies(rope_type: str, config, layer_type: str | None = None):
    """The inverse frequencies transformers initialises `rope_type` with for `config` (on the CPU)."""
    if rope_type not in ROPE_INIT_FUNCTIONS:
        return None
    fn = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, _ = fn(config, "cpu", layer_type=layer_type) if layer_type is not None else fn(config, "cpu")
    return inv_freq
