"""Text sources: the offline corpus (Python's own `pydoc_data.topics`), a local file, or a `datasets` dataset."""

from __future__ import annotations

import os

OFFLINE_CORPUS = "pydoc"


def pydoc_text() -> str:
    """~113K SmolLM2 tokens of real English: the help topics shipped with CPython, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def load_text(source: str = OFFLINE_CORPUS, split: str = "test", field: str = "text", config: str | None = None) -> str:
    """Text from "pydoc" (offline), a path to a text file, or "hf:NAME" for a `datasets` dataset (needs network
    unless cached), whose `field` column is joined with blank lines."""
    if source == OFFLINE_CORPUS:
        return pydoc_text()
    if source.startswith("hf:"):
        import datasets

        data = datasets.load_dataset(source[3:], config, split=split)
        if field not in data.column_names:
            raise ValueError(f"`field` {field!r} is not a column of {source}; columns are {data.column_names}.")
        return "\n\n".join(t for t in data[field] if t)
    if os.path.isfile(source):
        with open(source, encoding="utf-8") as f:
            return f.read()
    raise ValueError(
        f"Unknown text source {source!r}: use 'pydoc' (offline corpus), a path to a text file, or 'hf:DATASET'."
    )


def load_tokens(tokenizer, source: str = OFFLINE_CORPUS, max_tokens: int | None = None, **kwargs):
    """Token ids [1, n] of a text source; raises if the source has fewer than `max_tokens` tokens (never truncates
    silently to something shorter than asked)."""
    import torch

    ids = tokenizer(load_text(source, **kwargs), return_tensors="pt", add_special_tokens=False).input_ids
    if max_tokens is not None:
        if ids.shape[1] < max_tokens:
            raise ValueError(f"`max_tokens`={max_tokens} but {source!r} has only {ids.shape[1]} tokens.")
        ids = ids[:, :max_tokens]
    return ids.to(torch.long)
