"""One decode step of the quantized caches attending from the codes -- "auto" (the native CPU kernel) and
"blockwise" without it (the torch block walk) -- vs "dequantize" (whole layer into the workspace, then SDPA), on
SmolLM2-135M, CPU, 1 thread, interleaved.

    python eval/bench_blockwise_decode.py [--lengths 2048 4096] [--rounds 20] [--out eval/results/blockwise_decode.json]

For each cache and cached length, every mode prefills its own cache once; then the modes take one decode step each
in turn (order rotated), `rounds` times (interleaved, so machine noise hits all alike). Reports the median ms per
step, the ratio to "dequantize", and the dequantization workspace each mode holds afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import hf_kvcache
from hf_kvcache import KIVICache, QuantizedFP8Cache, cache_kwargs
from hf_kvcache.sharing.corpus import load_tokens
from hf_kvcache.sharing.models import load_model

CACHES = {
    "fp8": lambda m, **a: QuantizedFP8Cache(m, **a),
    "kivi_int4": lambda m, **a: KIVICache(m, bits=4, group_size=32, residual=128, **a),
}
# mode -> (cache options, native CPU kernel allowed): "auto" on CPU decodes from the codes with the native kernel
# (hf_kvcache.kernels.cpu_blockwise); the torch block walk is what "blockwise" runs without it
MODES = {
    "dequantize": ({"attention": "dequantize"}, True),
    "auto_native": ({"attention": "auto"}, True),
    "blockwise_torch_b1024": ({"attention": "blockwise", "attention_block": 1024}, False),
}


def forward(model, ids, cache, native: bool) -> float:
    """Seconds of one forward, with the native kernel allowed or not (HF_KVCACHE_NATIVE, read at every call)."""
    os.environ["HF_KVCACHE_NATIVE"] = "1" if native else "0"
    t0 = time.perf_counter()
    model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default="eval/results/blockwise_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    hf_kvcache.enable(model)
    ids = load_tokens(tokenizer, max_tokens=max(args.lengths) + args.rounds + 1)
    rows = []
    with torch.no_grad():
        for length in args.lengths:
            for cache_name, make in CACHES.items():
                caches, prefill_s = {}, {}
                for mode, (kwargs, native) in MODES.items():
                    caches[mode] = make(model, **kwargs)
                    prefill_s[mode] = forward(model, ids[:, :length], caches[mode], native)
                times = {mode: [] for mode in MODES}
                for step in range(args.rounds):
                    token = ids[:, length + step : length + step + 1]
                    order = list(MODES)[step % len(MODES) :] + list(MODES)[: step % len(MODES)]  # rotated per round
                    for mode in order:
                        times[mode].append(forward(model, token, caches[mode], MODES[mode][1]))
                base = statistics.median(times["dequantize"])
                for mode in MODES:
                    ms = statistics.median(times[mode])
                    row = {
                        "cache": cache_name,
                        "cached_tokens": length,
                        "mode": mode,
                        "decode_ms": round(ms * 1e3, 2),
                        "ratio_to_dequantize": round(ms / base, 3),
                        "prefill_s": round(prefill_s[mode], 2),
                        "workspace_bytes": caches[mode].workspace_nbytes(),
                        "cache_bytes": caches[mode].nbytes(),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"model": "SmolLM2-135M-Instruct float32, CPU, 1 thread", "rounds": args.rounds, "rows": rows}, indent=1
        )
    )


if __name__ == "__main__":
    main()
