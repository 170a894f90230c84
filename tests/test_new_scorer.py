"""Adding a scorer reaches `generate` and serving with one module and one registry line (hf_kvcache/scorers/base.py):
a copy of the package gains a scorer module and its line in scorers/registry.py, nothing else, and in a fresh
interpreter the new name is a cache of `generate` and a `kv_compress` method of continuous batching, whose tokens equal
the eviction reference's (hf_kvcache.evaluation.eviction_reference) token for token."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import hf_kvcache

SCORER = '''"""Largest key norms (the opposite of Knorm): a scorer written for the test of adding one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Prompt, Scorer


@dataclass(eq=False)
class LargestKeys(Scorer):
    name: ClassVar[str] = "largest_keys"
    reads: ClassVar[str] = "keys"
    prompt_reads: ClassVar[tuple[str, ...]] = ("keys",)
    head_reduction: ClassVar[str] = "mean"

    def chunk_scores(self, host, view, real, seen):
        return view.incoming.keys.float().norm(dim=-1)

    def arrival(self, host, view, placement, keys, dest, seen_before):
        return keys.float().norm(dim=-1)

    def score(self, prompt: Prompt) -> torch.Tensor:
        return prompt.keys.float().norm(dim=-1)
'''

RUN = """
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import hf_kvcache
from hf_kvcache.evaluation import eviction_reference
from hf_kvcache.paged.compress_spec import parse
from hf_kvcache.paged.page_layout import default_layout

torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256)
model = LlamaForCausalLM(config).eval()
prompt = torch.randint(0, 64, (40,)).tolist()
greedy = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
cache_config = {"budget": 0.5, "compress": "prompt"}
out = model.generate(torch.tensor([prompt]), generation_config=greedy, cache_implementation="largest_keys",
                     cache_config=cache_config)
assert out.shape[1] == 46, out.shape
cb = ContinuousBatchingConfig(num_blocks=32, page_size=8, max_batch_tokens=64, allow_block_sharing=False)
cb.kv_compress = "largest_keys:budget=0.5"
batch = model.generate_batch([prompt], generation_config=greedy, continuous_batching_config=cb, warmup=False)
(served,) = batch.values()
assert served.error is None, served.error
# the reference of the default layout: head pages, or token pages where this transformers cannot read head pages
run = eviction_reference.generate_with_eviction
if default_layout() == "head":
    run = eviction_reference.generate_with_head_eviction
reference = run(model, prompt, parse("largest_keys:budget=0.5"), max_new_tokens=6)
knorm = run(model, prompt, parse("knorm:budget=0.5"), max_new_tokens=6)
print(served.generated_tokens == reference, reference != knorm)
"""


@pytest.mark.upstream
def test_a_scorer_added_in_one_module_and_one_registry_line_serves(tmp_path):
    package = pathlib.Path(hf_kvcache.__file__).parent
    copy = tmp_path / "hf_kvcache"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    (copy / "scorers" / "largest_keys.py").write_text(SCORER)
    registry = copy / "scorers" / "registry.py"
    text = registry.read_text()
    text = re.sub(r"(\nfrom \.tova import \w+\n)", r"\1from .largest_keys import LargestKeys\n", text, count=1)
    text, added = re.subn(r"(KVzap)\)\n", r"\1, LargestKeys)\n", text, count=1)
    assert added == 1, "the registry's tuple of scorer classes moved: update this test's edit"
    registry.write_text(text)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(pathlib.Path.home())}
    done = subprocess.run(
        [sys.executable, "-c", RUN], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True"], done.stdout
