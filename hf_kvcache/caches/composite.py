"""CompositeCache: regions with their own role and precision in one cache, from a small declarative config.

    regions = [
        {"role": "sinks", "tokens": 4},                                      # first tokens, full precision
        {"role": "window", "start": 0, "end": 128},                          # the last 128 tokens
        {"role": "window", "start": 128, "end": 8192, "keys": "fp8_e4m3", "values": "fp8_e4m3"},
        {"role": "rest", "keys": "fp8_e4m3", "values": "int4"},              # everything older, kept
    ]
    # or, instead of "rest": {"role": "heavy", "tokens": 64, "keys": ..., "values": ...}  (H2O heavy hitters;
    #   "scorer": any name of hf_kvcache.scorers.HEAVY_SCORERS ranks them as that scorer's cache does, the scorer's
    #   parameters as keys of the region, e.g. snapkv's "window" (observation window, 64) and "kernel" (5); a
    #   scorer's "sinks" defaults to the sinks region's tokens);
    # with neither, tokens older than the last window are evicted.

Windows are age ranges (tokens back from the newest) and must tile [0, end) without overlap or gap. `keys` and
`values` name a precision ("full", the default, or a quantized format of hf_kvcache.stores.quantization).
The config is plain JSON, so it round-trips through `generate(cache_config={"regions": [...]})`.

Decode cost does not grow with the regions (the fast path, issue 13): regions are laid out by precision, not by
name. Adjacent windows of the same precision share one ring (a token keeps its slot while it ages through them),
and heavy hitters at the precision of the last window share one pool of slots with it: a token keeps its slot from
the moment it enters the window until it is evicted, and the new token takes the evicted one's slot (as H2OCache
does). So the preset moves no token between regions at all. Other moves are one token per region boundary per
step: into a region of the same per-token format (e.g. a window into a 'rest' of its precision) the codes and scales
are copied as they are; into another precision the token is dequantized and quantized again (what a change of
precision is). Reads write every region into one shared workspace buffer (no concatenation); with
`attention="blockwise"` (what the default "auto" picks when the keys are on CUDA, the Triton kernel, and in eager CPU
decode steps, the native kernel) there is no such read at all: attention reads each region's codes and the sinks'
full-precision keys where they are (hf_kvcache.layers.codes_read), so a decode step's work outside attention itself no
longer grows with the regions. `attention_block`: tokens dequantized at a time by the torch block path (when neither
kernel runs, docs/blockwise_attention.md). With a fixed budget the cache is compileable (its decode
traces whole; policies/composite.py, hf_kvcache.common.compile_static).
The tokens kept are those of the region-by-region layout (exact ties in heavy-hitter scores aside); only their slots
differ (attention does not depend on slot order). Outputs differ from that layout only where it rounded twice: a
token moving into a region of its own format used to be dequantized and quantized again (FP8: a second rounding of
up to one unit in the last place), now it keeps the codes it got on arrival.

`compress="prompt"` (as the other evicting caches, hf_kvcache.policies.prompt_mode): the regions are filled by
the policy through the prompt as in "always" mode (chunked prefill included); at the end of the prompt that
selection is kept as it is (nothing moves between regions any more: a token in an FP8 window stays there) and the
later tokens are appended to a growing tail region at the precision of the first window (the newest tokens', as
they would arrive in "always" mode), nothing evicted. Refused with a 'rest' region (it evicts nothing already).

Presets take a token `budget` instead of regions (what budget sweeps need):
- "sinks_heavy_recent": the classic combination, 4 sinks in full precision, then the rest split evenly between a
  recent window and H2O heavy hitters, both at `precision` (FP8 E4M3 by default); `scorer` ranks the heavy hitters
  by another scorer (SnapKV's 64-token observation window must fit in the recent window: budget >= 132).
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import PreTrainedModel

from ..common.architecture import is_latent_attention
from ..common.rope import KeyRotator, check_rotator_once
from ..common.validation import check_keys, require_choice, require_int
from ..layers.codes_read import ATTENTION_MODES, attention_option
from ..policies.composite import CompositePolicy
from ..policies.prompt_mode import COMPRESS_MODES
from ..scorers.h2o import AGGREGATIONS
from ..scorers.registry import CACHE_DRIVEN, HEAVY_SCORERS, make_scorer, options_of
from ..scorers.snapkv import WINDOW as SNAPKV_WINDOW
from ..stores import FullPrecisionStore
from ..stores.quantization import QuantSpec
from ..stores.regions import RegionStore
from ..stores.workspace import DequantWorkspace
from .base import KVCache

ROLES = ("sinks", "window", "heavy", "rest")
ROLE_KEYS = {
    "sinks": ("role", "tokens", "keys", "values"),
    "window": ("role", "start", "end", "keys", "values"),
    "heavy": ("role", "tokens", "keys", "values", "scorer"),  # and the scorer's parameters (`_scorer_keys`)
    "rest": ("role", "keys", "values"),
}
FULL = "full"


def make_store(keys: Any, values: Any, where: str, workspace=None):
    """The store for a region's key and value precisions (`workspace`: its dequantization scratch)."""
    if keys == FULL and values == FULL:
        return FullPrecisionStore()
    try:
        from ..stores.regions import store_for_precisions
    except ImportError:
        raise ValueError(f"{where}: precision keys={keys!r}, values={values!r} is not available; use 'full'.") from None
    return store_for_precisions(keys, values, where, workspace)


