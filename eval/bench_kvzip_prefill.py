"""KVzip's prefill cost (issue 26): prompt + context reconstruction against a plain prefill, in one interleaved run.

    python eval/bench_kvzip_prefill.py [--prompt 2048] [--rounds 3] [--threads 2] \
        [--out eval/results/kvzip/prefill_cost.json]
    python eval/bench_kvzip_prefill.py --device cuda --prompt 8192   # bfloat16 on a GPU

Per round, in rotated order, on the same `--prompt` tokens of the pydoc corpus (SmolLM2-135M by default):
- `dynamic`: one forward of the prompt into a DynamicCache (`logits_to_keep=1`), what `generate`'s prefill does;
- `h2o`: the same into H2OCache (attention scores from the bridge's one-pass scored attention), for scale;
- `kvzip`: the same into KVzipCache, then `compress_context` (the reconstruction forwards, chunk `--chunk`, and the
  placement at the budget), i.e. everything KVzip does before the first decode step; also the reconstruction alone;
- `kvzap`: the same into KVzapCache (the surrogate scores the prompt as it is prefilled), then its placement.
Reported: the median over rounds of each configuration's time over `dynamic`'s in the same round (paired ratios),
with the quartiles of the per-round ratios. KVzip's reconstruction processes the context again (plus the request),
attending to the stored context as well (kvpress's KVzipPress warns "2-3 times"; 4.0x measured here on CPU,
eval/results/kvzip/prefill_cost.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stream_ppl import environment  # noqa: E402

import hf_kvcache  # noqa: E402
from hf_kvcache import cache_kwargs  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def timed(model, ids, make_cache, device: str, compress: bool) -> tuple[float, float]:
    """(seconds of the prefill and, for KVzip, its compression; seconds of the compression alone)."""
    cache = make_cache()
    _sync(device)
    start = time.perf_counter()
    model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    _sync(device)
    middle = time.perf_counter()
    if compress:
        cache.compress_context(model)
        _sync(device)
    end = time.perf_counter()
    return end - start, end - middle


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kvzap-surrogate", default=None, help="KVzap's surrogate for --model (smollm2: shipped)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    from hf_kvcache.sharing.corpus import load_tokens
    from hf_kvcache.sharing.models import load_model

    model, tokenizer = load_model(args.model, dtype=dtype, device=args.device)
    ids = load_tokens(tokenizer, max_tokens=20000 + args.prompt)[:, 20000:].to(args.device)
    configs = {
        "dynamic": (lambda: DynamicCache(config=model.config), False),
        "h2o": (lambda: hf_kvcache.H2OCache(model, heavy=args.budget / 2, recent=args.budget / 2), False),
        "kvzip": (lambda: hf_kvcache.KVzipCache(model, budget=args.budget, chunk_size=args.chunk), True),
        # KVzap (issue 48): the prompt scored by the shipped surrogate as it is prefilled, then placed (no
        # reconstruction); only where a surrogate fits the model
        **(
            {"kvzap": (lambda: hf_kvcache.KVzapCache(model, budget=args.budget), True)}
            if args.model == "smollm2" or args.kvzap_surrogate
            else {}
        ),
    }
    if "kvzap" in configs and args.kvzap_surrogate:
        configs["kvzap"] = (
            lambda: hf_kvcache.KVzapCache(model, budget=args.budget, surrogate=args.kvzap_surrogate),
            True,
        )
    timed(model, ids, configs["kvzip"][0], args.device, True)  # warm-up (tokenizer load, allocator)
    times = {name: [] for name in configs}
    reconstruction = []
    names = list(configs)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            total, compress = timed(model, ids, configs[name][0], args.device, configs[name][1])
            times[name].append(total)
            if name == "kvzip":
                reconstruction.append(compress)
    base = times["dynamic"]

    def ratios(values):
        return [v / b for v, b in zip(values, base)]

    def quartiles(values):
        return [round(q, 3) for q in statistics.quantiles(values, n=4)] if len(values) > 1 else values

    report = {
        "what": "KVzip prefill + context reconstruction (and KVzap's prefill + placement) vs a plain prefill "
        "(DynamicCache), paired per round",
        "model": args.model,
        "device": args.device,
        "dtype": str(dtype).replace("torch.", ""),
        "threads": args.threads,
        "prompt_tokens": args.prompt,
        "budget": args.budget,
        "chunk_size": args.chunk,
        "rounds": args.rounds,
        "ratio_to_dynamic_prefill": {name: round(statistics.median(ratios(times[name])), 3) for name in names},
        "ratio_quartiles": {name: quartiles(ratios(times[name])) for name in names},
        "kvzip_compression_alone_vs_dynamic_prefill": round(statistics.median(ratios(reconstruction)), 3),
        "environment": environment(),
    }
    if args.device == "cuda":  # absolute times only from a GPU (this CPU machine is shared and noisy)
        report["seconds_median"] = {name: round(statistics.median(times[name]), 4) for name in names}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
