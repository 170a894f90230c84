"""Cache configs that are safe to publish on the Hugging Face Hub: `KVCacheConfig`, and `publish` next to a model.

A `KVCacheConfig` is a cache name plus its settings (plain JSON), validated by building the cache against a
minimal model config, with a format `version`. It follows transformers' conventions:

    cfg = KVCacheConfig("sink", {"sinks": 4, "window": 1020})
    cfg.save_pretrained("my-model")                     # writes my-model/kvcache_config.json
    cfg = KVCacheConfig.from_pretrained("user/my-model", revision="main")   # or a local folder
    cfg.push_to_hub("user/my-model")                    # uploads kvcache_config.json only
    cache = cfg.build(model)                            # -> SinkCache; or model.generate(**cfg.generate_kwargs())

Published with a model, the same settings also go into `generation_config.json` under the key `"hf_kvcache"`
(`{"cache": "sink", "config": {...}, "version": 1}`), never in `cache_implementation`: transformers keeps unknown
generation-config keys through load and save and does not validate them, so the model loads and generates with
its usual cache for anyone without hf_kvcache, while `import hf_kvcache` makes `generate` use the published cache
unless the caller passes its own `cache_implementation` or `cache`. `publish(model_dir, name, cfg)` writes
both files. (A `cache_implementation` naming one of our caches makes `from_pretrained` of the whole model fail
wherever hf_kvcache is not imported: transformers validates that name when the config loads.)

Loading never executes anything: files are parsed as JSON (no NaN/Infinity, no duplicate keys), every value must be
a JSON type, and errors name the file, the field and what is allowed.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from typing import Any

from transformers.utils import PushToHubMixin

from ..caches import registry
from ..version import __version__
from .json_files import check_json_value, read_json_file

#: file written next to a model (and pushed to a Hub repo)
CONFIG_NAME = registry.CONFIG_FILE
GENERATION_CONFIG_NAME = "generation_config.json"
#: key under which the config sits in generation_config.json
GENERATION_CONFIG_KEY = "hf_kvcache"
#: format version written by this release; files with a higher version are refused (written by a newer hf_kvcache)
FORMAT_VERSION = 1
#: the fields of the format; `hf_kvcache_version` is informational (the package version that wrote the file)
FIELDS = ("cache", "config", "version", "hf_kvcache_version")
#: settings that describe one model's layers / KV heads (per-layer settings, calibrated FP8 scales): without the
#: model, `layers` is checked entry by entry and `scales` only as JSON; both are checked in full by `build(model)`,
#: `publish` and `save_cache_config(..., model_config=...)`
MODEL_SHAPED_KEYS = ("layers", "scales")
#: the format hf_kvcache 0.1 wrote to kvcache_config.json (still read)
LEGACY_FIELDS = ("cache_implementation", "cache_config")


def _package_version() -> str:
    return __version__


def _validate_layers(name: str, settings: dict[str, Any], validation_config, source: str) -> None:
    """`layers` refers to the target model's layers, which the minimal validation config does not have: check its
    shape and each entry's settings (built as a one-layer cache), leave layer types and indices to build time."""
    layers = settings["layers"]
    if isinstance(layers, dict):
        entries = list(layers.items())
    elif isinstance(layers, list):
        entries = list(enumerate(layers))
    else:
        raise ValueError(
            f"{source}: config['layers'] must be a dict (by layer type or index) or a list (one entry per layer), "
            f"got {type(layers).__name__}."
        )
    cls = registry.CACHE_IMPLEMENTATIONS[name]
    base = {k: v for k, v in settings.items() if k != "layers"}
    for key, value in entries:
        where = f"{source}: config['layers'][{key!r}]"
        if value is None or value in ("default", "keep"):
            continue
        if not isinstance(value, dict):
            raise ValueError(f'{where} must be null, "default", "keep" or a dict of settings, got {value!r}.')
        layer_settings = dict(value)
        other = layer_settings.pop("cache", None)
        if other is None:
            layer_cls, layer_base = cls, registry.resolve_cache_config(name, validation_config, base)
        elif other not in registry.CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"{where}['cache'] must be one of {sorted(registry.CACHE_IMPLEMENTATIONS)}, got {other!r}."
            )
        else:
            layer_cls, layer_base = registry.CACHE_IMPLEMENTATIONS[other], {}
        if any(k in layer_settings for k in layer_cls.size_keys):
            layer_base = {k: v for k, v in layer_base.items() if k not in layer_cls.size_keys}
        try:
            layer_cls.from_cache_config(validation_config, {**layer_base, **layer_settings})
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None


