"""One decode step of the quantized caches with attention="blockwise" (straight from the codes) vs "dequantize"
(whole layer into the workspace, then SDPA), on SmolLM2-135M, CPU, interleaved.

    python eval/bench_blockwise_decode.py [--lengths 2048 4096] [--rounds 20] [--out eval/results/blockwise_decode.json]

For each cache and cached length, every mode prefills its own cache once; then the modes take one decode step each
in turn, `rounds` times (interleaved, so machine noise hits all alike). Reports the median ms per step, the ratio
to "dequantize", and the dequantization workspace each mode holds afterwards.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import hf_kvcache
from hf_kvcache import KIVICache, QuantizedFP8Cache
from hf_kvcache.models import load_model
from hf_kvcache.text import load_tokens

CACHES = {
    "fp8": lambda m, **a: QuantizedFP8Cache(m, **a),
    "kivi_int4": lambda m, **a: KIVICache(m, bits=4, group_size=32, residual=128, **a),
}
MODES = {
    "dequantize": {"attention": "dequantize"},
    "blockwise_b256": {"attention": "blockwise", "attention_block": 256},
    "blockwise_b1024": {"attention": "blockwise", "attention_block": 1024},
}


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
                for mode, kwargs in MODES.items():
                    cache = make(model, **kwargs)
                    t0 = time.perf_counter()
                    model(input_ids=ids[:, :length], past_key_values=cache, use_cache=True)
                    prefill_s[mode] = time.perf_counter() - t0
                    caches[mode] = cache
                times = {mode: [] for mode in MODES}
                for step in range(args.rounds):
                    token = ids[:, length + step : length + step + 1]
                    for mode, cache in caches.items():
                        t0 = time.perf_counter()
                        model(input_ids=token, past_key_values=cache, use_cache=True)
                        times[mode].append(time.perf_counter() - t0)
                base = statistics.median(times["dequantize"])
                for mode in MODES:
                    ms = statistics.median(times[mode])
                    row = {"cache": cache_name, "cached_tokens": length, "mode": mode, "decode_ms": round(ms * 1e3, 2),
                           "ratio_to_dequantize": round(ms / base, 3), "prefill_s": round(prefill_s[mode], 2),
                           "workspace_bytes": caches[mode].workspace_nbytes(), "cache_bytes": caches[mode].nbytes()}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "SmolLM2-135M-Instruct float32, CPU, 1 thread", "rounds": args.rounds,
                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
