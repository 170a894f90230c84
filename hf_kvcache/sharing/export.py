"""Export a cache as a Hub-ready `custom_generate` folder: `model.generate(custom_generate=DIR_or_repo,
trust_remote_code=True)` then generates with that cache.

transformers 5.x loads `DIR/custom_generate/generate.py` (after checking `custom_generate/requirements.txt`
against the installed packages) and calls its `generate(model, **generate_arguments)` instead of its own
`generate`. `export_custom_generate(directory, name, cache_config)` validates the settings (`KVCacheConfig`) and
writes:

    directory/custom_generate/generate.py        imports hf_kvcache, builds the cache from the settings baked in
                                                 as a JSON string (parsed with json.loads, never executed), calls
                                                 the model's own generate with it
    directory/custom_generate/requirements.txt   hf-kvcache and transformers version ranges
    directory/README.md                          YAML header with the `custom_generate` tag, usage

The folder can be pushed as its own Hub repo or copied into a model repo (`hf-kvcache export-hub DIR --cache
NAME:key=value,...` on the command line).
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..caches.registry import SUPPORTED_RANGE_TEXT
from .hub import KVCacheConfig

GENERATE_FILE = os.path.join("custom_generate", "generate.py")
REQUIREMENTS_FILE = os.path.join("custom_generate", "requirements.txt")
README_FILE = "README.md"
FILES = (GENERATE_FILE, REQUIREMENTS_FILE, README_FILE)


def _package_version() -> str:
    from ..version import __version__

    return __version__


def package_requirement() -> str:
    """hf-kvcache from this version up to (excluding) the next major version."""
    version = _package_version()
    major = int(version.split(".")[0])
    return f"hf-kvcache>={version},<{major + 1}"


def transformers_requirement() -> str:
    return f"transformers{SUPPORTED_RANGE_TEXT}"


_GENERATE_TEMPLATE = '''"""custom_generate: generate with the hf-kvcache cache {name!r} (from `hf-kvcache export-hub`).

    model.generate(input_ids, custom_generate=REPO_OR_FOLDER, trust_remote_code=True, max_new_tokens=...)

The cache settings are data: a JSON string below, parsed with json.loads. Arguments of this generate:
- cache_config: a dict of settings for {name!r} that replaces the baked-in ones (the documented defaults of the
  name still fill in what it leaves out);
- cache (past_key_values before transformers 5.24) or cache_implementation: the caller's own cache, used instead
  (no {name!r} cache is built);
- everything else goes to the model's usual generate.
"""

import json

try:
    import hf_kvcache
except ImportError as error:  # transformers skips imports inside try blocks when it checks a remote file
    raise ImportError(
        "This custom_generate needs the hf-kvcache package, which is not installed: "
        "pip install {requirement!r}"
    ) from error

CACHE_NAME = {name!r}
CACHE_CONFIG_JSON = {config_json!r}


def build_cache(model, cache_config=None):
    """The {name!r} cache for `model`: the baked-in settings, or `cache_config` instead when given."""
    settings = json.loads(CACHE_CONFIG_JSON) if cache_config is None else cache_config
    config = hf_kvcache.KVCacheConfig(CACHE_NAME, settings, model_config=model.config,
                                      source=f"custom_generate cache {{CACHE_NAME!r}}")
    return config.build(model)


def generate(*args, model=None, cache_config=None, cache=None, past_key_values=None, **kwargs):
    # transformers calls generate(model=model, inputs=..., ...); a model repo carrying this file and loaded with
    # trust_remote_code=True gets `model.generate = partial(generate, model=model)`, so inputs may come first
    if cache is not None and past_key_values is not None:
        raise ValueError("custom_generate: pass the cache once, as `cache` (or `past_key_values` before 5.24).")
    given = cache if cache is not None else past_key_values
    if model is None:
        if not args:
            raise TypeError("custom_generate: generate() needs the model (generate(model, input_ids, ...)).")
        model, args = args[0], args[1:]
    # the class's generate, not `model.generate` (which may be this function, bound as above)
    model_generate = type(model).generate
    if given is not None or kwargs.get("cache_implementation") is not None:
        if cache_config is not None:
            if given is not None:
                raise ValueError("custom_generate: pass either `cache_config` or your own `cache`, not both.")
            kwargs["cache_config"] = cache_config
        if given is not None:  # under the name the installed transformers takes (cache from 5.24)
            kwargs.update(hf_kvcache.cache_kwargs(given))
        return model_generate(model, *args, **kwargs)
    if kwargs.get("use_cache") is False:
        return model_generate(model, *args, **kwargs)
    return model_generate(model, *args, **hf_kvcache.cache_kwargs(build_cache(model, cache_config)), **kwargs)
'''


_README_TEMPLATE = """---
library_name: transformers
tags:
  - custom_generate
  - kv-cache
  - hf-kvcache
