"""Prompt compression (`compress="prompt"`): compress the prompt to the budget once, then let the cache grow.

Wraps an evicting policy (sinks + window, H2O, random eviction, the scorers). Definition of "the end of the prompt":
- every multi-token forward before it is placed by the wrapped policy exactly as in `compress="always"` mode, so a
  prompt given in one forward or in chunks (`generate(prefill_chunk_size=...)`) ends compressed to the budget, and
  peak memory during a chunked prefill stays at the budget;
- the prompt ends at the first one-token forward (the first decode step of `generate`, or the first teacher-forced
  token), or earlier when the caller says so with `cache.end_prompt()` (e.g. to append a question uncompressed
  after compressing a document, as kvpress does);
- from then on every new token is appended to a growing slot range and nothing is evicted (re-compressing every N
  tokens, as kvpress's decoding presses do, is not offered).

The wrapped policy's last decision stands: at the end of the prompt its `before_read` runs once (sinks or compacted
positions are placed for good), and then it is reset. Its choice is in the layer's slots, validity and positions, and
nothing it holds is read again (no attention probabilities or queries are handed over in the appended phase; crop,
reorder and batch selection touch the layer only), so its state is freed rather than kept dead: scores and stream
indices (H2O, random eviction, the scorers), SnapKV's observation ring, expected attention's query statistics and
per-slot expected logits and value norms, arrived copies of sink or compacted keys, the composite's heavy region
scorer. `nbytes()` after the prompt counts the layer's stores, positions and validity alone, and a state file saved
after the prompt holds no policy tensors.

Appended slots are a contiguous range, so decode writes one known slot (no host sync). Buffers grow by 1/8 at a time
(the layer's growing path). Crop works within the appended tokens only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import Placement, Policy

COMPRESS_MODES = ("always", "prompt")


class PromptCompressionPolicy(Policy):
    may_have_holes = True
    compileable = False  # it grows after the prompt

    def __init__(self, inner: Policy):
        self.inner = inner
        self.per_head = inner.per_head
        self.needs_positions = inner.needs_positions
        self.start_seen: int | None = None  # stream index of the first appended token (None: still in the prompt)
        self.base = 0  # slot of the first appended token

    # while in the prompt, the wrapped policy decides everything
    @property
    def ended(self) -> bool:
        return self.start_seen is not None

    capacity = property(lambda self: None if self.ended else self.inner.capacity)
    deferred = property(lambda self: False if self.ended else self.inner.deferred)
    needs_attention = property(lambda self: False if self.ended else self.inner.needs_attention)
    needs_queries = property(lambda self: False if self.ended else self.inner.needs_queries)
    attention_window = property(lambda self: self.inner.attention_window)
    # slots per appended token: the KV heads when they share one slot pool (head-adaptive budgets), else 1
    stride = property(lambda self: getattr(self.inner, "pool_heads", None) or 1)
    rotator = property(lambda self: getattr(self.inner, "rotator", None))  # checked against the model's RoPE

    def configure(self, prompt_length: int) -> None:
        self.inner.configure(prompt_length)

    def size_for(self, heads: int) -> None:
        self.inner.size_for(heads)

    def allocate(self, batch: int, heads: int, device) -> None:
        self.inner.allocate(batch, heads, device)

    def begin(self, view, q: int) -> None:
        if not self.ended and q == 1 and view.seen > 0:
            self.end_prompt(view)

    def end_prompt(self, view) -> None:
        """Freeze the wrapped policy's choice: later tokens are appended after the slots it uses."""
        if self.ended or not view.ready:
            return
        self.inner.before_read(view)
        self.base = self.inner.used_after(view.seen)
        self.start_seen = view.seen
        view.forget_from(self.base)  # empty slots and the old trash slot are free from here on
        self.inner.reset()  # its state is never read again (see the module docstring): free it

    # -- placement ----------------------------------------------------------------------------------------------
    def _slot(self, seen: int) -> int:
        return self.base + (seen - self.start_seen) * self.stride

    def place(self, view, real: torch.Tensor, seen: int) -> Placement:
        if not self.ended:
            return self.inner.place(view, real, seen)
        batch, q = real.shape
        hm = view.valid.shape[1]
        start = self._slot(seen)
        src = torch.arange(q, device=real.device).expand(batch, hm, q)
        if self.stride > 1:  # pooled heads: token i of head h in slot start + i * heads + h
            dest = start + src * self.stride + torch.arange(hm, device=real.device)[:, None]
            return Placement(src=src, dest=dest.contiguous(), valid=real[:, None, :].expand(batch, hm, q))
        regions = None  # region stores (CompositeCache): a one-token step touches the region of its slot only
        if q == 1 and view.has_regions:
            regions = (view.region_of(start),)
        return Placement(
            src=src,
            dest=(start + src).contiguous(),
            valid=real[:, None, :].expand(batch, hm, q),
            start=start,
            regions=regions,
        )

    def observe(self, view, column_scores: torch.Tensor) -> None:
        self.inner.observe(view, column_scores)

    def observe_queries(self, view, query: torch.Tensor) -> None:
        self.inner.observe_queries(view, query)

    def decode_slot(self, view, seen: int) -> int | None:
        if not self.ended:
            return self.inner.decode_slot(view, seen)
        # (region stores and pooled heads: `place`)
        return self._slot(seen) if view.writes_single_slots and self.stride == 1 else None

    def after_decode_write(self, view, slot: int, keys: torch.Tensor, positions: torch.Tensor) -> None:
        if not self.ended:
            self.inner.after_decode_write(view, slot, keys, positions)

    def after_write(self, view, placement: Placement, keys, dest, positions, seen_before: int) -> None:
        if not self.ended:
            self.inner.after_write(view, placement, keys, dest, positions, seen_before)

    def before_read(self, view) -> None:
        if not self.ended:
            self.inner.before_read(view)

    def used_after(self, seen: int) -> int:
        return self._slot(seen) if self.ended else self.inner.used_after(seen)

    def has_evicted(self, seen: int) -> bool:
        # after the prompt nothing is evicted any more: the appended tokens can be cropped (`crop` refuses the prompt)
        return False if self.ended else self.inner.has_evicted(seen)

    def crop(self, view, new_seen: int) -> None:
        if not self.ended:
            return self.inner.crop(view, new_seen)
        if new_seen < self.start_seen:
            raise ValueError(
                f"Cannot crop to {new_seen} tokens: the prompt ({self.start_seen} tokens) was compressed; only "
                "tokens appended after it can be removed."
            )
        view.forget_from(self._slot(new_seen))

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if not self.ended:  # (after the prompt the wrapped policy holds nothing: the layer's tensors are all there is)
            self.inner.map_batch(fn)

    def reset(self) -> None:
        self.inner.reset()
        self.start_seen, self.base = None, 0

    def nbytes(self) -> int:
        return self.inner.nbytes()
