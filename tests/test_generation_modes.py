"""Every generation mode of `model.generate` with every cache family (issue 12), on tiny random models.

Two sizes per family: "roomy" (a budget that holds the whole generation, so the cache keeps every token and must
give exactly what DynamicCache gives) and "tight" (the cache evicts, or quantizes: the reference is the cache's own
behaviour, a plain loop of forwards through a fresh cache of the same settings -- the path tests/test_equivalence.py
and the property tests check against references). Modes: greedy, seeded sampling, beam search (reorders: every
returned beam's token log-probs equal those of its sequence teacher-forced through a fresh cache), assisted
generation and prompt lookup (roll back with `crop`; evicting budgets are refused up front naming the cause),
`TextStreamer` (streamed text == returned text), `generate` called again on the same cache (a multi-turn chat with a
growing prompt from a tiny tokenizer's chat template), float32 / bfloat16 / float16.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, build_model, random_ids
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import DynamicCache, PreTrainedTokenizerFast, TextStreamer

import hf_kvcache
from hf_kvcache import CACHE_ARG, cache_kwargs

PROMPT, NEW = 10, 12
TOTAL = PROMPT + NEW  # tokens of one generation (the last one is never fed back)

#: family -> (settings that evict / quantize, settings that keep the whole generation at full precision or None)
FAMILIES = {
    "sink": ({"sinks": 2, "window": 6}, {"sinks": 2, "window": 160}),
    "sink_original": ({"sinks": 2, "window": 6, "position_mode": "original"}, None),
    "sliding": ({"window": 8}, {"window": 160}),
    "h2o": ({"heavy": 4, "recent": 4}, {"heavy": 80, "recent": 80}),
    "h2o_compact": ({"heavy": 4, "recent": 4, "position_mode": "compact"}, None),
    "random_eviction": ({"heavy": 4, "recent": 4}, {"heavy": 80, "recent": 80}),
    "composite": (
        {"preset": "sinks_heavy_recent", "budget": 12},
        {"preset": "sinks_heavy_recent", "budget": 160, "precision": "full"},
    ),
    "fp8": ({}, None),
    "kivi": ({"residual": 8, "group_size": 8}, None),
}
NAMES = {"sink_original": "sink", "h2o_compact": "h2o"}
EVICTING = [f for f in FAMILIES if f not in ("fp8", "kivi")]
ROOMY = [f for f, (_, roomy) in FAMILIES.items() if roomy is not None]


def cache_name(family: str) -> str:
    return NAMES.get(family, family)


def make_cache(family: str, model, roomy: bool = False):
    settings = FAMILIES[family][1 if roomy else 0]
    return hf_kvcache.CACHE_IMPLEMENTATIONS[cache_name(family)](model, **settings)


def selecting_kwargs(family: str, model, via: str, roomy: bool = False) -> dict:
    """generate() arguments selecting the cache: a built object, or the registered name with a cache_config."""
    if via == "cache_object":
        return cache_kwargs(make_cache(family, model, roomy))
    return {"cache_implementation": cache_name(family), "cache_config": FAMILIES[family][1 if roomy else 0]}


def reference_run(model, cache, turns, sample_seed=None, temperature=1.0, suppress=()):
    """A plain loop of forwards, as generate does it: per turn, the prompt's tokens not yet in the cache as one
    chunk, then one token per step; the last new token of a turn is not fed. `turns`: [(ids [1, n], new tokens)];
    each turn's ids start with everything before it. Greedy, or sampled with torch.multinomial after a seed."""
    if sample_seed is not None:
        torch.manual_seed(sample_seed)
    outputs = []
    with torch.no_grad():
        for ids, new in turns:
            sequence = ids
            feed = ids[:, cache.get_seq_length() :]
            for _ in range(new):
                logits = model(input_ids=feed, **cache_kwargs(cache), use_cache=True).logits[:, -1].float()
                if suppress:
                    logits[:, list(suppress)] = float("-inf")
                if sample_seed is None:
                    token = logits.argmax(-1, keepdim=True)
                else:
                    token = torch.multinomial((logits / temperature).softmax(-1), 1)
                sequence = torch.cat((sequence, token), -1)
                feed = token
            outputs.append(sequence)
    return outputs


