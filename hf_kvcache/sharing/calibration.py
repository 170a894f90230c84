"""Static FP8 scales (and key channel means) from a calibration run, to publish with a model.

    scales = calibrate(model, tokenizer)                       # offline corpus, 2048 tokens in 512-token windows
                                                               # (scales of Hadamard-rotated keys, as the cache
                                                               # stores them by default, and of values)
    cache = QuantizedFP8Cache(model, granularity="head", scales=scales)
    save_calibrated_config("my-model", model, scales)          # kvcache_config.json next to the model
    # or: model.generation_config.cache_implementation = "fp8"
    #     model.generation_config.cache_config = {"granularity": "head", "scales": scales}; model.save_pretrained(...)

vLLM offers the same three choices for its FP8 KV cache: scale 1.0 (`calibrated_scales(..., 1.0)`), warm-up (our
"tensor"/"head" granularity without `scales`: the prompt's maximum), and dataset calibration (this module). The
scale of a KV head is margin * max|x| / fmax over the calibration text; later values beyond it saturate.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..common.rotation import ROTATIONS, rotation_matrix
from ..common.validation import require_choice
from ..integration.cache_argument import cache_kwargs
from ..stores.quantization import FP8_DTYPES

CALIBRATION_VERSION = 2  # 2: keys rotated by `key_rotation` (missing in version 1: 'none')


@torch.inference_mode()
def calibrate(
    model,
    tokenizer=None,
    input_ids: torch.Tensor | None = None,
    source: str = "pydoc",
    num_tokens: int = 2048,
    window: int = 512,
    format: str = "fp8_e4m3",
    key_smoothing: bool = False,
    margin: float = 1.0,
    key_rotation: str = "hadamard",
) -> dict[str, Any]:
    """Run `model` over sample text and return a JSON-serialisable calibration dict for `QuantizedFP8Cache(scales=...)`.

    Text: `input_ids` [batch, n] if given, else `num_tokens` tokens of `source`
    (hf_kvcache.sharing.corpus.load_text: "pydoc",
    a file path, or "hf:DATASET") tokenized with `tokenizer`. It runs in independent windows of `window` tokens.
    Per layer it records, per KV head, the largest |key| and |value| (key scales of the mean-subtracted keys when
    `key_smoothing`), and the mean key per channel, all of keys rotated by `key_rotation` (as the cache will store
    them: use the cache's setting, QuantizedFP8Cache's default is "hadamard")."""
    from transformers import DynamicCache

    key_rotation = require_choice("key_rotation", key_rotation, ROTATIONS)
    if format not in FP8_DTYPES:
        raise ValueError(f"`format` must be one of {tuple(FP8_DTYPES)}, got {format!r}.")
    if not (isinstance(margin, (int, float)) and margin > 0):
        raise ValueError(f"`margin` must be a positive number, got {margin!r}.")
    if input_ids is None:
        if tokenizer is None:
            raise ValueError("Give `input_ids` or a `tokenizer` (to tokenize the calibration text).")
        from .corpus import load_tokens

        input_ids = load_tokens(tokenizer, source, max_tokens=num_tokens)
        source_name = source
    else:
        source_name = "input_ids"
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"`input_ids` must be [batch, tokens], got shape {list(input_ids.shape)}.")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    rotation = None
    stats: list[dict[str, torch.Tensor]] | None = None
    for start in range(0, input_ids.shape[1], window):
        chunk = input_ids[:, start : start + window]
        cache = DynamicCache(config=model.config)
        model(input_ids=chunk, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        if stats is None:
            stats = [None] * len(cache.layers)
            rotation = rotation_matrix(key_rotation, cache.layers[0].keys.shape[-1])
        for i, layer in enumerate(cache.layers):
            k, v = layer.keys.float(), layer.values.float()  # [B, H, T, D]
            if rotation is not None:
                k = k @ rotation.to(k.device)
            entry = {
                "k_min": k.amin(dim=(0, 2)),
                "k_max": k.amax(dim=(0, 2)),
                "k_sum": k.sum(dim=(0, 2)),
                "v_amax": v.abs().amax(dim=(0, 2, 3)),
                "count": torch.tensor(k.shape[0] * k.shape[2]),
            }
            if stats[i] is None:
                stats[i] = entry
            else:
                s = stats[i]
                s["k_min"] = torch.minimum(s["k_min"], entry["k_min"])
                s["k_max"] = torch.maximum(s["k_max"], entry["k_max"])
                s["v_amax"] = torch.maximum(s["v_amax"], entry["v_amax"])
                s["k_sum"] += entry["k_sum"]
                s["count"] += entry["count"]
    fmax = torch.finfo(FP8_DTYPES[format]).max
    key_scale, value_scale, key_mean = [], [], []
    for s in stats:
        mean = s["k_sum"] / s["count"]  # [H, D]
        if key_smoothing:
            k_amax = torch.maximum((s["k_max"] - mean).abs(), (s["k_min"] - mean).abs()).amax(-1)
        else:
            k_amax = torch.maximum(s["k_max"].abs(), s["k_min"].abs()).amax(-1)
        tiny = torch.finfo(torch.float32).tiny
        key_scale.append((k_amax * margin / fmax).clamp(min=tiny).tolist())
        value_scale.append((s["v_amax"] * margin / fmax).clamp(min=tiny).tolist())
        key_mean.append(mean.tolist())
    heads, head_dim = stats[0]["k_min"].shape
    return {
        "version": CALIBRATION_VERSION,
        "format": format,
        "key_smoothing": key_smoothing,
        "key_rotation": key_rotation,
        "margin": float(margin),
        "num_tokens": int(input_ids.numel()),
        "source": source_name,
        "num_layers": len(stats),
        "num_kv_heads": int(heads),
        "head_dim": int(head_dim),
        "key_scale": key_scale,
        "value_scale": value_scale,
        "key_mean": key_mean,
    }


def calibrated_scales(
    model_or_config, scale: float = 1.0, format: str = "fp8_e4m3", key_rotation: str = "hadamard"
) -> dict[str, Any]:
    """The same constant scale for every layer and head (vLLM's default of 1.0 for checkpoints without scales), for
    a cache with this `key_rotation`."""
    key_rotation = require_choice("key_rotation", key_rotation, ROTATIONS)
    from ..caches.quantized import _text_config, model_dims

    layers, heads, head_dim = model_dims(_text_config(model_or_config))
    per_layer = [[float(scale)] * heads for _ in range(layers)]
    return {
        "version": CALIBRATION_VERSION,
        "format": format,
        "key_smoothing": False,
        "key_rotation": key_rotation,
        "num_layers": layers,
        "num_kv_heads": heads,
        "head_dim": head_dim,
        "key_scale": per_layer,
        "value_scale": [list(r) for r in per_layer],
    }


def save_calibrated_config(
    directory: str | os.PathLike, model_or_config, scales: dict[str, Any], **cache_config
) -> str:
    """Write kvcache_config.json for the "fp8" cache with these scales (load with hf_kvcache.load_cache_config),
    after checking that they fit `model_or_config` (layers, KV heads, head size)."""
    from ..caches.quantized import _text_config
    from .hub import save_cache_config

    cache_config = {"granularity": "head", **cache_config, "scales": scales}
    cache_config.setdefault("key_smoothing", bool(scales.get("key_smoothing", False)))
    cache_config.setdefault("key_rotation", scales.get("key_rotation", "none"))
    return save_cache_config(directory, "fp8", cache_config, model_config=_text_config(model_or_config))