class KVCacheConfig(PushToHubMixin):
    """A cache name (`cache`, one of hf_kvcache.CACHE_IMPLEMENTATIONS) and its settings (`config`, plain JSON).

    Construction validates: the name is registered, the settings are JSON values, and they build the cache against
    a minimal Llama-shaped config with the documented defaults (registry.DEFAULT_CACHE_CONFIGS) merged under them,
    so a config that no model could use is refused before it is saved or published. `model_config` validates
    against a real model's config instead."""

    def __init__(
        self,
        cache: str,
        config: dict[str, Any] | None = None,
        *,
        version: int = FORMAT_VERSION,
        model_config=None,
        validate: bool = True,
        source: str = "KVCacheConfig",
    ):
        if not isinstance(cache, str) or cache not in registry.CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"{source}: `cache` must be one of {sorted(registry.CACHE_IMPLEMENTATIONS)}, got {cache!r}."
            )
        if config is None:
            config = {}
        if not isinstance(config, dict):
            raise ValueError(
                f"{source}: `config` must be a JSON object (dict) of settings, got {type(config).__name__}."
            )
        check_json_value(config, f"{source}: config")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"{source}: `version` must be an integer >= 1, got {version!r}.")
        if version > FORMAT_VERSION:
            raise ValueError(
                f"{source}: `version` {version} was written by a newer hf_kvcache; this one ({_package_version()}) "
                f"reads versions 1..{FORMAT_VERSION}. Upgrade hf_kvcache."
            )
        self.cache = cache
        self.config = json.loads(json.dumps(config))  # a private deep copy, JSON types only (tuples -> lists)
        self.version = FORMAT_VERSION
        if validate:
            self.validate(model_config, source=source)

    # -- validation and building --------------------------------------------------------------------------------

    def validate(self, model_config=None, source: str = "KVCacheConfig") -> None:
        """Build the cache (no tensors are allocated before the first update) to check every setting; against the
        minimal config when `model_config` is None (then MODEL_SHAPED_KEYS are checked only as far as possible
        without the model)."""
        target = model_config if model_config is not None else registry._validation_config()
        settings = dict(self.config)
        try:
            if model_config is None:
                # settings shaped like one model's layers and heads are checked when built for a model
                if "layers" in settings:
                    _validate_layers(self.cache, settings, target, source)
                for key in MODEL_SHAPED_KEYS:
                    settings.pop(key, None)
            registry.build_cache(self.cache, target, settings)
        except ValueError as error:
            message = str(error)
            raise ValueError(message if message.startswith(source) else f"{source}: {message}") from None

    def build(self, model_or_config):
        """The cache these settings describe for this model (defaults derived from the model merged under them)."""
        return registry.build_cache(self.cache, model_or_config, self.config)

    def generate_kwargs(self) -> dict[str, Any]:
        """`model.generate(**cfg.generate_kwargs())`: {"cache_implementation": name, "cache_config": settings}."""
        return {"cache_implementation": self.cache, "cache_config": json.loads(json.dumps(self.config))}

    # -- dict / JSON --------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "cache": self.cache,
            "config": json.loads(json.dumps(self.config)),
            "version": self.version,
            "hf_kvcache_version": _package_version(),
        }

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(
        cls, data: Any, source: str = "KVCacheConfig.from_dict", model_config=None, validate: bool = True
    ) -> KVCacheConfig:
        """From {"cache": ..., "config": {...}, "version": 1} (or the legacy {"cache_implementation": ...,
        "cache_config": {...}}); `source` names the file or key in errors."""
        if not isinstance(data, dict):
            raise ValueError(
                f"{source} must be a JSON object with fields {list(FIELDS[:3])}, got {type(data).__name__}."
            )
        legacy = "cache" not in data and "cache_implementation" in data
        fields = LEGACY_FIELDS if legacy else FIELDS
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {unknown}; valid fields are {list(fields)}.")
        name_field, config_field = fields[0], fields[1]
        if name_field not in data:
            raise ValueError(
                f"{source}: missing field {name_field!r} (the cache name, one of "
                f"{sorted(registry.CACHE_IMPLEMENTATIONS)})."
            )
        version = data.get("version", FORMAT_VERSION)
        hf_version = data.get("hf_kvcache_version")
        if hf_version is not None and not isinstance(hf_version, str):
            raise ValueError(f"{source}: `hf_kvcache_version` must be a string, got {hf_version!r}.")
        return cls(
            data[name_field],
            data.get(config_field),
            version=version,
            model_config=model_config,
            validate=validate,
            source=source,
        )

    @classmethod
    def from_json_file(cls, path: str | os.PathLike, model_config=None) -> KVCacheConfig:
        return cls.from_dict(read_json_file(path), source=os.fspath(path), model_config=model_config)

    @classmethod
    def from_generation_config(cls, generation_config, validate: bool = True) -> KVCacheConfig | None:
        """The config published under generation_config.hf_kvcache, or None when there is none."""
        data = getattr(generation_config, GENERATION_CONFIG_KEY, None)
        if data is None:
            return None
        return cls.from_dict(data, source=f"{GENERATION_CONFIG_NAME} key {GENERATION_CONFIG_KEY!r}", validate=validate)

    def apply_to(self, generation_config) -> None:
        """Put these settings under generation_config.hf_kvcache (the form transformers ignores without us)."""
        if generation_config.cache_implementation in registry.CACHE_IMPLEMENTATIONS:
            generation_config.cache_implementation = None
            generation_config.cache_config = None
        setattr(generation_config, GENERATION_CONFIG_KEY, self.to_dict())
        # transformers drops every key it does not know when loading a generation_config.json marked
        # `_from_model_config: true` (what save_pretrained writes for an untouched default): it is no longer one
        generation_config._from_model_config = False

    def __eq__(self, other) -> bool:
        return isinstance(other, KVCacheConfig) and (self.cache, self.config, self.version) == (
            other.cache,
            other.config,
            other.version,
        )

    def __repr__(self) -> str:
        return f"KVCacheConfig(cache={self.cache!r}, config={self.config!r}, version={self.version})"

    # -- files, Hub -----------------------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs) -> str:
        """Write `kvcache_config.json` into `save_directory` (created if needed); returns its path. With
        `push_to_hub=True`, also upload it (`repo_id` defaults to the folder name; other kwargs go to push_to_hub)."""
        save_directory = os.fspath(save_directory)
        if os.path.isfile(save_directory):
            raise ValueError(f"save_directory {save_directory!r} is a file; give a folder.")
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, CONFIG_NAME)
        with open(path, "w") as f:
            f.write(self.to_json_string())
        if push_to_hub:
            repo_id = kwargs.pop("repo_id", os.path.basename(os.path.normpath(save_directory)))
            self.push_to_hub(repo_id, **kwargs)
        return path

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        revision: str | None = None,
        *,
        subfolder: str = "",
        cache_dir: str | os.PathLike | None = None,
        token: bool | str | None = None,
        local_files_only: bool = False,
        force_download: bool = False,
        model_config=None,
    ) -> KVCacheConfig:
        """Read `kvcache_config.json` (else the `hf_kvcache` key of `generation_config.json`) from a local folder or
        a Hub repo id (through huggingface_hub.hf_hub_download, honouring `revision`, `cache_dir`, `token`,
        `local_files_only` and HF_HUB_OFFLINE)."""
        location = os.fspath(pretrained_model_name_or_path)
        folder = os.path.join(location, subfolder) if subfolder else location
        if os.path.isdir(folder):
            own = os.path.join(folder, CONFIG_NAME)
            if os.path.isfile(own):
                return cls.from_json_file(own, model_config=model_config)
            generation = os.path.join(folder, GENERATION_CONFIG_NAME)
            found = cls._from_generation_config_file(generation, model_config) if os.path.isfile(generation) else None
            if found is not None:
                return found
            raise FileNotFoundError(
                f"No hf_kvcache config in {folder}: neither {CONFIG_NAME} nor a {GENERATION_CONFIG_KEY!r} key in "
                f"{GENERATION_CONFIG_NAME}. Write one with KVCacheConfig.save_pretrained or "
                "hf_kvcache.sharing.hub.publish."
            )
        if os.path.isfile(location):
            return cls.from_json_file(location, model_config=model_config)
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        def download(filename):
            return hf_hub_download(
                location,
                filename,
                subfolder=subfolder or None,
                revision=revision,
                cache_dir=cache_dir,
                token=token,
                local_files_only=local_files_only,
                force_download=force_download,
                library_name="hf_kvcache",
                library_version=_package_version(),
            )

        try:
            return cls.from_json_file(download(CONFIG_NAME), model_config=model_config)
        except EntryNotFoundError as first:
            try:
                found = cls._from_generation_config_file(download(GENERATION_CONFIG_NAME), model_config)
            except EntryNotFoundError:
                found = None
            if found is not None:
                return found
            at = f" at revision {revision!r}" if revision else ""
            raise FileNotFoundError(
                f"No hf_kvcache config in Hub repo {location!r}{at}: neither {CONFIG_NAME} nor a "
                f"{GENERATION_CONFIG_KEY!r} key in {GENERATION_CONFIG_NAME} ({type(first).__name__}: {first})."
            ) from first

    @classmethod
    def _from_generation_config_file(cls, path: str, model_config=None) -> KVCacheConfig | None:
        data = read_json_file(path)
        if not isinstance(data, dict):
            raise ValueError(f"{path} must be a JSON object, got {type(data).__name__}.")
        if GENERATION_CONFIG_KEY not in data:
            return None
        return cls.from_dict(
            data[GENERATION_CONFIG_KEY], source=f"{path} key {GENERATION_CONFIG_KEY!r}", model_config=model_config
        )

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        commit_description: str | None = None,
        private: bool | None = None,
        token: bool | str | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        **_ignored,
    ) -> Any:
        """Upload `kvcache_config.json` to `repo_id` (created if missing). Unlike PushToHubMixin.push_to_hub, this
        never rewrites the repo's README/model card: a cache config is usually added to an existing model repo."""
        from huggingface_hub import HfApi

        api = HfApi(library_name="hf_kvcache", library_version=_package_version())
        repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        if revision is not None and not revision.startswith("refs/pr"):
            api.create_branch(repo_id=repo_id, branch=revision, token=token, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            return api.upload_folder(
                repo_id=repo_id,
                folder_path=tmp,
                commit_message=commit_message or f"Upload {CONFIG_NAME}",
                commit_description=commit_description,
                token=token,
                revision=revision,
                create_pr=create_pr,
                allow_patterns=[CONFIG_NAME],
            )


def _model_config_in(model_dir: str):
    """The model's config from its config.json (offline, no remote code), or None if there is none or transformers
    cannot read it (then settings are validated against the minimal config only)."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError, KeyError) as error:
        warnings.warn(
            f"hf_kvcache.publish: could not read {model_dir}/config.json with AutoConfig ({error}); the cache "
            f"settings are validated against a minimal Llama-shaped config only.",
            stacklevel=3,
        )
        return None


def publish(
    model_dir: str | os.PathLike, name: str, cache_config: dict[str, Any] | None = None, model_config=None
) -> dict[str, str]:
    """Publish cache settings with a saved model folder: writes `kvcache_config.json` and the `hf_kvcache` key of
    `generation_config.json` (created from config.json's generation parameters if missing; an existing one keeps
    all its other settings). Settings are validated against the model's config. Returns {file name: path}.

    Files the settings name are copied into the folder and referred to relative to the model (a KVzap `surrogate`
    given as a `Surrogate` or a local directory becomes `model_dir/kvzap_surrogate`, `"surrogate":
    "model:kvzap_surrogate"`): upload the whole folder and the Hub repo carries them.

    A `cache_implementation` naming one of our caches in the existing generation_config.json is removed (with a
    warning): it would make the model unloadable without hf_kvcache. A transformers cache name there (e.g.
    "static") is refused, since it would take precedence over the published cache."""
    from transformers import GenerationConfig

    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"publish: {model_dir!r} is not a folder (save the model with save_pretrained first).")
    if model_config is None:
        model_config = _model_config_in(model_dir)
    if name in registry.CACHE_IMPLEMENTATIONS and isinstance(cache_config, dict):  # files the settings name: copied in
        cache_config = registry.CACHE_IMPLEMENTATIONS[name].bundle(dict(cache_config), model_dir)
    config = KVCacheConfig(name, cache_config, model_config=model_config, source=f"publish({name!r})")
    generation_path = os.path.join(model_dir, GENERATION_CONFIG_NAME)
    if os.path.isfile(generation_path):
        read_json_file(generation_path)  # a clear error for a broken file before transformers parses it
        generation = GenerationConfig.from_pretrained(model_dir)
    elif model_config is not None:
        generation = GenerationConfig.from_model_config(model_config)
    else:
        generation = GenerationConfig()
    existing = generation.cache_implementation
    if existing in registry.CACHE_IMPLEMENTATIONS:
        warnings.warn(
            f"publish: removed cache_implementation={existing!r} from {generation_path}: transformers refuses that "
            f"name when hf_kvcache is not imported, so the model would not load for most users. The cache is "
            f"published under the {GENERATION_CONFIG_KEY!r} key instead.",
            stacklevel=2,
        )
    elif existing is not None:
        raise ValueError(
            f"publish: {generation_path} sets cache_implementation={existing!r} (a transformers cache), which "
            f"generate would use instead of the published {name!r}; remove it (set it to null) first."
        )
    config.apply_to(generation)
    generation.save_pretrained(model_dir)
    return {CONFIG_NAME: config.save_pretrained(model_dir), GENERATION_CONFIG_NAME: generation_path}


__all__ = ["CONFIG_NAME", "FORMAT_VERSION", "GENERATION_CONFIG_KEY", "KVCacheConfig", "publish", "read_json_file"]


def save_cache_config(
    directory: str | os.PathLike, name: str, cache_config: dict[str, Any] | None = None, model_config=None
) -> str:
    """Write `kvcache_config.json` ({"cache": name, "config": {...}, "version": 1}) into `directory`, after checking
    that the settings are plain JSON and build a cache (against `model_config` when given, else a minimal
    Llama-shaped config). Never writes a `cache_implementation` (see this module's docstring); to make `generate` on the
    saved model use the cache, use `hf_kvcache.publish(directory, name, cache_config)`, which also writes the
    `hf_kvcache` key of generation_config.json."""
    config = KVCacheConfig(name, cache_config, model_config=model_config, source=f"save_cache_config({name!r})")
    return config.save_pretrained(directory)


def load_cache_config(directory: str | os.PathLike) -> dict[str, Any]:
    """Read the cache config of a folder (`kvcache_config.json`, in the current or the 0.1 format, else the
    `hf_kvcache` key of generation_config.json): returns {"cache_implementation": ..., "cache_config": {...}} for
    `model.generate(**loaded)`."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"No {CONFIG_NAME} in {directory}: not a folder.")
    return KVCacheConfig.from_pretrained(directory).generate_kwargs()
