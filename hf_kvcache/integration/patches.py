"""Every attribute hf_kvcache replaces on transformers' classes and modules, listed once, with `install` / `uninstall`.

transformers has no extension point for a custom cache name, a custom page format, per-request prompt chunks or
prompt eviction, so hf_kvcache replaces a few of its attributes. Each replacement is a `Patch` record in `PATCHES`:
its owner and attribute, the group it is installed with, the contracts (hf_kvcache.integration.contracts) that must
hold first, where our replacement lives, and why. `install(group)` applies a group (idempotent: a patch in place is
left alone) and `uninstall()` puts back the very objects transformers had. Nothing else in hf_kvcache assigns to a
transformers class or module (tests/test_patches.py greps for it).

Groups, and when each is installed (the same timing as before the registry):
- `cache_names`, `generate`: at `import hf_kvcache` (hf_kvcache.install.register);
- `paged_cache`: at import where its contracts hold, else (strict) by the first run that asks for quantized pages
  (hf_kvcache.paged.cache.install);
- `paged_step`: by the first paged cache of ours, quantized pages or `kv_compress` (hf_kvcache.paged.step.install);
- `eviction`: by the first paged cache built with `kv_compress` (hf_kvcache.paged.eviction.install);
- `request_faults`: with `paged_step`, where its contract holds (hf_kvcache.paged.request_faults);
- `codes_attention`: by the first quantized cache that attends from the codes, or one with prompt eviction
  (hf_kvcache.paged.codes_attention.install);
- `head_pages`: by the first paged cache built with head pages (hf_kvcache.paged.cache, `kv_compress_layout`).
A replacement built above this package (hf_kvcache.paged) is handed in by its module at import (`provide`).

Not patches of transformers (left where they are): wrappers set on one user's object (`enable_paged(model)` and the
server's admission set `model.init_continuous_batching`; admission wraps a manager's `add_request` /
`cancel_request`; `serving.build_serve` stubs `serve.start_server`, `serving.wrap_handlers` a handler's
`handle_request`), forward hooks on a model's modules (the bridge, KVzap, prompt eviction), registrations of our own
names through transformers' public registries (`AttentionInterface` / `AttentionMaskInterface`: `hf_kvcache_sdpa`,
`hf_kvcache_eager`, by hf_kvcache.attention.bridge; nothing of transformers is replaced), and
`cache.ATTN_TYPE_TO_ALLOCATOR`, updated only while one quantized paged cache is built and restored right after
(`continuous_batching.allocator_factories`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers.generation import configuration_utils
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching import scheduler as cb_scheduler
from transformers.generation.utils import GenerationMixin
from transformers.modeling_utils import AttentionInterface

from . import continuous_batching, generation, memory_handler, prefill_chunks
from .contracts import require

CACHE_NAMES, GENERATE, PAGED_CACHE, PAGED_STEP, EVICTION, REQUEST_FAULTS, CODES_ATTENTION, HEAD_PAGES = (
    "cache_names",
    "generate",
    "paged_cache",
    "paged_step",
    "eviction",
    "request_faults",
    "codes_attention",
    "head_pages",
)
#: each group, and when hf_kvcache installs it
GROUPS = {
    CACHE_NAMES: "at `import hf_kvcache`",
    GENERATE: "at `import hf_kvcache`",
    PAGED_CACHE: "at `import hf_kvcache` where its contracts hold, else by the first run asking for quantized pages",
    PAGED_STEP: "by the first paged cache of ours (quantized pages or `kv_compress`)",
    EVICTION: "by the first paged cache built with `kv_compress`",
    REQUEST_FAULTS: "with `paged_step`, where its contract holds (else a request's fault stays fatal to the loop)",
    CODES_ATTENTION: "by the first quantized paged cache attending from the codes (or with prompt eviction)",
    HEAD_PAGES: "by the first paged cache built with head pages (`kv_compress_layout` 'head')",
}


@dataclass(frozen=True, eq=False)
class Patch:
    """One attribute (or, `item`, one key of a mapping) of a transformers object that hf_kvcache replaces."""

    owner_name: str  # how the docs and errors name the owner, e.g. "GenerationMixin"
    owner: Any = field(repr=False)  # the class, module or mapping
    attribute: str
    group: str  # a key of GROUPS
    contracts: tuple[str, ...]  # required before it is applied
    replacement: str  # where ours lives
    why: str
    make: Callable[[Any], Any] | None = field(default=None, repr=False)  # original -> ours; None: `provide`d
    item: bool = False  # `owner` is a mapping and `attribute` a key of it
    recomputed: bool = False  # ours is a value computed from the original (re-applied when it changes)

    @property
    def name(self) -> str:
        return f"{self.owner_name}[{self.attribute!r}]" if self.item else f"{self.owner_name}.{self.attribute}"

    def exists(self) -> bool:
        return self.attribute in self.owner if self.item else hasattr(self.owner, self.attribute)

    def current(self):
        if not self.exists():
            raise AttributeError(f"hf_kvcache patches `{self.name}`, which this transformers does not have")
        return self.owner[self.attribute] if self.item else getattr(self.owner, self.attribute)

    def own(self) -> bool:
        """Whether the owner holds the attribute itself (not inherited: uninstall then deletes ours)."""
        return self.item or self.attribute in vars(self.owner)

    def set(self, value) -> None:
        if self.item:
            self.owner[self.attribute] = value
        else:
            setattr(self.owner, self.attribute, value)

    def restore(self, saved, own: bool) -> None:
        if own:
            self.set(saved)
        else:  # (e.g. GenerationMixin.init_continuous_batching, inherited from a mixin)
            delattr(self.owner, self.attribute)


def _calling_original(ours):
    """The `make` of a replacement that calls `ours.original` (transformers' function, saved on it at install)."""

    def make(original):
        ours.original = original
        return ours

    return make


_CB = "hf_kvcache.paged."
PATCHES: tuple[Patch, ...] = (
    Patch(
        "configuration_utils",
        configuration_utils,
        "ALL_CACHE_IMPLEMENTATIONS",
        CACHE_NAMES,
        (generation.NAMES,),
        "its tuple + our cache names (hf_kvcache.integration.generation.with_cache_names)",
        "GenerationConfig.validate() accepts only these names: generate(cache_implementation=NAME) for ours",
        generation.with_cache_names,
        recomputed=True,
    ),
    Patch(
        "GenerationMixin",
        GenerationMixin,
        "_prepare_cache_for_generation",
        GENERATE,
        (generation.PREPARE,),
        "hf_kvcache.integration.generation._prepare_cache_for_generation",
        "it hard-codes the name-to-class mapping: ours builds our caches (or switches the model to the bridge for a "
        "cache object of ours), else calls transformers'",
        _calling_original(generation._prepare_cache_for_generation),
    ),
    Patch(
        "GenerationMixin",
        GenerationMixin,
        "init_continuous_batching",
        GENERATE,
        (generation.INIT_CB,),
        "hf_kvcache.integration.generation.init_continuous_batching",
        "continuous batching accepts only its own attention: a bridged model goes back to its own, and quantized "
        "pages asked for are checked, before transformers' runs",
        _calling_original(generation.init_continuous_batching),
    ),
    Patch(
        "continuous_api",
        continuous_api,
        "PagedAttentionCache",
        PAGED_CACHE,
        continuous_batching.QUANTIZED_PAGES,
        _CB + "cache.QuantizedPagedAttentionCache (a subclass; transformers' cache without kv_cache_dtype)",
        "the batch processor builds its cache from this module-level name: quantized pages (kv_cache_dtype)",
    ),
    Patch(
        "cache",
        cb_cache,
        "PagedAttentionMemoryHandler",
        HEAD_PAGES,
        (memory_handler.HEAD_PAGES,),
        "hf_kvcache.integration.memory_handler.per_stream_memory_handler (a subclass; transformers' handler outside "
        "`tokens_per_sector_divided`)",
        "it counts a page's tokens as whole tokens of every layer and head: head pages hold one (layer, head) "
        "stream's, so the index tensors and masks would be sized for layers x heads times the tokens",
        memory_handler.per_stream_memory_handler,
    ),
    Patch(
        "ContinuousBatchProcessor",
        continuous_api.ContinuousBatchProcessor,
        "_generation_step",
        PAGED_STEP,
        (continuous_batching.EVICTION,),
        _CB + "step._with_our_step (transformers' step; prompt eviction around it; a failed forward fails its batch)",
        "prompt eviction (kv_compress) shifts positions before and compacts pages after a forward; any exception of a "
        "step is fatal to transformers' loop",
    ),
    Patch(
        "ContinuousBatchProcessor",
        continuous_api.ContinuousBatchProcessor,
        "update_batch",
        REQUEST_FAULTS,
        (continuous_batching.REQUEST_FAULTS,),
        _CB + "request_faults._with_request_faults (transformers' update, then the step's failed requests failed)",
        "any exception of a step is fatal to the loop: a request whose eviction failed fails alone, after its step's "
        "tokens are taken",
    ),
    Patch(
        "Scheduler",
        cb_scheduler.Scheduler,
        "_infer_request_tokens",
        EVICTION,
        (prefill_chunks.PREFILL_CHUNKS,),
        "hf_kvcache.integration.prefill_chunks.capped_infer_request_tokens",
        "a prompt is split only at the batch's token budget: kv_compress chunk=N caps a request's prompt tokens per "
        "forward",
        prefill_chunks.capped_infer_request_tokens,
    ),
    Patch(
        "Scheduler",
        cb_scheduler.Scheduler,
        "_schedule_request",
        EVICTION,
        (prefill_chunks.PREFILL_CHUNKS,),
        "hf_kvcache.integration.prefill_chunks.capped_schedule_request",
        "the other half of the cap: the remaining prompt is split at the cap",
        prefill_chunks.capped_schedule_request,
    ),
) + tuple(
    Patch(
        "AttentionInterface._global_mapping",
        AttentionInterface._global_mapping,
        name,
        CODES_ATTENTION,
        (continuous_batching.CODES_ATTENTION,),
        _CB + "codes_attention._with_paged_codes (transformers' function unless the cache left codes in kwargs)",
        "continuous batching accepts only its own attention names: quantized pages attend from their codes",
        item=True,
    )
    for name in continuous_batching.BATCH_ATTENTION
)

BY_NAME = {patch.name: patch for patch in PATCHES}
_makes: dict[str, Callable[[Any], Any]] = {p.name: p.make for p in PATCHES if p.make is not None}
#: patch name -> (transformers' object, ours, whether the owner held it itself) for every patch in place
_applied: dict[str, tuple[Any, Any, bool]] = {}


def provide(name: str, make: Callable[[Any], Any]) -> None:
    """The replacement of the patch `name` (a key of BY_NAME) built above this package: `make(original) -> ours`."""
    if name not in BY_NAME:
        raise KeyError(f"no patch {name!r}; patches: {sorted(BY_NAME)}")
    _makes[name] = make


def _of(groups) -> list[Patch]:
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise KeyError(f"no patch group {sorted(unknown)}; groups: {list(GROUPS)}")
    return [p for p in PATCHES if p.group in groups]


def is_applied(patch: Patch) -> bool:
    """Whether ours is in place (not merely installed once: something may have replaced it since)."""
    record = _applied.get(patch.name)
    return record is not None and patch.exists() and patch.current() is record[1]


def installed(group: str) -> bool:
    return all(is_applied(p) for p in _of([group]))


def installed_groups() -> list[str]:
    return [group for group in GROUPS if installed(group)]


def original(patch: Patch):
    """transformers' object that ours replaced (the current one while ours is not in place)."""
    return _applied[patch.name][0] if is_applied(patch) else patch.current()


def install(*groups: str) -> None:
    """Apply the patches of `groups`, in order (all groups when none is named); each group's contracts are required
    first (`UnsupportedTransformersError` naming the internal, before anything of that group is applied). Idempotent:
    a patch in place stays as it is (a recomputed value is set again only if it changed)."""
    for group in groups or tuple(GROUPS):
        chosen = _of([group])
        require(*dict.fromkeys(name for p in chosen for name in p.contracts))
        missing = [p.name for p in chosen if p.name not in _makes]
        if missing:
            raise RuntimeError(f"no replacement provided for {missing} (its module was not imported)")
        for patch in chosen:
            if is_applied(patch):
                if patch.recomputed:
                    saved, ours, own = _applied[patch.name]
                    new = _makes[patch.name](saved)
                    if new != ours:
                        patch.set(new)
                        _applied[patch.name] = (saved, new, own)
                continue
            saved, own = patch.current(), patch.own()
            ours = _makes[patch.name](saved)
            patch.set(ours)
            _applied[patch.name] = (saved, ours, own)


def uninstall(*groups: str) -> None:
    """Put back transformers' own objects (all groups when none is named), in the reverse order of PATCHES; an
    attribute the owner inherited is deleted again. A patch whose attribute something else replaced since is left
    to that object (and forgotten)."""
    for patch in reversed(_of(groups or tuple(GROUPS))):
        if is_applied(patch):
            saved, _, own = _applied[patch.name]
            patch.restore(saved, own)
        _applied.pop(patch.name, None)


def markdown_table() -> str:
    """The patches as a markdown table (docs/upstream_contracts.md holds it; tests/test_patches.py keeps it current)."""
    rows = ["| patched | installed | ours | why |", "|---|---|---|---|"]
    for p in PATCHES:
        cells = (f"`{p.name}`", GROUPS[p.group], p.replacement, p.why)
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)


__all__ = [
    "GROUPS",
    "PATCHES",
    "Patch",
    "install",
    "installed",
    "installed_groups",
    "markdown_table",
    "original",
    "provide",
    "uninstall",
]
