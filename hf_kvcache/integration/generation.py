"""`generate(cache_implementation=NAME)` for our names: transformers has no registry for custom caches, so we extend
its internals, each step guarded by a contract.

- `configuration_utils.ALL_CACHE_IMPLEMENTATIONS`: the tuple `GenerationConfig.validate()` checks names against;
  our names are appended (`add_cache_names` records them, `with_cache_names` is the tuple set).
- `GenerationMixin._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
  max_cache_length)`: hard-codes the name-to-class mapping and writes the cache to `model_kwargs[CACHE_ARG]`; our
  wrapper asks hf_kvcache's factory first (`set_generate_hooks`) and falls back to transformers' own.
- `GenerationMixin.init_continuous_batching`: wrapped so a model switched to our attention bridge goes back to its
  own attention first (continuous batching accepts only its own implementations) and so quantized pages are
  checked before transformers builds its cache.
- `GenerationMixin._valid_auto_compile_criteria`: reads the cache from `model_kwargs[CACHE_ARG]`; our fixed-size
  caches (`is_compileable`) are compiled automatically on an accelerator only if that holds.
The replacements are defined here and applied by hf_kvcache.integration.patches (groups `cache_names`, `generate`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers.generation import configuration_utils
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerationMixin

from .cache_argument import CACHE_ARG, CACHE_ARG_TEXT
from .contracts import contract, missing_parameters, require, source

PREPARE = "GenerationMixin._prepare_cache_for_generation"
NAMES = "configuration_utils.ALL_CACHE_IMPLEMENTATIONS"
INIT_CB = "GenerationMixin.init_continuous_batching"
AUTO_COMPILE = "GenerationMixin._valid_auto_compile_criteria"


@contract(
    NAMES,
    "a tuple of the cache names GenerationConfig.validate() accepts, read at validation time",
    "generate(cache_implementation=NAME)",
)
def _check_names() -> str | None:
    names = getattr(configuration_utils, "ALL_CACHE_IMPLEMENTATIONS", None)
    if not isinstance(names, (tuple, list)) or "dynamic" not in names:
        return f"it is {type(names).__name__}, not a tuple of names with 'dynamic'"
    if "ALL_CACHE_IMPLEMENTATIONS" not in source(configuration_utils.GenerationConfig.validate):
        return "GenerationConfig.validate no longer reads it"
    return None


@contract(
    PREPARE,
    "called by generate() as (generation_config, model_kwargs, generation_mode, batch_size, "
    f"max_cache_length) and writes the cache to model_kwargs under {CACHE_ARG_TEXT}",
    "generate(cache_implementation=NAME)",
)
def _check_prepare() -> str | None:
    fn = getattr(GenerationMixin, "_prepare_cache_for_generation", None)
    if fn is None:
        return "GenerationMixin has no _prepare_cache_for_generation"
    expected = ["self", "generation_config", "model_kwargs", "generation_mode", "batch_size", "max_cache_length"]
    changed = missing_parameters(fn, expected, "_prepare_cache_for_generation")
    if changed:
        return changed
    text = source(fn)
    if f'"{CACHE_ARG}"' not in text or "model_kwargs[" not in text:  # (5.23: through a `cache_name` local)
        return f"it no longer writes model_kwargs[{CACHE_ARG!r}]"
    return None


@contract(
    INIT_CB,
    "a GenerationMixin method (generation_config, continuous_batching_config, ...) that every "
    "continuous-batching entry point (generate_batch, serve) goes through",
    "continuous batching with hf_kvcache installed",
)
def _check_init_cb() -> str | None:
    fn = getattr(GenerationMixin, "init_continuous_batching", None)
    if fn is None:
        return "GenerationMixin has no init_continuous_batching"
    return missing_parameters(
        fn, ["self", "generation_config", "continuous_batching_config"], "init_continuous_batching"
    )


@contract(
    AUTO_COMPILE,
    f"decides automatic compilation from the is_compileable of model_kwargs' {CACHE_ARG_TEXT}",
    "automatic compilation of fixed-size caches in generate",
)
def _check_auto_compile() -> str | None:
    text = source(getattr(GenerationMixin, "_valid_auto_compile_criteria", None))
    if not text:
        return "GenerationMixin has no _valid_auto_compile_criteria"
    if f'model_kwargs.get("{CACHE_ARG}"' not in text or "is_compileable" not in text:
        return f"it no longer reads model_kwargs.get({CACHE_ARG!r}).is_compileable"
    return None


#: transformers' own names (and "paged"), recorded before ours were added; our names, in order
_builtin: list[tuple[str, ...]] = []
_names: list[str] = []


def builtin_cache_names() -> tuple[str, ...]:
    """The names transformers itself accepts (ours excluded), as they were before we extended them."""
    if _builtin:
        return _builtin[0]
    return tuple(configuration_utils.ALL_CACHE_IMPLEMENTATIONS) + ("paged",)


def add_cache_names(names) -> None:
    """Our cache names for `GenerationConfig.validate()` (idempotent; the `cache_names` patch sets the tuple);
    refuses a name transformers has itself."""
    require(NAMES)
    if not _builtin:
        _builtin.append(builtin_cache_names())
    clash = set(names) & set(_builtin[0])
    if clash:
        raise RuntimeError(f"hf_kvcache cache names {sorted(clash)} would shadow transformers' own cache names.")
    _names.extend(n for n in names if n not in _names)


def with_cache_names(original: tuple) -> tuple:
    """transformers' tuple of cache names followed by ours (the `cache_names` patch's value)."""
    return tuple(original) + tuple(n for n in _names if n not in original)


@dataclass
class CacheRequest:
    """What one `generate` call asks of the cache, in hf_kvcache's terms."""

    model: Any
    generation_config: Any
    given: Any  # the cache the caller passed (or an assistant's previous round), else None
    assisted: bool  # assisted generation / prompt lookup: rejected candidates are rolled back with crop
    max_cache_length: int | None

    @property
    def is_assistant(self) -> bool:
        return bool(getattr(self.generation_config, "is_assistant", False))

    def supports_default_cache(self) -> bool:
        """Whether transformers would give this model a DynamicCache (not Mamba-like, not encoder-decoder only)."""
        return self.model._supports_default_dynamic_cache()


