"""What one forward of the model tells the cache's layers, since `Cache.update` receives only keys and values.

Set by the model's forward pre-hook (hf_kvcache.attention) before any layer runs: which of the new tokens are
padding, their position ids, whether the stream has had padding (read on the host once per multi-token forward,
never in decode), and whether the attention runs through our bridge. Layers read it through `for_layer` (which also
catches updates outside an announced forward) and `on(device)` (for layers on another device than the input ids).
"""

from __future__ import annotations

import torch


class ForwardAnnounced:
    """Marker base of the caches whose forwards the attention bridge announces (`hf_kvcache.caches.KVCache`): the
    bridge recognises them by this class, so it never imports the caches built on it. Such a cache has
    `forward_info` (a ForwardInfo), `begin_forward(q_len, batch, device, attention_mask, position_ids)` and
    `layers`."""

    def before_forward(self, model, arguments: dict) -> None:
        """Called by the model's forward pre-hook before the forward is announced, with the model the hook is on
        and the forward's arguments by name: a cache that needs model forwards of its own between two of the
        caller's (KVzip's context reconstruction) runs them here. Default: nothing."""


class ForwardInfo:
    """What one forward of the model tells the cache's layers: which new tokens are padding, and their positions.

    Set by the model's forward pre-hook (installed by `hf_kvcache.attention.enable`), since `Cache.update` itself
    receives only keys and values."""

    def __init__(self):
        self.serial = 0
        self.q_len: int | None = None
        self.real: torch.Tensor | None = None  # [B, q] bool
        self.positions: torch.Tensor | None = None  # [B, q] long
        self.has_padding = False  # sticky: once padded, columns no longer map to contiguous positions
        self.mask_given = False  # the current forward came with a padding mask
        self.attention_bridged = False  # the model's attention runs through our bridge (set by the pre-hook)
        # index of the compressed layer whose update ran last in this forward: the layer the next attention call reads
        # (the bridge's `attended_layer`; HRM's modules update another slot than their own layer_idx)
        self.updated: int | None = None

    def begin(self, q_len: int, batch: int, device, seen: int, attention_mask=None, position_ids=None) -> None:
        self.updated = None
        if isinstance(attention_mask, dict):  # prepared masks by layer type (generate with a compileable cache)
            attention_mask = attention_mask.get("full_attention", next(iter(attention_mask.values()), None))
        if attention_mask is not None and attention_mask.dim() == 4:
            real = _new_tokens_real(attention_mask, q_len, seen).to(device)
        elif attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(
                    f"hf_kvcache caches need a 2-D `attention_mask` [batch, seen + new tokens] (or transformers' "
                    f"prepared 4-D mask); got {attention_mask.dim()}-D."
                )
            if attention_mask.shape[-1] < q_len:
                raise ValueError(
                    f"`attention_mask` has {attention_mask.shape[-1]} columns, fewer than the {q_len} new tokens."
                )
            real = attention_mask[:, -q_len:].to(device=device, dtype=torch.bool)
        else:
            real = torch.ones(batch, q_len, dtype=torch.bool, device=device)
        if position_ids is None:
            position_ids = torch.arange(seen, seen + q_len, device=device)[None]
        self.real = real
        self.positions = position_ids.to(device=device, dtype=torch.long).expand(batch, q_len)
        # Whether the stream has padding is read on the host once per multi-token forward (prefill), never in decode:
        # decode steps record each new token's validity on the device, and the bridge always applies it (see
        # CompressedLayer.attention_validity), so a padding token in decode is masked without a host sync.
        if q_len > 1 and attention_mask is not None and not self.has_padding:
            self.has_padding = not bool(real.all())
        self.mask_given = attention_mask is not None
        self.q_len = q_len
        self.serial += 1

    def on(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(real, positions) on `device`: a layer whose keys live on another device than the input ids (a model
        split over devices with `device_map`) gets copies, made once per device and forward."""
        if self.real.device == torch.device(device):
            return self.real, self.positions
        key = (self.serial, torch.device(device))
        if getattr(self, "_moved_key", None) != key:
            self._moved_key, self._moved = key, (self.real.to(device), self.positions.to(device))
        return self._moved

    def for_layer(self, layer_idx: int, served: int, q_len: int) -> ForwardInfo:
        """This forward's info for the update of layer `layer_idx`, which last served forward `served` (its serial;
        the layer records `serial` once served): an update outside an announced forward, or a second one in the same
        forward, raises."""
        if self.q_len is None or served == self.serial:
            raise RuntimeError(
                "This hf_kvcache cache was updated outside a forward announced by the attention bridge. Use "
                "`model.generate(...)`, build the cache with the model (`SinkCache(model, ...)`), or call "
                "`hf_kvcache.enable(model)` once before calling the model directly."
            )
        if q_len != self.q_len:
            raise RuntimeError(f"Layer {layer_idx} got {q_len} new tokens but the forward announced {self.q_len}.")
        return self

    def reset(self) -> None:
        self.q_len = self.real = self.positions = None
        self.has_padding = False


def _new_tokens_real(mask: torch.Tensor, q_len: int, seen: int) -> torch.Tensor:
    """[B, q] whether each new token is real, from transformers' prepared 4-D mask [B, 1, q, kv] (boolean, True =
    attend, or additive, 0 = attend): a real token attends to itself, a padding token's column is masked for every
    query. The mask's columns start at the offset our layers gave (`get_mask_sizes`: the last kv positions, or 0
    while a fixed-width cache is still filling), so token `seen + i` is column `seen + i - offset`. Read on the
    device (no host sync)."""
    if mask.shape[-2] != q_len:
        raise ValueError(
            f"the prepared 4-D `attention_mask` has {mask.shape[-2]} query rows, not the {q_len} new tokens."
        )
    kv = mask.shape[-1]
    offset = max(0, seen + q_len - kv)
    rows = torch.arange(q_len, device=mask.device)
    own = mask[:, 0, rows, seen - offset + rows]  # each new token's entry for itself
    return own if own.dtype == torch.bool else own == 0
