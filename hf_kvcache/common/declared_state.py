"""State declared once: `map_batch` (beam reorder, repeat, select), `reset` and `nbytes` derived from the names of
an object's state, instead of three methods written by hand per class that must all be kept in step.

    class SinkWindowPolicy(Policy):
        state = ("n_real",)  # per-row tensors, None until allocated
        parts = ("memory",)  # objects with state of their own (the same three methods)

`transient` names are cleared by `reset` but neither mapped nor counted: values that live between two calls of one
forward (a chunk's scores until its tokens are written). A new attribute that is not declared is not state: it is
not reordered with the batch, not freed and not counted, which the tests of the declaring classes check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch


class DeclaredState:
    state: ClassVar[tuple[str, ...]] = ()
    transient: ClassVar[tuple[str, ...]] = ()
    parts: ClassVar[tuple[str, ...]] = ()

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dim operation (beam reorder, repeat, select) to every per-row state tensor."""
        for name in self.state:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))
        for name in self.parts:
            getattr(self, name).map_batch(fn)

    def reset(self) -> None:
        """Forget the stream: every state tensor back to None (allocated again at the next first forward)."""
        for name in self.state + self.transient:
            setattr(self, name, None)
        for name in self.parts:
            getattr(self, name).reset()

    def nbytes(self) -> int:
        """Bytes of the state tensors held now."""
        held = sum(getattr(self, name).nbytes for name in self.state if getattr(self, name) is not None)
        return held + sum(getattr(self, name).nbytes() for name in self.parts)
