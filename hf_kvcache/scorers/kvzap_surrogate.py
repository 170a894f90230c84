"""KVzap's surrogate (kvpress, arXiv 2601.07891): per layer, a small model from the attention input hidden states to
the log KVzip score of each KV head, so a token's KVzip importance is predicted as it arrives instead of measured by
reconstructing the context (KVzip's extra forwards).

A `Surrogate` holds one predictor per scored layer, all of one `kind`:
- "linear": log-score = hidden @ weight.T + bias (weight [Hkv, d], bias [Hkv]);
- "mlp": one hidden layer, d -> hidden -> Hkv with SiLU between.

It is saved as a folder (a local directory or a Hub repo): `model.safetensors` (tensors `layers.{i}.weight` /
`.bias`, or `layers.{i}.fc1.weight` ... `.fc2.bias`) and `config.json` (the format, the shapes, the model it was
trained for, how it was trained and how well it fits). `Surrogate.load("smollm2")` loads the one shipped with the
package for the offline SmolLM2-135M-Instruct (hf_kvcache/data/kvzap/smollm2).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F

FORMAT = "hf_kvcache.kvzap"
FORMAT_VERSION = 1
KINDS = ("linear", "mlp")
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
#: surrogates shipped with the package, by the name of the model they were trained for (hf_kvcache.sharing.models)
BUILTIN = {"smollm2": Path(__file__).resolve().parent.parent / "data" / "kvzap" / "smollm2"}
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_PARTS = {"linear": ("weight", "bias"), "mlp": ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}


def _kv_heads(config) -> int:
    """The KV heads our caches hold per compressed layer (1 for latent attention: the latent is one head)."""
    from ..common.architecture import layer_kv_shape

    return layer_kv_shape(config, 0)[0]


class Surrogate:
    """Per-layer predictors of the log KVzip score from the attention input hidden states (see the module docstring).

    `weights`: {layer index: {part name: tensor}} with the parts of `kind` ("weight", "bias" for linear; "fc1.weight",
    "fc1.bias", "fc2.weight", "fc2.bias" for mlp). `info`: what else config.json records (the model it was trained
    for, training settings, fit metrics), kept as given."""

    def __init__(self, kind: str, weights: dict[int, dict[str, torch.Tensor]], info: dict | None = None):
        if kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}, got {kind!r}.")
        if not weights:
            raise ValueError("`weights` must hold at least one layer's predictor.")
        self.kind, self.info = kind, dict(info or {})
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        shapes = set()
        for index, parts in sorted(weights.items()):
            if set(parts) != set(_PARTS[kind]):
                raise ValueError(f"`weights[{index}]` must have the parts {_PARTS[kind]} for a {kind} surrogate.")
            parts = {name: t.detach().to(torch.float32).contiguous() for name, t in parts.items()}
            shapes.add(self._shape(index, parts))
            self.weights[int(index)] = parts
        if len(shapes) != 1:
            raise ValueError(f"`weights`: the layers' (kv heads, hidden size, width) differ: {sorted(shapes)}.")
        self.kv_heads, self.hidden_size, self.width = shapes.pop()
        self._device: torch.device | None = None

    def _shape(self, index: int, parts: dict) -> tuple[int, int, int]:
        """(kv heads, hidden size, MLP width or 0) of one layer's parts, checked to agree."""
        if self.kind == "linear":
            heads, d = parts["weight"].shape
            shape, ok = (heads, d, 0), parts["bias"].shape == (heads,)
        else:
            width, d = parts["fc1.weight"].shape
            heads = parts["fc2.weight"].shape[0]
            shape = (heads, d, width)
            ok = parts["fc1.bias"].shape == (width,) and parts["fc2.weight"].shape == (heads, width)
            ok = ok and parts["fc2.bias"].shape == (heads,)
        if not ok:
            raise ValueError(f"`weights[{index}]`: part shapes {[tuple(t.shape) for t in parts.values()]} disagree.")
        return shape

    @property
    def layers(self) -> list[int]:
        """The layer indices with a predictor, in order."""
        return list(self.weights)

    # -- prediction -------------------------------------------------------------------------------------------
    def to(self, device) -> Surrogate:
        """Move the weights to `device` (predict does it once, lazily, for the hidden states' device)."""
        device = torch.device(device)
        if device != self._device:
            for parts in self.weights.values():
                for name, tensor in parts.items():
                    parts[name] = tensor.to(device)
            self._device = device
        return self

    def predict(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """The predicted log KVzip scores [B, Hkv, q] (float32) of tokens whose attention input at layer `layer_idx`
        is `hidden` [B, q, d] (any float dtype; computed in float32)."""
        parts = self.weights.get(layer_idx)
        if parts is None:
            raise ValueError(f"`layer_idx` {layer_idx}: this surrogate has predictors for layers {self.layers}.")
        if hidden.dim() != 3 or hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"`hidden` must be [B, q, {self.hidden_size}], got {list(hidden.shape)}.")
        if self._device != hidden.device:
            self.to(hidden.device)
        x = hidden.to(torch.float32)
        if self.kind == "linear":
            out = F.linear(x, parts["weight"], parts["bias"])
        else:
            inner = F.silu(F.linear(x, parts["fc1.weight"], parts["fc1.bias"]))
            out = F.linear(inner, parts["fc2.weight"], parts["fc2.bias"])
        return out.transpose(1, 2)

    # -- checks -------------------------------------------------------------------------------------------------
    def check_model(self, config) -> None:
        """Raise ValueError when `config` (a model's config) does not have this surrogate's shapes: its hidden size,
        KV heads and layers (each predicted layer must exist)."""
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        problems = []
        if config.hidden_size != self.hidden_size:
            problems.append(f"hidden_size {config.hidden_size} (surrogate: {self.hidden_size})")
        if _kv_heads(config) != self.kv_heads:
            problems.append(f"cached KV heads {_kv_heads(config)} (surrogate: {self.kv_heads})")
        layers = config.num_hidden_layers
        if max(self.layers) >= layers or self.info.get("num_layers", layers) != layers:
            problems.append(f"num_hidden_layers {layers} (surrogate: {self.info.get('num_layers')}, {self.layers})")
        if problems:
            trained = self.info.get("model")
            raise ValueError(
                f"`config`: this KVzap surrogate{f' (trained for {trained!r})' if trained else ''} does not fit "
                f"{type(config).__name__}: {'; '.join(problems)}."
            )

    # -- files --------------------------------------------------------------------------------------------------
    def config(self) -> dict:
        """What config.json holds: format, shapes, then `info` (model, training settings, fit)."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "kind": self.kind,
            "hidden_size": self.hidden_size,
            "kv_heads": self.kv_heads,
            "width": self.width,
            "layers": self.layers,
            **{k: v for k, v in self.info.items() if k not in _SHAPE_KEYS},
        }

    def save(self, directory) -> Path:
        """Write `model.safetensors` and `config.json` into `directory` (created when missing); returns it."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            f"layers.{index}.{name}": t.detach().cpu().contiguous()
            for index, parts in self.weights.items()
            for name, t in parts.items()
        }
        save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": FORMAT})
        (directory / CONFIG_NAME).write_text(json.dumps(self.config(), indent=1) + "\n", encoding="utf-8")
        return directory

    @classmethod
    def load(cls, path_or_repo_id, revision: str | None = None, subfolder: str = "", **download_kwargs) -> Surrogate:
        """A surrogate from a local directory, a built-in name (`BUILTIN`: "smollm2"), else a Hub repo id
        (huggingface_hub.snapshot_download of its config.json and model.safetensors; `revision` and
        `download_kwargs` passed on). `subfolder`: the surrogate's folder inside the directory or repo (a model
        published with its surrogate: hf_kvcache.publish)."""
        if not isinstance(path_or_repo_id, (str, os.PathLike)):
            kind = type(path_or_repo_id).__name__
            raise ValueError(f"`path_or_repo_id` must be a path or a Hub repo id, got {kind}.")
        if not isinstance(subfolder, str) or subfolder.startswith("/") or ".." in Path(subfolder).parts:
            raise ValueError(f"`subfolder` must be a relative folder inside the directory or repo, got {subfolder!r}.")
        name = os.fspath(path_or_repo_id)
        directory = BUILTIN.get(name) or Path(name)
        if not directory.is_dir():
            directory = cls._download(name, revision, subfolder, download_kwargs)
        return cls._from_directory(directory / subfolder)

    @staticmethod
    def _download(name: str, revision, subfolder: str, download_kwargs) -> Path:
        if not _REPO_ID.fullmatch(name):
            raise ValueError(f"`path_or_repo_id` {name!r} is not a directory (nor a Hub repo id 'owner/name').")
        from huggingface_hub import snapshot_download

        prefix = f"{subfolder.strip('/')}/" if subfolder else ""
        try:
            found = snapshot_download(
                name,
                revision=revision,
                allow_patterns=[prefix + CONFIG_NAME, prefix + WEIGHTS_NAME],
                **download_kwargs,
            )
        except Exception as error:
            raise ValueError(
                f"`path_or_repo_id` {name!r} is not a local directory and could not be fetched from the Hub "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})."
            ) from None
        return Path(found)

    @classmethod
    def _from_directory(cls, directory: Path) -> Surrogate:
        from safetensors.torch import load_file

        config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
        if not config_path.is_file() or not weights_path.is_file():
            raise ValueError(
                f"`path_or_repo_id` {str(directory)!r}: a KVzap surrogate folder holds {CONFIG_NAME} and "
                f"{WEIGHTS_NAME}; missing {[p.name for p in (config_path, weights_path) if not p.is_file()]}."
            )
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"`path_or_repo_id`: {config_path} is not valid JSON ({error}).") from None
        if not isinstance(config, dict) or config.get("format") != FORMAT:
            raise ValueError(f"`path_or_repo_id`: {config_path} is not a KVzap surrogate config (format {FORMAT!r}).")
        if config.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"`path_or_repo_id`: {config_path} has format_version {config.get('format_version')!r}; this "
                f"hf_kvcache reads version {FORMAT_VERSION}."
            )
        tensors = load_file(str(weights_path))
        weights: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            _, index, part = key.split(".", 2)
            weights.setdefault(int(index), {})[part] = tensor
        surrogate = cls(config.get("kind"), weights, {k: v for k, v in config.items() if k not in _SHAPE_KEYS})
        declared = {k: config.get(k) for k in ("hidden_size", "kv_heads", "width", "layers")}
        actual = {"hidden_size": surrogate.hidden_size, "kv_heads": surrogate.kv_heads, "width": surrogate.width}
        actual["layers"] = surrogate.layers
        if declared != actual:
            raise ValueError(f"`path_or_repo_id`: {config_path} declares {declared} but the weights are {actual}.")
        return surrogate


_SHAPE_KEYS = ("format", "format_version", "kind", "hidden_size", "kv_heads", "width", "layers")

__all__ = ["BUILTIN", "FORMAT", "KINDS", "Surrogate"]
