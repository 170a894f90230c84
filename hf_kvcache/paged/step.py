"""transformers' continuous-batching step as our paged caches run it: prompt eviction around the forward where the
cache evicts (hf_kvcache.paged.eviction: positions shifted before, pages compacted after), and a forward that raises
failing the requests of its batch only (hf_kvcache.paged.request_faults) where the cache is ours (quantized pages or
`kv_compress`). A run on transformers' own cache goes through transformers' step untouched.

The `paged_step` patch (ContinuousBatchProcessor._generation_step) is installed by the first paged cache of ours;
`update_batch` (the `request_faults` patch) with it, where its contract holds.
"""

from __future__ import annotations

from ..integration import patches
from ..integration.continuous_batching import REQUEST_FAULTS
from ..integration.contracts import holds
from ..integration.versions import UnsupportedTransformersError
from . import request_faults  # noqa: F401  (provides the update_batch patch)


def _with_our_step(original):
    def _generation_step(self, model):
        faults = getattr(self.cache, "faults", None)
        if faults is None:  # transformers' own cache
            return original(self, model)
        eviction = getattr(self.cache, "eviction", None)
        try:
            if eviction is not None:
                eviction.before_forward(self, model)
            original(self, model)
        except Exception as error:
            if eviction is not None:
                eviction.abandon()
            faults.forward_failed(self, error)  # the batch's requests fail, the loop goes on
            return
        except BaseException:
            if eviction is not None:
                eviction.abandon()
            raise
        if eviction is not None:
            eviction.after_forward(self)

    _generation_step.__doc__ = (
        "transformers' generation step, with prompt eviction around it and a failed forward failing its batch's "
        "requests only (hf_kvcache.paged.step)."
    )
    _generation_step.__wrapped__ = original
    return _generation_step


patches.provide("ContinuousBatchProcessor._generation_step", _with_our_step)  # (applied by `install`)


def install(required: bool = False) -> bool:
    """Wrap the generation step (and update_batch, where REQUEST_FAULTS holds); idempotent. `required` (prompt
    eviction needs the step): raise `UnsupportedTransformersError` where the step's contract changed; else return
    False and leave transformers' step alone."""
    try:
        patches.install(patches.PAGED_STEP)  # (requires the group's contracts first)
    except UnsupportedTransformersError:
        if required:
            raise
        return False
    if holds(REQUEST_FAULTS):
        patches.install(patches.REQUEST_FAULTS)
    return True


__all__ = ["install"]