# -- greedy and sampling --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("via", ["cache_object", "cache_implementation"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equals_reference_loop(family, via):
    model = build_model("llama")
    ids = random_ids(1, PROMPT, seed=3)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, **selecting_kwargs(family, model, via))
    (expected,) = reference_run(model, make_cache(family, model), [(ids, NEW)])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("via", ["cache_object", "cache_implementation"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_seeded_sampling_equals_reference_loop(family, via):
    model = build_model("llama")
    ids = random_ids(1, PROMPT, seed=4)
    torch.manual_seed(123)
    out = model.generate(
        ids,
        max_new_tokens=NEW,
        do_sample=True,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        **selecting_kwargs(family, model, via),
    )
    (expected,) = reference_run(model, make_cache(family, model), [(ids, NEW)], sample_seed=123, temperature=0.7)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("family", ROOMY)
def test_roomy_cache_equals_dynamic_cache_greedy_and_sampling(family):
    model = build_model("llama")
    ids = random_ids(1, PROMPT, seed=5)
    for kwargs in ({"do_sample": False}, {"do_sample": True, "temperature": 0.7}):
        torch.manual_seed(7)
        expected = model.generate(ids, max_new_tokens=NEW, **cache_kwargs(DynamicCache()), **kwargs)
        torch.manual_seed(7)
        out = model.generate(ids, max_new_tokens=NEW, **cache_kwargs(make_cache(family, model, roomy=True)), **kwargs)
        assert torch.equal(out, expected), kwargs


# -- beam search ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ROOMY)
def test_beam_search_roomy_equals_dynamic_cache(family):
    model = build_model("llama")
    ids = random_ids(2, PROMPT, seed=6)
    kwargs = dict(max_new_tokens=NEW, num_beams=3, num_return_sequences=3, do_sample=False, length_penalty=0.0)
    expected = model.generate(ids, **cache_kwargs(DynamicCache()), **kwargs)
    out = model.generate(ids, **cache_kwargs(make_cache(family, model, roomy=True)), **kwargs)
    assert torch.equal(out, expected)


# random_eviction draws its keys by batch row, so a beam moved to another row evicts differently from the same
# sequence alone in row 0: its reference is not a single-row run (its beams are checked in the roomy test above)
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"random_eviction"}))
def test_beam_search_reorders_each_beams_cache(family):
    """Every returned beam's per-token log-probs (reordered caches) equal those of its own sequence run through a
    fresh cache of the same settings, one token per step: a beam never sees another beam's tokens."""
    model = build_model("llama")
    ids = random_ids(1, PROMPT, seed=8)
    out = model.generate(
        ids,
        max_new_tokens=NEW,
        num_beams=3,
        num_return_sequences=3,
        do_sample=False,
        length_penalty=0.0,
        output_scores=True,
        return_dict_in_generate=True,
        **cache_kwargs(make_cache(family, model)),
    )
    scores = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
    assert len({tuple(s.tolist()) for s in out.sequences}) == 3  # three different beams
    for row, sequence in enumerate(out.sequences):
        cache = make_cache(family, model)
        with torch.no_grad():
            logits = [model(input_ids=sequence[None, :PROMPT], **cache_kwargs(cache)).logits[:, -1]]
            for t in range(PROMPT, sequence.shape[0] - 1):
                logits.append(model(input_ids=sequence[None, t : t + 1], **cache_kwargs(cache)).logits[:, -1])
        logprobs = torch.cat(logits).float().log_softmax(-1)
        expected = logprobs.gather(-1, sequence[PROMPT:, None])[:, 0]
        torch.testing.assert_close(scores[row], expected, atol=2e-5, rtol=1e-5)


# -- assisted generation and prompt lookup --------------------------------------------------------------------------
ASSISTED = {
    "assistant": lambda: {"assistant_model": build_model("llama", seed=1, num_hidden_layers=1)},
    "prompt_lookup": lambda: {"prompt_lookup_num_tokens": 3},
}


def _repetitive_prompt():
    """A prompt that repeats itself, so prompt lookup proposes (and the model rejects) candidates."""
    base = random_ids(1, 5, seed=9)
    return torch.cat((base, base), -1)


@pytest.mark.parametrize("mode", sorted(ASSISTED))
@pytest.mark.parametrize("via", ["cache_object", "cache_implementation"])
@pytest.mark.parametrize("family", ROOMY)
def test_assisted_roomy_equals_greedy_dynamic_cache(family, via, mode):
    model = build_model("llama")
    ids = _repetitive_prompt()
    expected = model.generate(ids, max_new_tokens=NEW, do_sample=False, **cache_kwargs(DynamicCache()))
    out = model.generate(
        ids, max_new_tokens=NEW, do_sample=False, **ASSISTED[mode](), **selecting_kwargs(family, model, via, roomy=True)
    )
    assert torch.equal(out, expected)


