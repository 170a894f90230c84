"""The Python snippets of the pages a newcomer reads first (README.md, docs/index.md), as one program that runs on the
offline SmolLM2: a preamble defines what the snippets take as given (`model`, `inputs`), the snippets run in page
order, and checks after them assert what the text says they do (tokens generated, bytes held). tests/test_readme.py
runs it in the suite; tests/test_wheel.py runs it in a bare environment with the built wheel, so the pages cannot drift
from the API, in the checkout or as users install it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/index.md")

PREAMBLE = """\
import torch
from hf_kvcache.sharing.models import load_model

torch.manual_seed(0)
model, tokenizer = load_model("smollm2")  # the offline SmolLM2-135M-Instruct (stands for the reader's model)
model.generation_config.max_new_tokens = model.generation_config.min_new_tokens = 8
inputs = tokenizer("The KV cache holds the keys and values of every token seen so far, so", return_tensors="pt")
"""

CHECKS = """\
prompt_len = inputs["input_ids"].shape[1]
assert out.shape == (1, prompt_len + 8), out.shape
assert 0 < cache.nbytes(), cache.nbytes()
print("snippets ran:", {snippet_count}, "| last output", out.shape[1] - prompt_len, "new tokens | cache holds",
      cache.nbytes(), "bytes")
"""


def snippets(page: str) -> list[str]:
    """The ```python blocks of `page` (a path relative to the repository), in order."""
    text = (ROOT / page).read_text()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def program(pages=PAGES) -> str:
    """The preamble, every snippet of `pages` (each announced by a print, so a failure names its page and block),
    then the checks."""
    parts, count = [PREAMBLE], 0
    for page in pages:
        for i, block in enumerate(snippets(page), 1):
            parts.append(f"print({f'{page}, python block {i}'!r}, flush=True)\n{block}")
            count += 1
    return "\n".join(parts) + "\n" + CHECKS.format(snippet_count=count)
