"""Helpers for the evaluation tests: an ASCII character tokenizer matching the tiny models' 128-token vocabulary."""

from __future__ import annotations


def char_tokenizer():
    """ASCII characters as token ids: no download, no training."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, "</s>": 3, **{chr(i): i for i in range(4, 128)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
