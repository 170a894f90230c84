"""Re-rotation of cached keys to new RoPE positions, per layer, with the model's own RoPE convention.

Keys arrive already rotated at their original positions. Rotations compose, so moving a key from position p to
position p' is one rotation by (p' - p); applied from the key as it arrived, it never accumulates error.

What a layer's keys carry depends on the architecture, and `KeyRotator` reads it from the config, per layer:
- whether the layer applies RoPE at all: `no_rope_layers[i] == 0` marks a NoPE layer (SmolLM3, Llama 4,
  Mistral Large 3); Cohere2 / Cohere2-MoE / EXAONE 4 apply RoPE only on their sliding layers (Cohere2-MoE also on
  "forced" dense layers), so the full-attention layers our caches compress have none. A layer without RoPE is the
  identity: its keys carry no position, and `rotate` returns them unchanged (no work, no copy).
- the RoPE parameters: the config's `rope_parameters`, or its entry for the layer's type when the config keeps one
  per type (Gemma 3, OLMo 3); frequencies from transformers' own init functions (`default` computed here, as each
  model's `compute_default_rope_parameters` does), on `partial_rotary_factor` of the head (the first dims).
- the pair convention: "half" pairs dims (i, i + r/2) of the r rotary dims (Llama and most models), "interleaved"
  pairs (2i, 2i + 1) (GLM / GLM-4, Cohere 1/2, Helium, ERNIE 4.5; `rotate_half` on x[..., 0::2], x[..., 1::2]).
  Pair i turns by position x inv_freq[i] in both conventions.

Only the layers our caches compress ("full_attention") get a plan; `rotate` refuses any other layer by name.

`check_rotator_against_model` is the safety net for what the config does not say: it runs the model itself on
one token at positions p and p + d and compares each compressed layer's keys with the rotator's. Caches built with
a model call it through `KeyRotator.check_cache` (once per model and rotator).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from ..integration.cache_argument import cache_kwargs
from ..integration.contracts import require
from ..integration.models import ROPE, rope_inverse_frequencies
from .architecture import COMPRESSED_TYPE, attention_head_dim, layer_plan, refuse_latent

logger = logging.getLogger(__name__)

# RoPE types whose inverse frequencies do not depend on the sequence length, so a delta rotation is exact.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")

CONVENTIONS = ("half", "interleaved")
#: model types whose RoPE pairs dims (2i, 2i + 1) (read from each modeling file's `rotate_half` /
#: `apply_rotary_pos_emb`); every other model type pairs (i, i + r/2).
INTERLEAVED_MODEL_TYPES = frozenset(
    {"glm", "glm4", "cohere", "cohere2", "cohere2_moe", "helium", "ernie4_5", "ernie4_5_moe"}
)

#: model types whose `rotate_half` is (x2, -x1), the opposite turn of everyone else's (-x2, x1): their keys turn by
#: -position x inv_freq, so the rotator's frequencies are negated (NanoChat)
NEGATED_TURN_MODEL_TYPES = frozenset({"nanochat"})


def _rope_on_sliding_layers_only(config, index: int, layer_type: str) -> bool | None:
    """Model types whose attention applies RoPE depending on the layer: True/False for them, None for the rest.

    cohere2, flint: `if self.sliding_window is not None` (set only on sliding layers). cohere2_moe: the same, or
    `force_rope` (dense MLP layer with prefix_dense_sliding_window_pattern == 1). exaone4 (and EXAONE 4.5's text
    model), exaone_moe, kolibri1: `if self.sliding_window is None or self.is_sliding` (a model with a sliding window
    has NoPE full layers)."""
    model_type = getattr(config, "model_type", None)
    sliding = layer_type == "sliding_attention"
    if model_type in ("cohere2", "flint"):
        return sliding
    if model_type == "cohere2_moe":
        mlp_types = getattr(config, "mlp_layer_types", None)
        forced = (
            mlp_types is not None
            and mlp_types[index] == "dense"
            and getattr(config, "prefix_dense_sliding_window_pattern", None) == 1
        )
        return sliding or forced
    if model_type in ("exaone4", "exaone_moe", "kolibri1"):
        return getattr(config, "sliding_window", None) is None or sliding
    return None


def layer_uses_rope(config, index: int, layer_type: str) -> bool:
    """Whether decoder layer `index` (of type `layer_type`) applies RoPE to its keys, from the config."""
    no_rope_layers = getattr(config, "no_rope_layers", None)
    if no_rope_layers is not None and not no_rope_layers[index]:  # 1 = uses RoPE, 0 = NoPE (SmolLM3, Llama 4)
        return False
    by_type = _rope_on_sliding_layers_only(config, index, layer_type)
    return True if by_type is None else by_type


def rope_parameters(config, layer_type: str = COMPRESSED_TYPE) -> dict | None:
    """The config's RoPE parameters for layers of `layer_type` (full attention by default), or None if the model
    has none. Configs that keep one dict per layer type (Gemma 3, OLMo 3) give that type's entry."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get(layer_type)
    if not params or "rope_theta" not in params:
        return None
    return params


