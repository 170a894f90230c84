"""KVzip's reconstruction request (hf_kvcache.caches.kvzip): the text that asks the model to repeat its context, as
token ids, from a tokenizer or given directly (`request_ids`), checked against the model's vocabulary.

As kvpress's KVzipPress: "\\n\\nRepeat the previous context exactly." for the first chunk, "\\n\\nRepeat the part of
the previous context exactly, starting with" plus the previous chunk's last `PREVIOUS_TAIL` tokens for the others,
then the chat template's assistant prefix (a newline without a template), then the chunk.
"""

from __future__ import annotations

FIRST_REQUEST = "\n\nRepeat the previous context exactly."
NEXT_REQUEST = "\n\nRepeat the part of the previous context exactly, starting with"
PREVIOUS_TAIL = 8  # tokens of the previous chunk that start a later chunk's request
REQUEST_KEYS = ("first", "next", "suffix")


def request_ids_from_tokenizer(tokenizer) -> dict[str, list[int]]:
    """The reconstruction request as token ids: the two requests, and the suffix that opens the model's answer (the
    chat template's assistant prefix, found as kvpress does with a dummy user turn; a newline without a template)."""
    suffix = "\n"
    if getattr(tokenizer, "chat_template", None):
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": dummy + separator}], add_generation_prompt=True, tokenize=False
        )
        suffix = text.split(separator)[1]

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    return {"first": encode(FIRST_REQUEST), "next": encode(NEXT_REQUEST), "suffix": encode(suffix)}


def _check_request_ids(request_ids) -> dict[str, list[int]] | None:
    if request_ids is None:
        return None
    if not isinstance(request_ids, dict) or set(request_ids) != set(REQUEST_KEYS):
        raise ValueError(
            f"`request_ids` must be a dict with the keys {REQUEST_KEYS} (lists of token ids), got {request_ids!r}."
        )
    checked = {}
    for key in REQUEST_KEYS:
        ids = request_ids[key]
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise ValueError(f"`request_ids[{key!r}]` must be a list of token ids (ints >= 0), got {ids!r}.")
        checked[key] = list(ids)
    if not checked["first"]:
        raise ValueError("`request_ids['first']` must not be empty: it asks the model to repeat the context.")
    return checked


def request_ids_for_model(tokenizer, model) -> dict[str, list[int]]:
    """The request ids from `tokenizer` (a tokenizer, a name or a path; None: the model's own `name_or_path`),
    loaded now so a missing tokenizer fails before any token is generated."""
    if tokenizer is None:  # the model's own (a model built from a config has no name_or_path)
        tokenizer = getattr(model.config, "name_or_path", None) or getattr(model, "name_or_path", None) or None
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        except Exception as error:
            raise ValueError(
                f"KVzipCache needs a tokenizer for its reconstruction request and could not load one from "
                f"{tokenizer!r} ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). "
                "Give `tokenizer` (a name, a path or a tokenizer) or `request_ids`."
            ) from None
    if tokenizer is None:
        raise ValueError(
            "KVzipCache needs a tokenizer for its reconstruction request and the model has no "
            "`name_or_path` to load one from: give `tokenizer` (a name, a path or a tokenizer) "
            "or `request_ids`."
        )
    return request_ids_from_tokenizer(tokenizer)


def check_request_vocabulary(requests: dict[str, list[int]], vocab: int | None) -> None:
    too_large = [i for ids in requests.values() for i in ids if vocab is not None and i >= vocab]
    if too_large:
        raise ValueError(
            f"`request_ids`: token ids {too_large[:5]} are outside the model's vocabulary ({vocab} tokens)."
        )
