"""Property tests: every cache against its simple reference (tests/references.py) under random use.

A hypothesis state machine per cache drives a cache layer and the reference through the same random sequence of
first forwards (batch 1-4, random left padding), prefill chunks, one-token decode steps, beam reorders, crops,
resets, batch_repeat_interleave and batch_select_indices. Keys and values are random, rotated by the model's RoPE at
their positions as attention hands them to the cache; H2O-style policies get the same synthetic attention
probabilities as the reference (a random table per forward, looked up by each column's token). After every step, for
every row and KV head:
- the kept token set (original positions) equals the reference's;
- the stored keys (re-rotated where the cache moves positions) and values equal the reference's within its
  precision (exact for full precision, documented bounds for FP8 / integer regions);
- for full-precision caches, attention of a random query over the layer's valid columns equals attention over the
  reference's kept tokens;
- `get_seq_length` is the tokens seen;
and a crop after an eviction (ValueError) or into a quantized block (NotImplementedError) is refused, leaving the
cache as it was.

Examples are bounded and derandomized (CI reproducible); failures found while writing these are kept as explicit
regression runs at the end of this file.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_config
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from references import (
    CompositeRule,
    FP8TokenPrecision,
    HeavyHitterRule,
    KeepAllRule,
    KIVIPrecision,
    Reference,
    Rope,
    SinkWindowRule,
)

from hf_kvcache import CompositeCache, H2OCache, KIVICache, QuantizedFP8Cache, SinkCache, SlidingWindowCache
from hf_kvcache.caches.eviction import RandomEvictionCache

CONFIG = build_config("llama", num_hidden_layers=1)
HEADS = CONFIG.num_key_value_heads
HEAD_DIM = CONFIG.hidden_size // CONFIG.num_attention_heads
MAX_BATCH = 4
ROPE = Rope(CONFIG)

SETTINGS = settings(
    max_examples=40,
    stateful_step_count=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


# -- the caches and their references ------------------------------------------------------------------------------
def sink_pair(draw, position_mode):
    sinks, window = draw(st.integers(0, 3)), draw(st.integers(1, 5))
    cache = SinkCache(CONFIG, sinks=sinks, window=window, position_mode=position_mode)
    return cache, SinkWindowRule(sinks, window, move_sinks=position_mode == "cache" and sinks > 0)


def sliding_pair(draw):
    window = draw(st.integers(1, 6))
    return SlidingWindowCache(CONFIG, window=window), SinkWindowRule(0, window, move_sinks=False)


def h2o_pair(draw, position_mode):
    heavy, recent = draw(st.integers(0, 3)), draw(st.integers(1, 3))
    cache = H2OCache(CONFIG, heavy=heavy, recent=recent, position_mode=position_mode, attention_score="accumulated")
    return cache, HeavyHitterRule(heavy, recent, compact=position_mode == "compact")


def random_pair(draw):
    heavy, recent, seed = draw(st.integers(0, 3)), draw(st.integers(1, 3)), draw(st.integers(0, 2**20))
    cache = RandomEvictionCache(CONFIG, heavy=heavy, recent=recent, seed=seed)
    return cache, HeavyHitterRule(heavy, recent, compact=False, random_seed=seed)


def composite_pair(draw):
    sinks = draw(st.integers(0, 2))
    first = draw(st.integers(1, 3))
    second = draw(st.integers(0, 3))
    precision = draw(st.sampled_from(["full", "fp8_e4m3"]))
    final = draw(st.sampled_from(["evict", "keep", "heavy"]))
    heavy = draw(st.integers(1, 3)) if final == "heavy" else 0
    final_precision = draw(st.sampled_from(["full", "fp8_e4m3"]))
    sink_positions = draw(st.sampled_from(["cache", "original"]))
    regions = ([{"role": "sinks", "tokens": sinks}] if sinks else []) + [{"role": "window", "start": 0, "end": first}]
    windows = [(0, first, "full")]
    if second:
        regions.append(
            {"role": "window", "start": first, "end": first + second, "keys": precision, "values": precision}
        )
        windows.append((first, first + second, precision))
    if final == "heavy":
        regions.append({"role": "heavy", "tokens": heavy, "keys": final_precision, "values": final_precision})
    elif final == "keep":
        regions.append({"role": "rest", "keys": final_precision, "values": final_precision})
    cache = CompositeCache(CONFIG, regions=regions, sink_positions=sink_positions)
    rule = CompositeRule(
        sinks,
        windows,
        final,
        heavy,
        final_precision if final != "evict" else "full",
        move_sinks=sink_positions == "cache" and sinks > 0,
        sink_precision="full",
    )
    return cache, rule


def fp8_pair(draw):
    residual = draw(st.sampled_from([0, 0, 3]))
    rotation = draw(st.sampled_from(["none", "hadamard"]))
    cache = QuantizedFP8Cache(CONFIG, residual=residual, key_rotation=rotation, attention="dequantize")
    return cache, KeepAllRule(FP8TokenPrecision(residual))


def kivi_pair(draw):
    group = draw(st.sampled_from([2, 4]))
    residual = draw(st.sampled_from([0, 2, 5]))
    cache = KIVICache(CONFIG, bits=4, group_size=group, residual=residual, backend="quanto", attention="dequantize")
    return cache, KeepAllRule(KIVIPrecision(4, group, group, residual))


PAIRS = {
    "sink_cache": lambda draw: sink_pair(draw, "cache"),
    "sink_original": lambda draw: sink_pair(draw, "original"),
    "sliding": sliding_pair,
    "h2o_original": lambda draw: h2o_pair(draw, "original"),
    "h2o_compact": lambda draw: h2o_pair(draw, "compact"),
    "random_eviction": random_pair,
    "composite": composite_pair,
    "fp8": fp8_pair,
    "kivi": kivi_pair,
}


# -- driving a cache layer as attention would -----------------------------------------------------------------------
def column_scores(layer, table, positions, real) -> torch.Tensor:
    """Synthetic attention [B, H, columns] for the columns of the layer's last update: each valid column gets the
    table's entry for its token's position (padding and empty slots get 0)."""

    def lookup(pos):  # pos [B, H, n] -> table values
        return table.gather(2, pos.long().clamp(0, table.shape[-1] - 1))  # (stale positions of empty slots: masked)

    if layer._pending is not None:  # a multi-token forward: stored slots, then the new tokens
        used = layer.used
        past = lookup(layer.head_positions()[..., :used]) * layer.slot_valid[..., :used]
        new_pos = positions[:, None, :].expand(-1, HEADS, -1)
        new = lookup(new_pos) * real[:, None, :]
        return torch.cat((past, new), -1)
    width = layer._attention_columns.shape[-1]
    return lookup(layer.head_positions()[..., :width]) * layer._attention_columns


def attend(q, keys, values):
    weights = torch.softmax(keys @ q / HEAD_DIM**0.5, dim=0)
    return weights @ values


class CacheMachine(RuleBasedStateMachine):
    kind = ""

    def __init__(self):
        super().__init__()
        self.cache = None

    @rule(data=st.data())
    @precondition(lambda self: self.cache is None)
    def build(self, data):
        self.cache, rule_ = PAIRS[self.kind](data.draw)
        self.ref = Reference(rule_, HEADS, ROPE)
        self.mask = None  # [B, seen] the 2-D attention mask so far
        self.generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))

    # -- forwards -----------------------------------------------------------------------------------------------
    def _forward(self, new_mask: torch.Tensor) -> None:
        batch, q = new_mask.shape
        mask = new_mask if self.mask is None or self.mask.shape[1] == 0 else torch.cat((self.mask, new_mask), -1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -q:]
        raw = torch.randn(batch, HEADS, q, HEAD_DIM, generator=self.generator)
        values = torch.randn(batch, HEADS, q, HEAD_DIM, generator=self.generator)
        keys = ROPE.rotate_batch(raw, positions)
        table = torch.rand(batch, HEADS, int(positions.max()) + 1, generator=self.generator)
        real = new_mask.bool()
        self.cache.begin_forward(q, batch, torch.device("cpu"), attention_mask=mask, position_ids=positions)
        self.cache.forward_info.attention_bridged = True  # this driver plays the bridge (keys may be stored rotated)
        for layer in self.cache.compressed_layers:
            layer.update(keys, values)
            if layer.policy.needs_attention:
                layer.policy.observe(layer.view, column_scores(layer, table, positions, real))
        self.ref.forward(raw, values, real, positions, attention=lambda b, h, p: table[b, h, p])
        self.mask = mask

    @rule(data=st.data())
    @precondition(lambda self: self.cache is not None and self.ref.seen == 0)
    def first_forward(self, data):
        batch = len(self.ref.rows) or data.draw(st.integers(1, MAX_BATCH), label="batch")
        lengths = data.draw(st.lists(st.integers(1, 6), min_size=batch, max_size=batch), label="lengths")
        width = max(lengths)
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
        self._forward(mask)

    @rule(q=st.integers(2, 4))
    @precondition(lambda self: self.cache is not None and self.ref.seen > 0)
    def chunk(self, q):
        self._forward(torch.ones(len(self.ref.rows), q, dtype=torch.long))

    @rule()
    @precondition(lambda self: self.cache is not None and self.ref.seen > 0)
    def decode(self):
        self._forward(torch.ones(len(self.ref.rows), 1, dtype=torch.long))

    # -- cache operations ---------------------------------------------------------------------------------------
    def _rows(self, indices: list[int]) -> None:
        self.ref.select(indices)
        self.mask = self.mask[indices]

    @rule(data=st.data())
    @precondition(lambda self: self.cache is not None and self.ref.seen > 0)
    def reorder(self, data):
        batch = len(self.ref.rows)
        beams = data.draw(st.lists(st.integers(0, batch - 1), min_size=batch, max_size=batch), label="beam_idx")
        self.cache.reorder_cache(torch.tensor(beams))
        self._rows(beams)

    @rule(repeats=st.integers(1, 4))
    @precondition(lambda self: self.cache is not None and self.ref.seen > 0)
    def repeat_interleave(self, repeats):
        batch = len(self.ref.rows)
        if batch * repeats > MAX_BATCH:
            repeats = 1
        self.cache.batch_repeat_interleave(repeats)
        self._rows([i for i in range(batch) for _ in range(repeats)])

    @rule(data=st.data())
    @precondition(lambda self: self.cache is not None and self.ref.seen > 0)
    def select(self, data):
        batch = len(self.ref.rows)
        chosen = data.draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch, unique=True), label="rows")
        self.cache.batch_select_indices(torch.tensor(chosen))
        self._rows(chosen)

    @rule(remove=st.integers(1, 3))
    @precondition(lambda self: self.cache is not None and self.ref.seen > 0)
    def crop(self, remove):
        refusal = None
        if self.ref.evicted_any:
            refusal = (ValueError, "Cannot crop .* after it evicted tokens")
        elif self.ref.crop_splits_quantized_block(remove):
            refusal = (NotImplementedError, "cannot crop to .* cannot be split")
        if refusal is not None:  # refused, and the cache is left as it was (still usable: the machine goes on)
            before = self.snapshot()
            with pytest.raises(refusal[0], match=refusal[1]):
                self.cache.crop(-remove)
            after = self.snapshot()
            assert before[0] == after[0] and all(torch.equal(x, y) for x, y in zip(before[1], after[1]))
            return
        self.ref.crop(remove)
        self.cache.crop(-remove)
        self.mask = self.mask[:, : self.ref.seen]

    @rule()
    @precondition(lambda self: self.cache is not None and self.ref.seen > 0)
    def reset(self):
        self.cache.reset()
        self.ref.reset()
        self.mask = None

    def snapshot(self):
        layer = self.cache.compressed_layers[0]
        tensors = [layer.slot_valid.clone()] + ([layer.slot_pos.clone()] if layer.slot_pos is not None else [])
        return (layer.seen, layer.used), tensors

    # -- the properties -----------------------------------------------------------------------------------------
    @invariant()
    def matches_reference(self):
        if self.cache is None:
            return
        assert self.cache.get_seq_length() == self.ref.seen
        if self.ref.seen == 0:
            return
        for layer in self.cache.compressed_layers:
            self.check_layer(layer)

    def check_layer(self, layer):
        layer.policy.before_read(layer.view)  # what the next read sees (re-rotated sinks / compact positions)
        width = layer.used
        keys, values = layer.store.read(width)
        valid = layer.slot_valid[..., :width]
        assert valid.shape[0] == len(self.ref.rows)
        for b, row in enumerate(self.ref.rows):
            by_stream = {t.stream: t for t in row.tokens}
            for h in range(HEADS):
                hm = h if valid.shape[1] > 1 else 0
                cols = valid[b, hm].nonzero()[:, 0]
                if layer.slot_pos is None:  # keep-all: slot i holds stream index i
                    got = [by_stream[int(c)].position for c in cols]
                else:
                    got = layer.head_positions()[b, hm, cols].tolist()
                kept, pos, want_k, want_v, key_tol, value_tol = self.ref.expected(b, h, layer.key_rotation)
                want = [t.position for t in kept]
                assert sorted(got) == want, f"row {b} head {h}: kept positions {sorted(got)}, reference {want}"
                order = torch.tensor(sorted(range(len(got)), key=lambda i: got[i]), dtype=torch.long)
                got_k, got_v = keys[b, h, cols[order]], values[b, h, cols[order]]
                key_err, value_err = (got_k - want_k).abs(), (got_v - want_v).abs()
                assert (key_err <= key_tol).all(), (
                    f"row {b} head {h}: keys off by {key_err.max():.3g} (positions {want}, moved to {pos})"
                )
                assert (value_err <= value_tol).all(), f"row {b} head {h}: values off by {value_err.max():.3g}"
                if kept and float(key_tol.max()) <= 1e-5:  # full precision: attention output over the valid columns
                    q = torch.randn(HEAD_DIM, generator=self.generator)
                    out = attend(q, keys[b, h, cols], values[b, h, cols])
                    torch.testing.assert_close(out, attend(q, want_k, want_v), atol=1e-5, rtol=1e-5)


def machine_for(kind: str):
    machine = type(f"{kind}_machine", (CacheMachine,), {"kind": kind})
    case = machine.TestCase
    case.settings = SETTINGS
    return case


TestSinkCache = machine_for("sink_cache")
TestSinkOriginal = machine_for("sink_original")
TestSliding = machine_for("sliding")
TestH2OOriginal = machine_for("h2o_original")
TestH2OCompact = machine_for("h2o_compact")
TestRandomEviction = machine_for("random_eviction")
TestComposite = machine_for("composite")
TestFP8 = machine_for("fp8")
TestKIVI = machine_for("kivi")


# -- regressions: failing sequences the machines found, replayed exactly --------------------------------------------
class Draws:
    """Stands in for hypothesis' `data` with the values of a recorded failing example, in draw order."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy, label=None):
        return self.values.pop(0)