def parse_regions(regions: Any) -> dict:
    """Validate a region list; returns the normalised layout. Every problem names the region and the field."""
    if not isinstance(regions, (list, tuple)) or not regions:
        raise ValueError("`regions` must be a non-empty list of region dicts (see hf_kvcache.caches.composite).")
    sinks, windows, final = None, [], None
    for i, region in enumerate(regions):
        where = f"regions[{i}]"
        if not isinstance(region, dict):
            raise ValueError(f"{where} must be a dict, got {type(region).__name__}.")
        role = require_choice(f"{where}.role", region.get("role"), ROLES)
        scorer = None
        if role == "heavy":
            scorer = heavy_scorer_name(f"{where}.scorer", region.get("scorer", "h2o"))
        check_keys(
            f"{where} ({role})", region, ROLE_KEYS[role] + (_scorer_keys(where, scorer, region) if scorer else ())
        )
        entry = {"keys": region.get("keys", FULL), "values": region.get("values", FULL), "where": where}
        if role == "sinks":
            if sinks is not None:
                raise ValueError(f"{where}: only one 'sinks' region is allowed.")
            sinks = {**entry, "tokens": require_int(f"{where}.tokens", region.get("tokens"), 1)}
        elif role == "window":
            start = require_int(f"{where}.start", region.get("start"), 0)
            end = require_int(f"{where}.end", region.get("end"), 1)
            if end <= start:
                raise ValueError(f"{where}: `end` ({end}) must be larger than `start` ({start}).")
            windows.append({**entry, "start": start, "end": end})
        else:
            if final is not None:
                raise ValueError(f"{where}: only one of 'heavy' or 'rest' is allowed (already {final['role']}).")
            final = {**entry, "role": role}
            if role == "heavy":
                final["tokens"] = require_int(f"{where}.tokens", region.get("tokens"), 1)
                final["scorer"] = scorer
                final["options"] = {key: region[key] for key in options_of(scorer) if key in region}
                try:
                    final["observation_window"] = getattr(make_scorer(scorer, **final["options"]), "window", None)
                except ValueError as error:  # the scorer's own check, its field named by where it is in the config
                    message = str(error)
                    named = f"`{where}.{message[1:]}" if message.startswith("`") else f"{where}: {message}"
                    raise ValueError(named) from None
    if not windows:
        raise ValueError("`regions` needs at least one 'window' region (the most recent tokens, start 0).")
    windows.sort(key=lambda w: w["start"])
    expected = 0
    for w in windows:
        if w["start"] < expected:
            raise ValueError(
                f"{w['where']}: window [{w['start']}, {w['end']}) overlaps the previous window, which ends at "
                f"{expected}."
            )
        if w["start"] > expected:
            raise ValueError(
                f"{w['where']}: window starts at {w['start']} but the previous one ends at {expected}: a gap of "
                f"{w['start'] - expected} tokens."
            )
        expected = w["end"]
    if final is not None and (final.get("observation_window") or 0) > expected:
        raise ValueError(
            f"{final['where']}.window ({final['observation_window']}) must not exceed the window regions' span "
            f"({expected} tokens): the observation window's tokens are kept by the windows, not ranked."
        )
    return {"sinks": sinks, "windows": windows, "final": final}


def heavy_scorer_name(where: str, scorer: Any) -> str:
    """The heavy region's scorer name; KVzip and KVzap are refused with where their quantized placement is."""
    if scorer in CACHE_DRIVEN:
        raise ValueError(
            f"`{where}` {scorer!r} is driven by its own cache (reconstruction forwards or attention-input hooks), "
            f"which a composite region cannot run; for {scorer}-placed tokens in a quantized format use "
            f"cache_implementation={scorer!r} with `precision` (e.g. {{'keys': 'fp8_e4m3', 'values': 'int4'}})."
        )
    return require_choice(where, scorer, HEAVY_SCORERS)


