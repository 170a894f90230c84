"""The upstream boundary: everything hf_kvcache takes from transformers beyond its public API lives in this package.

Public transformers API, which the rest of hf_kvcache may import directly: the names exported by the top-level
`transformers` package and documented there (`PreTrainedModel`, `PretrainedConfig` and the model configs,
`GenerationConfig`, `DynamicCache` / `StaticCache` / `QuantizedCache`, `AttentionInterface`,
`AttentionMaskInterface`, `StoppingCriteria`, `AutoModelForCausalLM`, `AutoTokenizer`, `AutoConfig`), the methods
their documentation describes (`generate`, `generate_batch`, `init_continuous_batching`, `set_attn_implementation`,
`save_pretrained` / `from_pretrained`, `get_text_config`), `transformers.__version__`, and
`transformers.utils.PushToHubMixin`.

Everything else is internal: private names (a leading `_`), module-level names of submodules that the top-level
package does not export (`cache_utils.DYNAMIC_LAYER_TYPE_MAPPING`, `generation.configuration_utils`,
`continuous_batching.*`, `integrations.*`, `masking_utils.*`, `modeling_rope_utils.*`, modeling files),
monkeypatches, source inspection, attribute walks of transformers' objects, the name of the cache argument. Each
such assumption is written once in one module here, registered as a contract (`contracts.CONTRACTS`: name, what
is assumed, what needs it, a check) and tested by tests/test_upstream_contracts.py on both ends of the supported
range; a feature whose contract does not hold raises `UnsupportedTransformersError` naming the installed version,
the tested range and what changed.

Modules (what each wraps):
- `versions`: the tested range, `UnsupportedTransformersError`, the once-per-process warning.
- `contracts`: the contract registry, `require`, `broken` (tests).
- `cache_argument`: `past_key_values` (5.23) vs `cache` (5.24): `CACHE_ARG`, `cache_kwargs`, `returned_cache`.
- `generation`: `generate(cache_implementation=NAME)` (the names tuple, cache preparation, continuous-batching
  start, auto-compilation).
- `attention`: the attention functions and masks the bridge wraps, the attention switch, forward arguments.
- `attention_inputs`: the decoder's self-attention modules and hooks on their input hidden states (KVzap).
- `cache_layers`: transformers' cache layer classes and layer types, what of them is state.
- `continuous_batching`: the paged cache, its allocators, who updates it, the scheduler's state.
- `prefill_chunks`: the scheduler's split of a prompt, capped per request (prompt eviction chunk by chunk).
- `models`: model facts read from private attributes (tensor-parallel plan and mesh, RoPE init functions).
- `patches`: every attribute of transformers replaced (`PATCHES`), with `install(group)` / `uninstall()`; the
  modules above define the replacements (or hf_kvcache.paged `provide`s them), only `patches` applies them.
- `serving`: `transformers serve` (its `Serve` built but not started, the continuous-batching config it passes,
  its handlers and FastAPI app), for `hf-kvcache serve`.
"""

from . import (  # noqa: F401
    attention,
    attention_inputs,
    cache_argument,
    cache_layers,
    continuous_batching,
    generation,
    models,
    patches,
    prefill_chunks,
    serving,
)
from .cache_argument import CACHE_ARG, cache_kwargs, returned_cache
from .contracts import CONTRACTS, require
from .versions import SUPPORTED_RANGE_TEXT, TESTED_MINORS, UnsupportedTransformersError

__all__ = [
    "CACHE_ARG",
    "CONTRACTS",
    "SUPPORTED_RANGE_TEXT",
    "TESTED_MINORS",
    "UnsupportedTransformersError",
    "cache_kwargs",
    "require",
    "returned_cache",
]