def replay(kind: str, build: tuple, steps: list[tuple]) -> None:
    machine = type(f"{kind}_machine", (CacheMachine,), {"kind": kind})()
    machine.build(Draws(*build))
    machine.matches_reference()
    for name, *args in steps:
        method = getattr(machine, name)
        if name in ("first_forward", "reorder", "select"):
            method(Draws(*args))
        else:
            method(*args)
        machine.matches_reference()
    machine.teardown()


def test_regression_composite_padded_row_sink_written_in_decode():
    """A left-padded row's second real token arrives in decode as a sink: it was marked valid but never written
    (the sinks region was skipped by the write's region hint), so attention read zeros there."""
    # sinks 2, window [0, 2) + [2, 4) full, "rest" kept in full precision, sink_positions "cache", seed
    replay("composite", (2, 2, 2, "full", "keep", "full", "cache", 341), [("first_forward", 3, [5, 3, 1]), ("decode",)])


def test_regression_composite_crop_replaces_survivors_by_age():
    """After a crop the surviving tokens are younger: they must move back to the windows of their new ages (they
    stayed in the older regions, outside the columns read, and were lost)."""
    # no sinks, window [0, 1) + [1, 4) in FP8, heavy 2 in full precision, seed
    replay(
        "composite",
        (0, 1, 3, "fp8_e4m3", "heavy", 2, "full", "cache", 9467),
        [("first_forward", 3, [4, 5, 6]), ("select", [1, 0, 2]), ("repeat_interleave", 1), ("crop", 3)],
    )