def _scorer_keys(where: str, scorer: str, region: dict) -> tuple[str, ...]:
    """The keys a heavy region ranked by `scorer` may hold besides its own: the scorer's parameters. A parameter of
    another scorer is refused by name."""
    allowed = options_of(scorer)
    for key in region:
        if key in ROLE_KEYS["heavy"] or key in allowed:
            continue
        owners = [name for name in HEAVY_SCORERS if key in options_of(name)]
        if owners:
            raise ValueError(
                f"{where}.{key} is an option of scorer {' / '.join(map(repr, owners))} only (this region's scorer is "
                f"{scorer!r})."
            )
    return allowed


def precision_key(keys: Any, values: Any) -> tuple:
    """What decides a region's store: two regions with equal keys hold their tokens in the same format."""
    return tuple(FULL if p == FULL else QuantSpec.from_value(p) for p in (keys, values))


def merge_windows(windows: list[dict]) -> list[dict]:
    """Adjacent windows of the same precision as one window (one ring: no move between them)."""
    merged = []
    for w in windows:
        last = merged[-1] if merged else None
        if last is not None and precision_key(last["keys"], last["values"]) == precision_key(w["keys"], w["values"]):
            last["end"] = w["end"]
        else:
            merged.append(dict(w))
    return merged


PRESETS = ("sinks_heavy_recent",)
PRESET_SINKS = 4


def preset_regions(preset: str, budget: int, precision: Any, scorer: str = "h2o") -> list[dict]:
    preset = require_choice("preset", preset, PRESETS)
    budget = require_int("budget", budget, PRESET_SINKS + 2)
    make_store(precision, precision, "`precision`")  # the error names the argument, not the region it fills
    scorer = heavy_scorer_name("scorer", scorer)
    recent = (budget - PRESET_SINKS) // 2
    if scorer == "snapkv" and recent < SNAPKV_WINDOW:  # SnapKV's observation window lies in the recent window
        raise ValueError(
            f"`preset` {preset!r} with scorer 'snapkv' needs `budget` >= "
            f"{PRESET_SINKS + 2 * SNAPKV_WINDOW} (a recent window of at least SnapKV's "
            f"{SNAPKV_WINDOW}-token observation window), got {budget}."
        )
    heavy = {"role": "heavy", "tokens": budget - PRESET_SINKS - recent, "keys": precision, "values": precision}
    return [
        {"role": "sinks", "tokens": PRESET_SINKS},
        {"role": "window", "start": 0, "end": recent, "keys": precision, "values": precision},
        heavy if scorer == "h2o" else {**heavy, "scorer": scorer},
    ]