@pytest.mark.parametrize("mode", sorted(ASSISTED))
@pytest.mark.parametrize("family", ["fp8", "kivi"])
def test_assisted_with_quantized_caches(family, mode):
    """Keep-all quantized caches serve assisted generation (rejected candidates are cropped): the whole generation,
    and the cache holds exactly the sequence afterwards."""
    model = build_model("llama")
    ids = _repetitive_prompt()
    cache = make_cache(family, model)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, **cache_kwargs(cache), **ASSISTED[mode]())
    assert out.shape[-1] == ids.shape[-1] + NEW
    assert all(layer.get_seq_length() == out.shape[-1] - 1 for layer in cache.layers)


@pytest.mark.parametrize("family, candidates, exact", [("fp8", 3, True), ("kivi", 2, True), ("kivi", 3, False)])
def test_quantized_crop_undoes_a_rejected_chunk(family, candidates, exact, tmp_path):
    """What assisted generation does on rejection: a chunk of candidates goes in, is cropped, the next token comes.
    The logits equal those of a copy of the cache (saved state) that never saw the candidates -- exactly, except
    when the candidates completed a KIVI key block (13 + 3 tokens, residual 8, group 8): the block's older tokens
    were quantized then and stay quantized after the crop (a crop cannot un-quantize), so they differ by rounding."""
    model = build_model("llama")
    cache = make_cache(family, model)
    with torch.no_grad():
        model(input_ids=random_ids(1, PROMPT, seed=11), **cache_kwargs(cache))
        for t in range(3):
            model(input_ids=random_ids(1, 1, seed=20 + t), **cache_kwargs(cache))
        hf_kvcache.save_cache_state(cache, tmp_path / "before.safetensors")
        twin = hf_kvcache.load_cache_state(tmp_path / "before.safetensors", model)
        model(input_ids=random_ids(1, candidates, seed=30), **cache_kwargs(cache))  # candidates, all rejected
        cache.crop(-candidates)
        token = random_ids(1, 1, seed=31)
        got = model(input_ids=token, **cache_kwargs(cache)).logits
        want = model(input_ids=token, **cache_kwargs(twin)).logits
    assert cache.get_seq_length() == twin.get_seq_length() == PROMPT + 4
    if exact:
        assert torch.equal(got, want)
    else:
        assert cache.layers[0].store.qlen > twin.layers[0].store.qlen
        assert not torch.equal(got, want)
        torch.testing.assert_close(got, want, atol=0.3, rtol=0)


@pytest.mark.parametrize("mode", sorted(ASSISTED))
@pytest.mark.parametrize("via", ["cache_object", "cache_implementation"])
@pytest.mark.parametrize("family", EVICTING)
def test_assisted_with_an_evicting_budget_is_refused_up_front(family, via, mode):
    model = build_model("llama")
    kwargs = selecting_kwargs(family, model, via)
    with pytest.raises(
        ValueError,
        match=r"cannot serve assisted generation / prompt lookup .* rolled back with "
        r"`crop`.* Give a budget of at least 23",
    ):
        model.generate(_repetitive_prompt(), max_new_tokens=NEW, do_sample=False, **ASSISTED[mode](), **kwargs)
    if via == "cache_object":
        assert kwargs[CACHE_ARG].get_seq_length() == 0  # refused before any forward


def test_direct_crop_after_eviction_names_the_cause():
    model = build_model("llama")
    cache = make_cache("sink", model)
    with torch.no_grad():
        model(input_ids=random_ids(1, PROMPT), **cache_kwargs(cache))
    with pytest.raises(ValueError, match=r"Cannot crop SinkWindowPolicy after it evicted tokens"):
        cache.crop(-2)
    assert cache.get_seq_length() == PROMPT


# -- streaming, multi-turn chat -------------------------------------------------------------------------------------
SPECIALS = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>"]


def tiny_chat_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer with exactly VOCAB tokens (4 special, the rest single characters, so decoding
    and encoding again give the same ids) and a ChatML template."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    chars += [chr(c) for c in range(0xC0, 0xC0 + VOCAB - len(SPECIALS) - len(chars))]
    vocab = {token: i for i, token in enumerate(SPECIALS + chars)}
    assert len(vocab) == VOCAB
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        additional_special_tokens=SPECIALS[2:],
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


class CollectingStreamer(TextStreamer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True)
        self.pieces: list[str] = []

    def on_finalized_text(self, text: str, stream_end: bool = False):
        self.pieces.append(text)


