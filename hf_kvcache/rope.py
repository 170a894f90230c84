"""Re-rotation of cached keys to new RoPE positions, using the model config's own RoPE parameters.

Keys arrive already rotated at their original positions. Rotations compose, so moving a key from position p to
position p' is one rotation by (p' - p); applied from the key as it arrived, it never accumulates error.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .architecture import attention_head_dim, refuse_latent

# RoPE types whose inverse frequencies do not depend on the sequence length, so a delta rotation is exact.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def rope_parameters(config) -> dict | None:
    """The config's RoPE parameters for full-attention layers, or None if the model has no RoPE."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]
    if not params or "rope_theta" not in params:
        return None
    return params


class KeyRotator:
    """Rotates keys by a per-token position delta with the model's inverse frequencies (rotate-half convention)."""

    def __init__(self, config, parameter: str = "position_mode"):
        refuse_latent(config, "moving keys to new positions", parameter, f"`{parameter}='original'`")
        params = rope_parameters(config)
        if params is None:
            raise ValueError(
                f"`{parameter}='cache'` re-rotates keys with RoPE, but this model config "
                f"({type(config).__name__}) has no RoPE parameters; use `{parameter}='original'`."
            )
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"`{parameter}='cache'` needs a RoPE type whose frequencies do not depend on the sequence length "
                f"{SUPPORTED_ROPE_TYPES}; this model uses {rope_type!r}. Use `{parameter}='original'`."
            )
        if rope_type == "default":
            head_dim = attention_head_dim(config)
            dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        else:
            inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        self.inv_freq = inv_freq.float()
        self.rotary_dim = 2 * self.inv_freq.numel()

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """keys [B, H, n, D] rotated by delta [B, n] (all heads) or [B, H, n] positions. The attention scaling of
        yarn is already in the keys and is left alone: only the pure rotation is applied."""
        if delta.dim() == 2:
            delta = delta[:, None]
        inv_freq = self.inv_freq.to(keys.device)
        freqs = delta.to(torch.float32)[..., None] * inv_freq  # [B, 1 or H, n, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        rot = keys[..., : self.rotary_dim].float()
        half = rot.shape[-1] // 2
        rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = (rot * cos + rotated_half * sin).to(keys.dtype)
        if self.rotary_dim == keys.shape[-1]:
            return out
        return torch.cat((out, keys[..., self.rotary_dim :]), dim=-1)