class CompositeCache(KVCache):
    """Sinks, age windows and a final region (evict / keep all / heavy hitters), each at its own precision.

    Equivalent presets: SinkCache = sinks + window + evict; SlidingWindowCache = window; H2OCache = window (recent)
    + heavy; keep-all with a full-precision recent window = window + rest."""

    cache_name = "composite"
    size_keys = ("regions", "preset", "budget")

    def __init__(
        self,
        config_or_model,
        regions: list | None = None,
        aggregation: str = "sum",
        sink_positions: str = "cache",
        preset: str | None = None,
        budget: int | None = None,
        precision: Any = "fp8_e4m3",
        compress: str = "always",
        scorer: str | None = None,
        attention: str = "auto",
        attention_block: int | None = None,
        layers: dict | list | None = None,
    ):
        if (regions is None) == (preset is None):
            raise ValueError(f"Give exactly one of `regions` or `preset` (one of {PRESETS}, with a `budget`).")
        if preset is not None:
            if budget is None:
                raise ValueError(f"`preset` {preset!r} needs a token `budget`.")
            regions = preset_regions(preset, budget, precision, "h2o" if scorer is None else scorer)
        elif budget is not None:
            raise ValueError("`budget` is for presets; with `regions`, sizes are given per region.")
        elif scorer is not None:
            raise ValueError(
                "`scorer` is for presets; with `regions`, give it in the heavy region "
                '({"role": "heavy", ..., "scorer": ...}).'
            )
        self.preset, self.budget, self.precision, self.scorer = preset, budget, precision, scorer
        layout = parse_regions(regions)
        aggregation = require_choice("aggregation", aggregation, AGGREGATIONS)
        sink_positions = require_choice("sink_positions", sink_positions, ("cache", "original"))
        self.regions = copy.deepcopy(list(regions))
        self.aggregation, self.sink_positions = aggregation, sink_positions
        self.compress = require_choice("compress", compress, COMPRESS_MODES)  # KVCache wraps the policies for "prompt"
        sinks, windows, final = layout["sinks"], merge_windows(layout["windows"]), layout["final"]
        if compress == "prompt" and final is not None and final["role"] == "rest":
            raise ValueError(
                f"compress='prompt': {final['where']} ('rest') keeps every token already, there is "
                "nothing to compress; use compress='always' or a 'heavy' region / no final region."
            )
        scorer = final.get("scorer", "h2o") if final else "h2o"
        sink_tokens = sinks["tokens"] if sinks else 0
        rotators = {}  # built after the base class checked the architecture
        final_kind = "evict" if final is None else {"rest": "keep", "heavy": "heavy"}[final["role"]]
        # heavy hitters at the last window's precision share its slots (one pool, no move from window to heavy)
        pooled = final_kind == "heavy" and precision_key(final["keys"], final["values"]) == precision_key(
            windows[-1]["keys"], windows[-1]["values"]
        )
        parts = ([sinks] if sinks else []) + windows + ([final] if final and not pooled else [])
        sizes = [sinks["tokens"]] if sinks else []
        sizes += [w["end"] - w["start"] for w in windows]
        if pooled:
            sizes[-1] += final["tokens"]
        elif final is not None:
            sizes.append(final["tokens"] if final["role"] == "heavy" else None)
        if compress == "prompt":  # the appended tokens' tail grows, at the newest window's precision
            parts.append({"keys": windows[0]["keys"], "values": windows[0]["values"], "where": windows[0]["where"]})
            sizes.append(None)
        for part in parts:  # validate precisions before any model runs
            make_store(part["keys"], part["values"], part["where"])
        self.workspace = DequantWorkspace()  # reads of every layer write into it, one layer at a time

        def layer_parts(cfg):
            if sinks is not None and sink_positions == "cache" and "rotator" not in rotators:
                rotators["rotator"] = KeyRotator(cfg, parameter="sink_positions")
            options = dict(final.get("options", {})) if final else {}
            if scorer == "h2o":
                options.setdefault("aggregation", aggregation)
            if "sinks" in options_of(scorer):  # the sinks region plays the scorer's sinks unless it says otherwise
                options.setdefault("sinks", sink_tokens)
            heavy_scorer = make_scorer(scorer, **options)
            if scorer == "expected_attention":  # un-rotates queries and rotates their statistics with the RoPE
                if "queries" not in rotators:
                    rotators["queries"] = KeyRotator(cfg, parameter="expected_attention")
                heavy_scorer.rotator = rotators["queries"]
            policy = CompositePolicy(
                sinks=sink_tokens,
                tier_sizes=[w["end"] - w["start"] for w in windows],
                final=final_kind,
                heavy=final.get("tokens", 0) if final else 0,
                rotator=rotators.get("rotator"),
                pooled=pooled,
                scorer=heavy_scorer if final_kind == "heavy" else None,
            )
            stores = [make_store(p["keys"], p["values"], p["where"], self.workspace) for p in parts]
            return policy, RegionStore(sizes, stores, self.workspace)

        super().__init__(config_or_model, layer_parts, layers)
        self.attention = require_choice("attention", attention, ATTENTION_MODES)
        mode, self.attention_block = attention_option(attention, attention_block, is_latent_attention(self.config))
        for layer in self.compressed_layers:  # (layers from per-layer settings have their own cache's options)
            if isinstance(layer.store, RegionStore) and layer.store.workspace is self.workspace:
                layer.attention, layer.attention_block = mode, self.attention_block
        KeyRotator.check_cache(self, config_or_model)  # built with a model: its own RoPE must agree
        if isinstance(config_or_model, PreTrainedModel) and "queries" in rotators:
            check_rotator_once(
                config_or_model, rotators["queries"], [layer.layer_idx for layer in self.compressed_layers]
            )

    def workspace_nbytes(self) -> int:
        """Bytes of the shared read workspace (one layer's keys and values in the model's dtype, grown by doubling,
        plus FP8 conversion scratch). Not part of `nbytes()`, which is what the cache stores."""
        return self.workspace.nbytes()

    def reset(self):
        super().reset()
        self.workspace.clear()