SUPPRESS = list(range(len(SPECIALS)))  # keep special tokens out of replies (a random model would emit them)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_text_streamer_streams_the_returned_text(family):
    tokenizer = tiny_chat_tokenizer()
    model = build_model("llama")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello, cache!"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    streamer = CollectingStreamer(tokenizer)
    out = model.generate(
        ids,
        max_new_tokens=NEW,
        do_sample=False,
        streamer=streamer,
        suppress_tokens=SUPPRESS,
        **cache_kwargs(make_cache(family, model)),
    )
    text = tokenizer.decode(out[0, ids.shape[-1] :])
    assert "".join(streamer.pieces) == text and len(text) == NEW
    (expected,) = reference_run(model, make_cache(family, model), [(ids, NEW)], suppress=SUPPRESS)
    assert torch.equal(out, expected)


USER_TURNS = ["Hi there.", "Tell me more, please!", "And then?"]


def _chat(model, tokenizer, cache, new=8):
    """Three turns on one cache: each turn's prompt is the chat template over the whole conversation so far."""
    messages, turns, outputs = [], [], []
    for user in USER_TURNS:
        messages.append({"role": "user", "content": user})
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        if outputs:  # the growing prompt starts with everything the cache has seen
            assert torch.equal(ids[:, : outputs[-1].shape[-1]], outputs[-1])
        out = model.generate(ids, max_new_tokens=new, do_sample=False, suppress_tokens=SUPPRESS, **cache_kwargs(cache))
        assert cache.get_seq_length() == out.shape[-1] - 1
        messages.append({"role": "assistant", "content": tokenizer.decode(out[0, ids.shape[-1] :])})
        turns.append((ids, new))
        outputs.append(out)
    return turns, outputs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_multi_turn_chat_on_one_cache_equals_reference_loop(family):
    """generate called again on the same cache object continues the conversation: equal to the reference loop
    that feeds the same chunks (each turn's new prompt tokens, then one token per step) through one cache."""
    tokenizer = tiny_chat_tokenizer()
    model = build_model("llama")
    turns, outputs = _chat(model, tokenizer, make_cache(family, model))
    expected = reference_run(model, make_cache(family, model), turns, suppress=SUPPRESS)
    for out, want in zip(outputs, expected):
        assert torch.equal(out, want)


@pytest.mark.parametrize("family", ROOMY)
def test_multi_turn_chat_roomy_equals_one_generate_over_the_conversation(family):
    """Where the policy keeps everything, continuing the cache equals a fresh DynamicCache generate over the whole
    conversation each turn."""
    tokenizer = tiny_chat_tokenizer()
    model = build_model("llama")
    turns, outputs = _chat(model, tokenizer, make_cache(family, model, roomy=True))
    for (ids, new), out in zip(turns, outputs):
        fresh = model.generate(
            ids, max_new_tokens=new, do_sample=False, suppress_tokens=SUPPRESS, **cache_kwargs(DynamicCache())
        )
        assert torch.equal(out, fresh)


# -- dtypes ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dtypes_on_cpu(family, dtype):
    model = build_model("llama").to(dtype)
    ids = random_ids(1, PROMPT, seed=10)
    cache = make_cache(family, model)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, **cache_kwargs(cache))
    (expected,) = reference_run(model, make_cache(family, model), [(ids, NEW)])
    assert torch.equal(out, expected)
    stored = [layer for layer in cache.compressed_layers if layer.is_initialized]
    assert stored and all(layer.dtype == dtype for layer in stored)
    if FAMILIES[family][1] is not None:  # keeping everything: DynamicCache's logits up to the dtype's rounding
        sequence = torch.cat((ids, random_ids(1, NEW, seed=12)), -1)
        got = _teacher_forced(model, make_cache(family, model, roomy=True), sequence)
        want = _teacher_forced(model, DynamicCache(), sequence)
        torch.testing.assert_close(got, want, atol=LOGIT_ATOL[dtype], rtol=0)


# max |difference| measured: 4e-6, 0.105, 0.008 on logits up to ~5.5 (bf16 spacing there: 0.03)
LOGIT_ATOL = {torch.float32: 1e-4, torch.bfloat16: 0.2, torch.float16: 0.03}


def _teacher_forced(model, cache, sequence):
    """Logits [1, T, V] (float32) of a prompt chunk then one token per step."""
    with torch.no_grad():
        logits = [model(input_ids=sequence[:, :PROMPT], **cache_kwargs(cache)).logits]
        for t in range(PROMPT, sequence.shape[-1]):
            logits.append(model(input_ids=sequence[:, t : t + 1], **cache_kwargs(cache)).logits)
    return torch.cat(logits, 1).float()