---

# hf-kvcache `{name}` cache (custom_generate)

Generation with a compressed KV cache from [hf-kvcache](https://pypi.org/project/hf-kvcache/): cache `{name}`
with the settings

```json
{config_pretty}
```

## Usage

```bash
pip install '{requirement}' '{transformers_requirement}'
```

```python
out = model.generate(**inputs, custom_generate="REPO_OR_FOLDER", trust_remote_code=True, max_new_tokens=128)
```

`trust_remote_code=True` is required because `custom_generate/generate.py` runs on your machine; read it first
(it imports hf_kvcache, parses the settings above from a JSON string and calls the model's usual `generate` with
the cache).

## Additional arguments

- `cache_config` (dict): settings for `{name}` that replace the ones above (the cache's documented defaults fill
  in the rest).
- `cache` (`past_key_values` before transformers 5.24) or `cache_implementation`: your own cache, used instead of
  this one.
- Every other argument is passed to the model's `generate` (greedy, sampling and beam search work).

## Model compatibility

Decoder-only models whose attention goes through transformers' `AttentionInterface` (`sdpa` or `eager`), e.g.
Llama, Mistral, Qwen2/3, Phi-3, Gemma; transformers {transformers_range}.

## Output type

The same as `generate`: a tensor of token ids, or a `GenerateOutput` with `return_dict_in_generate=True`.
"""


def render_files(
    name: str, cache_config: dict[str, Any] | None = None, *, model_config=None, source: str = "export_custom_generate"
) -> dict[str, str]:
    """The files of the folder ({relative path: text}) after validating `name` and `cache_config` (against
    `model_config` when given, else a minimal Llama-shaped config: see KVCacheConfig)."""
    config = KVCacheConfig(name, cache_config, model_config=model_config, source=source)
    config_json = json.dumps(config.config, sort_keys=True)
    requirement = package_requirement()
    generate = _GENERATE_TEMPLATE.format(name=config.cache, config_json=config_json, requirement=requirement)
    compile(generate, GENERATE_FILE, "exec")  # a template bug must not produce a broken file
    readme = _README_TEMPLATE.format(
        name=config.cache,
        config_pretty=json.dumps(config.config, indent=2, sort_keys=True),
        requirement=requirement,
        transformers_requirement=transformers_requirement(),
        transformers_range=SUPPORTED_RANGE_TEXT,
    )
    requirements = f"{requirement}\n{transformers_requirement()}\n"
    return {GENERATE_FILE: generate, REQUIREMENTS_FILE: requirements, README_FILE: readme}


def export_custom_generate(
    directory: str | os.PathLike,
    name: str,
    cache_config: dict[str, Any] | None = None,
    *,
    model_config=None,
    overwrite: bool = False,
    source: str = "export_custom_generate",
) -> dict[str, str]:
    """Write a Hub-ready custom_generate folder for cache `name` with `cache_config` into `directory` (created when
    missing); returns {relative path: absolute path}. Existing files are kept (ValueError naming them) unless
    `overwrite`. Errors in the settings raise ValueError naming the field, before anything is written.

    Without `model_config` the settings are checked against a minimal Llama-shaped config (head_dim 8), which
    refuses settings tied to a larger head_dim (e.g. kivi `group_size` 16+): pass the target model's config (the
    folder's generate.py checks them against the model it runs with in any case)."""
    files = render_files(name, cache_config, model_config=model_config, source=source)
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{source}: directory {directory!r} exists and is not a folder.")
    if not overwrite:
        existing = [rel for rel in files if os.path.exists(os.path.join(directory, rel))]
        if existing:
            raise ValueError(
                f"{source}: {directory} already has {existing}; pass overwrite=True (--overwrite) to replace them."
            )
    written = {}
    for rel, text in files.items():
        path = os.path.join(directory, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        written[rel] = os.path.abspath(path)
    return written


__all__ = ["FILES", "export_custom_generate", "render_files"]