_hooks: dict[str, Callable] = {}


def _request(model, generation_config, model_kwargs, args, kwargs) -> CacheRequest:
    named = dict(zip(("generation_mode", "batch_size", "max_cache_length"), args), **kwargs)
    return CacheRequest(
        model,
        generation_config,
        model_kwargs.get(CACHE_ARG),
        named.get("generation_mode") == GenerationMode.ASSISTED_GENERATION,
        named.get("max_cache_length"),
    )


def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    request = _request(self, generation_config, model_kwargs, args, kwargs)
    built = _hooks["build"](request)
    if built is not None:
        model_kwargs[CACHE_ARG] = built
        return None
    result = _prepare_cache_for_generation.original(self, generation_config, model_kwargs, *args, **kwargs)
    request.given = model_kwargs.get(CACHE_ARG)
    _hooks["prepared"](request)
    return result


def init_continuous_batching(self, *args, **kwargs):
    """transformers' `init_continuous_batching`, after hf_kvcache's `before_continuous_batching` hook."""
    _hooks["before_continuous_batching"](self, args, kwargs)
    return init_continuous_batching.original(self, *args, **kwargs)


def set_generate_hooks(
    build: Callable[[CacheRequest], Any], prepared: Callable[[CacheRequest], None], before_continuous_batching: Callable
) -> None:
    """What the wrappers of transformers' cache preparation and continuous-batching start call (the `generate`
    patches apply them).

    `build(request)` returns the cache to use (written to model_kwargs[CACHE_ARG]) or None to let transformers
    prepare its own; `prepared(request)` then sees what transformers prepared (`request.given`);
    `before_continuous_batching(model, args, kwargs)` runs before `init_continuous_batching`."""
    _hooks.update(build=build, prepared=prepared, before_continuous_batching=before_continuous_batching)