def _per_type(config) -> bool:
    params = getattr(config, "rope_parameters", None)
    return isinstance(params, dict) and bool(params) and all(isinstance(v, dict) for v in params.values())


@dataclass(frozen=True)
class LayerRope:
    """One layer's RoPE: pair i of the first 2 * len(inv_freq) dims turns by position x inv_freq[i]."""

    inv_freq: torch.Tensor  # [rotary_dim / 2] float32
    convention: str  # "half" or "interleaved"

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()


class KeyRotator:
    """Rotates keys by a per-token position delta, layer by layer, with the model's RoPE (see the module docstring).

    `layers[i]` is the plan of decoder layer i: a `LayerRope`, or None for a compressed layer without RoPE
    (identity). Layers our caches do not compress have no entry (`i not in layers`)."""

    def __init__(self, config, parameter: str = "position_mode"):
        refuse_latent(config, "moving keys to new positions", parameter, f"`{parameter}='original'`")
        if rope_parameters(config) is None and not _per_type(config):
            raise ValueError(
                f"`{parameter}='cache'` re-rotates keys with RoPE, but this model config "
                f"({type(config).__name__}) has no RoPE parameters; use `{parameter}='original'`."
            )
        self.parameter = parameter
        self._signed: dict[tuple[int, str], torch.Tensor] = {}  # signed_frequencies, per (layer, device)
        self.model_type = getattr(config, "model_type", None)
        self.convention = "interleaved" if self.model_type in INTERLEAVED_MODEL_TYPES else "half"
        layer_types, _ = layer_plan(config)
        self.layers: dict[int, LayerRope | None] = {}
        frequencies: dict[str, torch.Tensor] = {}  # per layer type: layers of a type share their parameters
        for index, layer_type in enumerate(layer_types):
            if layer_type != COMPRESSED_TYPE:
                continue
            if not layer_uses_rope(config, index, layer_type):
                self.layers[index] = None
                continue
            if layer_type not in frequencies:
                frequencies[layer_type] = self._inverse_frequencies(config, layer_type, parameter)
                if self.model_type in NEGATED_TURN_MODEL_TYPES:
                    frequencies[layer_type] = -frequencies[layer_type]
            self.layers[index] = LayerRope(frequencies[layer_type], self.convention)

    @staticmethod
    def _inverse_frequencies(config, layer_type: str, parameter: str) -> torch.Tensor:
        params = rope_parameters(config, layer_type)
        if params is None:
            raise ValueError(
                f"`{parameter}='cache'` re-rotates keys with RoPE, but this model config ({type(config).__name__}) "
                f"has no RoPE parameters for its {layer_type!r} layers; use `{parameter}='original'`."
            )
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"`{parameter}='cache'` needs a RoPE type whose frequencies do not depend on the sequence length "
                f"{SUPPORTED_ROPE_TYPES}; this model uses {rope_type!r}. Use `{parameter}='original'`."
            )
        if rope_type == "default":
            head_dim = attention_head_dim(config)
            factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
            dim = int(head_dim * factor)
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        else:
            require(ROPE)
            inv_freq = rope_inverse_frequencies(rope_type, config, layer_type if _per_type(config) else None)
        return inv_freq.float()

    def plan(self, layer_idx: int) -> LayerRope | None:
        """Layer `layer_idx`'s RoPE (None: no RoPE, keys stay as they are)."""
        try:
            return self.layers[layer_idx]
        except KeyError:
            raise ValueError(
                f"`layer_idx` {layer_idx} is not a layer this rotator re-rotates; it covers the "
                f"{COMPRESSED_TYPE!r} layers {sorted(self.layers)}."
            ) from None

    def applies(self, layer_idx: int) -> bool:
        """Whether `rotate` changes the keys of layer `layer_idx` (False on layers without RoPE)."""
        return self.plan(layer_idx) is not None

    def signed_frequencies(self, layer_idx: int, device) -> torch.Tensor:
        """[2, r/2] = (-inv_freq | inv_freq) of layer `layer_idx`'s RoPE on `device` (a layer with RoPE), made once:
        the angles of a rotation written as x * cos + flip(x) * sin over the rotary pairs (policies/sinks.py)."""
        key = (layer_idx, str(device))
        if key not in self._signed:
            freq = self.plan(layer_idx).inv_freq.to(device)
            self._signed[key] = torch.stack((-freq, freq))
        return self._signed[key]

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """keys [B, H, n, D] of layer `layer_idx` rotated by delta [B, n] (all heads) or [B, H, n] positions.
        Returns `keys` itself on a layer without RoPE. The attention scaling of yarn is already in the keys and is
        left alone: only the pure rotation is applied."""
        plan = self.plan(layer_idx)
        if plan is None:
            return keys
        if delta.dim() == 2:
            delta = delta[:, None]
        freqs = delta.to(torch.float32)[..., None] * plan.inv_freq.to(keys.device)  # [B, 1 or H, n, r/2]
        cos, sin = freqs.cos(), freqs.sin()
        rot = keys[..., : plan.rotary_dim].float()
        if plan.convention == "interleaved":
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            half = plan.rotary_dim // 2
            x1, x2 = rot[..., :half], rot[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        out = out.to(keys.dtype)
        if plan.rotary_dim == keys.shape[-1]:
            return out
        return torch.cat((out, keys[..., plan.rotary_dim :]), dim=-1)

    def fingerprint(self) -> tuple:
        """What the rotator does, as a hashable value (to remember which rotations were checked on a model)."""
        return tuple(
            (i, None if p is None else (p.convention, tuple(p.inv_freq.tolist())))
            for i, p in sorted(self.layers.items())
        )

    @staticmethod
    def check_cache(cache, config_or_model) -> None:
        """For caches' constructors: when built with a model, check every rotator the cache's layers use against
        that model (`check_rotator_against_model`, once per model and rotator). With a config there is nothing to
        run, so nothing is checked."""
        if not isinstance(config_or_model, PreTrainedModel):
            return
        rotators: dict[int, tuple[KeyRotator, list[int]]] = {}
        for layer in cache.layers:
            rotator = getattr(getattr(layer, "policy", None), "rotator", None)
            if isinstance(rotator, KeyRotator):
                rotators.setdefault(id(rotator), (rotator, []))[1].append(layer.layer_idx)
        for rotator, indices in rotators.values():
            check_rotator_once(config_or_model, rotator, indices)


# -- the safety net: the model's own keys at p + d against the rotator's ----------------------------------------
PROBE_POSITIONS = ((0, 1), (3, 29), (11, 200), (40, 97))  # (p, d) per batch row
# ||rotator's keys - model's keys|| / ||model's keys||, by the model's dtype. Measured on the 20 RoPE architectures
# of tests/model_zoo.py: at most 6e-7 in float32, 3.4e-3 in float16, 1.8e-2 in bfloat16 (rounding of the model's own
# 16-bit RoPE); a wrong convention, wrong dims or a rotated NoPE layer gives 0.4-1.8 (tests/test_sink_reference.py).
RELATIVE_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> fingerprints already checked


class _KeyRecorder(DynamicCache):
    """A DynamicCache that records the keys each layer hands to `update` (as the attention layer made them)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.recorded: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.recorded[layer_idx] = key_states.detach().clone()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _probe_keys(model, ids: torch.Tensor, positions: torch.Tensor) -> dict[int, torch.Tensor]:
    recorder = _KeyRecorder(model.config)
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, **cache_kwargs(recorder), use_cache=True)
    return recorder.recorded


def check_rotator_against_model(model, rotator: KeyRotator, layers=None) -> dict[int, float]:
    """Compare `rotator` with the model's own RoPE on each layer in `layers` (default: every layer the rotator
    covers); returns {layer: relative error}. Raises ValueError naming the model class and the layer on a mismatch.

    Method: one token per batch row, run by the model at position p and at p + d (rows of PROBE_POSITIONS). With a
    single token and no past, attention returns that token's value whatever its position, so every layer's hidden
    states are the same in both runs and the keys a layer hands to its cache differ only by what the layer does
    with positions: the RoPE convention, its dims and frequencies, or nothing at all (NoPE). The rotator must turn
    the keys at p into the keys at p + d: ||error|| <= tolerance x ||keys|| over all probe rows, heads and dims
    (RELATIVE_TOLERANCE by the model's dtype; a wrong convention or a rotated NoPE layer is off by ~1). The model runs
    in eval mode (restored afterwards) and
    without our cache. Skipped, with a warning giving the reason, where the model cannot be run (weights on the
    meta device) or a layer never hands keys to the cache."""
    layers = sorted(rotator.layers) if layers is None else sorted(layers)
    name = type(model).__name__
    param = next(model.parameters(), None)
    if param is None or param.device.type == "meta":
        warnings.warn(
            f"hf_kvcache: not checking the RoPE re-rotation against {name}: its weights are not loaded (meta "
            "device), so the model cannot run; the rotator follows the config only.",
            stacklevel=3,
        )
        return {}
    device = model.get_input_embeddings().weight.device
    p = torch.tensor([pd[0] for pd in PROBE_POSITIONS], device=device)
    d = torch.tensor([pd[1] for pd in PROBE_POSITIONS], device=device)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (len(PROBE_POSITIONS), 1), generator=torch.Generator().manual_seed(0)).to(device)
    was_training = model.training
    model.eval()
    try:
        before = _probe_keys(model, ids, p[:, None])
        after = _probe_keys(model, ids, (p + d)[:, None])
    finally:
        model.train(was_training)
    errors = {}
    for i in layers:
        if i not in before or i not in after:
            warnings.warn(
                f"hf_kvcache: not checking the RoPE re-rotation of {name} layer {i}: the layer handed no keys to "
                "the cache in a forward, so there is nothing to compare.",
                stacklevel=3,
            )
            continue
        want = after[i].float()
        got = rotator.rotate(before[i], d[:, None].to(before[i].device), i).float()
        error = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
        tolerance = RELATIVE_TOLERANCE.get(before[i].dtype, RELATIVE_TOLERANCE[torch.bfloat16])
        if not error <= tolerance:
            plan = rotator.plan(i)
            what = (
                "no RoPE (identity)"
                if plan is None
                else (f"{plan.convention} RoPE on the first {plan.rotary_dim} of {before[i].shape[-1]} dims")
            )
            raise ValueError(
                f"{name} layer {i}: re-rotating cached keys to new positions with {what} does not reproduce the "
                f"model's own keys (relative error {error:.2e} > {tolerance:g}); this architecture's RoPE is not "
                f"supported for moving keys. Use `{rotator.parameter}='original'`."
            )
        errors[i] = error
    return errors


def check_rotator_once(model, rotator: KeyRotator, layers) -> None:
    """`check_rotator_against_model`, skipped if this model already passed it for an identical rotator."""
    done = _checked.setdefault(model, set())
    key = (rotator.fingerprint(), tuple(sorted(layers)))
    if key in done:
        return
    check_rotator_against_model(model, rotator, layers)
    done.add(key)