def test_regression_composite_crop_to_nothing_then_a_new_prompt():
    """Crops down to no tokens, then a new padded prompt and crops again: cropped slots must not come back."""
    replay(
        "composite",
        (0, 2, 3, "full", "heavy", 2, "full", "cache", 7198),
        [
            ("first_forward", 4, [2, 4, 2, 1]),
            ("crop", 2),
            ("crop", 2),
            ("first_forward", [6, 3, 2, 4]),
            ("crop", 1),
            ("crop", 1),
        ],
    )


def test_regression_composite_quantized_region_after_batch_select():
    """A quantized region read after batch_select_indices: every buffer of the region store follows the rows."""
    # no sinks, window [0, 1) full, everything older kept in FP8, seed
    replay(
        "composite",
        (0, 1, 0, "full", "keep", "fp8_e4m3", "cache", 1),
        [("first_forward", 2, [3, 3]), ("select", [1]), ("decode",), ("repeat_interleave", 2), ("decode",)],
    )


def test_regression_kivi_crop_into_a_quantized_block_is_refused_and_the_cache_stays_usable():
    """A crop into a quantized block was accepted, and every later forward raised: now the crop itself refuses."""
    # KIVI 4-bit, key blocks of 4 tokens, no residual, seed
    replay(
        "kivi",
        (4, 0, 1),
        [
            ("first_forward", 4, [2, 6, 6, 4]),
            ("select", [3, 2, 0]),
            ("chunk", 4),
            ("select", [2]),
            ("chunk", 2),
            ("chunk", 4),
            ("crop", 3),
            ("decode",),
            ("crop", 1),
            ("decode",),
        ],
    )


def test_regression_composite_new_prompt_after_cropping_everything():
    """Sinks re-positioned ("cache") after a crop to no tokens: the next prompt's read had no columns after the sinks
    to find the oldest other token in (an IndexError from amin over nothing)."""
    # sinks 1, window [0, 2) full + [2, 4) full, heavy 3 in FP8, sink_positions "cache", seed
    replay(
        "composite",
        (1, 2, 2, "full", "heavy", 3, "fp8_e4m3", "cache", 4548),
        [("first_forward", 2, [6, 6]), ("crop", 3), ("crop", 2), ("crop", 3), ("first_forward", [1, 6])],
    )
