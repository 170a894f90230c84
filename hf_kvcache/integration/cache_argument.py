"""The name under which transformers passes the cache: `past_key_values` up to 5.23, `cache` from 5.24.

transformers 5.24 renamed the argument in `generate()`, every model / decoder-layer / attention forward,
`prepare_inputs_for_generation`, `model_kwargs` and the outputs (`ModelOutput.cache`), keeping `past_key_values`
as a deprecated alias (forwards until 5.40, `generate` until 6.0) that warns. The name is read once, from the
signature of `GenerationMixin.prepare_inputs_for_generation`, and every call hf_kvcache makes uses it:

    model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    returned_cache(model.generate(..., return_dict_in_generate=True))

`FORWARD_NAMES` are the names a forward accepts (the current one first, then the deprecated alias a user may still
pass), which is what the attention bridge's pre-hook looks for.
"""

from __future__ import annotations

from transformers.generation.utils import GenerationMixin

from .contracts import contract, parameters, require

NAMES = ("cache", "past_key_values")
CONTRACT = "GenerationMixin.prepare_inputs_for_generation (cache argument)"


def _declared() -> list[str]:
    return [name for name in NAMES if name in parameters(GenerationMixin.prepare_inputs_for_generation)]


def _declared_name() -> str | None:
    declared = _declared()
    return declared[0] if len(declared) == 1 else None


@contract(
    CONTRACT,
    "takes the cache as exactly one of `cache` (5.24) or `past_key_values` (5.23), the name used by generate, "
    "model_kwargs, every forward and ModelOutput",
    "every hf_kvcache cache",
)
def _check_cache_name() -> str | None:
    declared = _declared()
    return None if len(declared) == 1 else f"it takes {declared or 'neither'} of {list(NAMES)}"


def _resolve() -> str:
    require(CONTRACT)
    return _declared_name()


#: the name in version-independent text (contract descriptions, docs)
CACHE_ARG_TEXT = "`cache` (`past_key_values` up to 5.23)"
#: the cache argument's name on the installed transformers
CACHE_ARG: str = _declared_name() or "past_key_values"
#: names a forward accepts for the cache, the current one first
FORWARD_NAMES: tuple[str, ...] = tuple(dict.fromkeys((CACHE_ARG, "past_key_values")))


def cache_kwargs(cache) -> dict:
    """`{name: cache}` for a model forward or `generate` call on the installed transformers."""
    return {_resolve(): cache}


def returned_cache(output):
    """The cache a model forward or `generate(..., return_dict_in_generate=True)` returned (None if none)."""
    name = _resolve()
    return output.get(name) if hasattr(output, "get") else getattr(output, name, None)


def given_cache(arguments: dict):
    """The cache among a forward's (or generate's) keyword arguments, under either accepted name."""
    for name in FORWARD_NAMES:
        value = arguments.get(name)
        if value is not None:
            return value
    return None
