"""Long-context decode against what it reads (issue 28): per cache and context length, decode ms/token as a ratio to
DynamicCache, and the attention kernel alone in bytes per second against a plain read of the same bytes.

    python eval/bench_decode_bandwidth.py                       # 1K-16K, SmolLM2 float32, 2 threads (~15 min)
    python eval/bench_decode_bandwidth.py --lengths 8192 --rounds 5 --out results/decode_bandwidth
    python eval/bench_decode_bandwidth.py --device cuda --model meta-llama/Llama-3.1-8B-Instruct \
        --lengths 4096 16384 65536 --out eval/results/decode_bandwidth_h200   # the GPU table (bfloat16, Triton)

Part 1, the model (`decode` rows): every cache is prefilled once per context length (chunked, from the offline
corpus), then rounds interleave the caches (order rotated per round), each timing `--steps` one-token forwards after
a warm-up step. A cache's ratio is paired: per round its median ms/token over DynamicCache's in the same round, then
the median over rounds (the steadiest figure on a shared machine). A "no cache (floor)" row times a one-token
forward with `use_cache=False` in the same rounds: what every cache's step pays besides its attention and bookkeeping.

Part 2, the kernel alone (`kernel` rows): the model's attention shape (SmolLM2: 3 KV heads, 3 queries each, head_dim
64) over `--layers` separate layers' codes (FP8 per token, and KIVI's INT4 layout; separate, so the bytes come from
memory, not from cache, as in a decode step), one call of the kernel's entry per layer on validated inputs (on CPU the
native kernel, `cpu_blockwise_attention`; on CUDA the Triton kernel, `triton_blockwise_attention`), and the same
through `blockwise_attention`, whose Python input checks a step also pays.
Bytes read: the keys' and values' codes, scales and zeros. The
bound: `tensor.sum()` over float32 buffers of the same total size, timed the same way (a plain read at the machine's
memory speed with the same threads, or the GPU's). Both as bytes/s and their ratio. On CPU in float32, also the
arithmetic floor (`multiply_add_floor_ms`): the kernel's unavoidable float32 multiply-adds (one per stored element
and query row) timed alone, in registers, with the same threads. And the kernel on bytes the CPU's caches already
hold (`kernel_on_cached_bytes_ms`: the same calls, every one on the first layer's codes): near `kernel_ms`, the
kernel's arithmetic, not memory, sets its speed.

On CUDA (`--device cuda`): the model in `--dtype` (bfloat16 by default there), each timing between
`torch.cuda.synchronize()` calls; absolute times are then the GPU's, and the results name it.

Writes OUT.json / OUT.csv and OUT.png (decode cost vs context length per cache).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stream_ppl import environment  # noqa: E402

from hf_kvcache import cache_kwargs  # noqa: E402
from hf_kvcache.common.architecture import attention_head_dim  # noqa: E402
from hf_kvcache.evaluation.cache_spec import make_cache  # noqa: E402
from hf_kvcache.kernels.blockwise import blockwise_attention  # noqa: E402
from hf_kvcache.kernels.cpu_blockwise import FLAGS, cpu_blockwise_attention, unavailable  # noqa: E402
from hf_kvcache.stores.code_views import from_codec  # noqa: E402
from hf_kvcache.stores.factory import make_codec  # noqa: E402
from hf_kvcache.stores.quantization import QuantSpec  # noqa: E402

#: label -> (cache name, config); "dynamic" is transformers' DynamicCache, the reference
CACHES = {
    "dynamic": ("dynamic", {}),
    "fp8": ("fp8", {}),
    "kivi int4": ("kivi", {}),
    "sink 4 + 1020": ("sink", {"sinks": 4, "window": 1020}),
}


@torch.inference_mode()
def _prefill(model, cache, ids, chunk: int) -> None:
    for start in range(0, ids.shape[1], chunk):
        model(input_ids=ids[:, start : start + chunk], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)


#: the floor row: a one-token forward with no cache at all (the weights' products and the layers' own work, which
#: every cache's step pays on top of its attention and bookkeeping)
NO_CACHE = "no cache (floor)"


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def _decode_ms(model, cache, token, steps: int) -> float:
    kwargs = {"use_cache": False} if cache is None else {**cache_kwargs(cache), "use_cache": True}
    model(input_ids=token, **kwargs)  # warm-up step
    times = []
    for _ in range(steps):
        _sync(token.device)
        t0 = time.perf_counter()
        model(input_ids=token, **kwargs)
        _sync(token.device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def decode_rows(model, ids, lengths, caches, rounds: int, steps: int, chunk: int) -> list[dict]:
    rows = []
    token = ids[:, -1:]
    for length in lengths:
        built = {label: make_cache(model, name, dict(config)) for label, (name, config) in caches.items()}
        for cache in built.values():
            _prefill(model, cache, ids[:, :length], chunk)
        built[NO_CACHE] = None
        per = {label: [] for label in built}
        labels = list(built)
        for r in range(rounds):
            for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                per[label].append(_decode_ms(model, built[label], token, steps))
        for label in labels:
            paired = [m / d for m, d in zip(per[label], per["dynamic"])]
            rows.append(
                {
                    "part": "decode",
                    "cache": label,
                    "context": length,
                    "decode_ms_per_token": statistics.median(per[label]),
                    "ratio_to_dynamic": statistics.median(paired),
                    "rounds": rounds,
                    "steps": steps,
                }
            )
            print(
                f"{length:6d} {label:14s} {rows[-1]['decode_ms_per_token']:8.2f} ms/token "
                f"{rows[-1]['ratio_to_dynamic']:.3f}x dynamic",
                flush=True,
            )
        del built
    return rows


#: the kernel-alone layouts: (keys spec, values spec, tokens per packed block or None), as the caches store them
LAYOUTS = {
    "fp8 per-token": ({"format": "fp8_e4m3"}, {"format": "fp8_e4m3"}, None),
    "kivi int4": (
        {"format": "int4", "granularity": "channel", "group_size": 32, "backend": "quanto"},
        {"format": "int4", "granularity": "token", "group_size": 32, "backend": "quanto"},
        32,
    ),
}


def _layer(layout: str, n: int, heads: int, dim: int, gen, device="cpu", dtype=torch.float32):
    """One layer's keys and values in `layout` (LAYOUTS) and the bytes a read of them takes (codes, scales, zeros)."""
    layer = []
    key_spec, value_spec, pack_block = LAYOUTS[layout]
    for spec in (key_spec, value_spec):
        codec = make_codec(QuantSpec.from_value(spec))
        if pack_block:
            codec.set_pack_block(pack_block)
        codec.allocate(1, heads, dim, n, dtype, device)
        codec.put(codec.encode(torch.randn(1, heads, n, dim, generator=gen).to(device, dtype)), 0)
        layer.append(from_codec(codec, n))
    read = sum(t.numel() * t.element_size() for s in layer for t in (s.codes, s.scale, s.zero) if t is not None)
    return layer[0], layer[1], read


def _kernel_entry(device) -> tuple[str, object]:
    """(backend name, the kernel's entry on validated inputs) for `device`: the native CPU kernel, or Triton on CUDA."""
    if torch.device(device).type == "cuda":
        from hf_kvcache.kernels.triton_blockwise import triton_blockwise_attention

        return "triton", triton_blockwise_attention
    reason = unavailable()  # builds the kernel (once)
    if reason:
        raise SystemExit(f"the native CPU kernel cannot run here: {reason}")
    return "native", cpu_blockwise_attention


#: The arithmetic floor (CPU): `n` multiply-adds of 16 float32 lanes in 12 independent chains per thread, split over
#: `threads` OpenMP threads, nothing read from memory; built with the native kernel's flags (`FLAGS`), so
#: they run at the vector width the kernel runs at (one AVX-512 register, or two AVX2 ones).
MULTIPLY_ADD_SOURCE = r"""
#include <chrono>
#include <cstdint>
typedef float v16 __attribute__((vector_size(64)));
extern "C" double multiply_adds(int64_t n, int64_t threads) {
  const auto t0 = std::chrono::steady_clock::now();
  float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    v16 a[12], x, y;
    for (int i = 0; i < 12; ++i) a[i] = (v16){} + 0.001f * i;
    x = (v16){} + 0.999f;
    y = (v16){} + 1e-4f;
    const int64_t rounds = n / threads / 12;
    for (int64_t k = 0; k < rounds; ++k)
      for (int i = 0; i < 12; ++i) a[i] = a[i] * x + y;
    for (int i = 1; i < 12; ++i) a[0] += a[i];
    for (int i = 0; i < 16; ++i) sink += a[0][i];
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sink == 12345.0f ? -seconds : seconds;  // (keeps the chains' results live)
}
"""


def _multiply_adds():
    """MULTIPLY_ADD_SOURCE built once (a plain shared library: no torch headers, a second to build) and loaded."""
    import ctypes
    import hashlib
    import os
    import subprocess
    import tempfile

    digest = hashlib.sha256(MULTIPLY_ADD_SOURCE.encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"hf_kvcache_multiply_adds_{digest}"
    library = folder / "multiply_adds.so"
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "multiply_adds.cpp").write_text(MULTIPLY_ADD_SOURCE)
        built = folder / f"multiply_adds.{os.getpid()}.so"
        subprocess.run(
            [
                os.environ.get("CXX", "c++"),
                *FLAGS,
                "-shared",
                "-fPIC",
                str(folder / "multiply_adds.cpp"),
                "-o",
                str(built),
            ],
            check=True,
            capture_output=True,
        )
        built.replace(library)
    function = ctypes.CDLL(str(library)).multiply_adds
    function.argtypes, function.restype = [ctypes.c_int64, ctypes.c_int64], ctypes.c_double
    return function


def multiply_add_floor_ms(n_elements: int, query_rows: int, repeats: int) -> float | None:
    """The float32 arithmetic a float32 decode kernel cannot do without: one multiply-add per stored element and
    query row (keys: the dot products; values: the weighted sums), timed alone in 16-lane vectors with torch's
    threads. The native kernel does these and, on top, its codes' decoding; on this CPU the two together, not the
    bytes, set its speed. None where the library cannot be built."""
    import subprocess

    try:
        multiply_adds = _multiply_adds()
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"(no arithmetic floor: {err})")
        return None
    n, threads = n_elements * query_rows // 16, torch.get_num_threads()
    multiply_adds(n, threads)  # warm-up
    return 1000 * statistics.median(abs(multiply_adds(n, threads)) for _ in range(repeats))


def kernel_rows(
    lengths,
    layers: int,
    repeats: int,
    heads: int = 3,
    groups: int = 3,
    dim: int = 64,
    device="cpu",
    dtype=torch.float32,
) -> list[dict]:
    backend, entry = _kernel_entry(device)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for layout in LAYOUTS:
        for n in lengths:
            made = [_layer(layout, n, heads, dim, gen, device, dtype) for _ in range(layers)]
            query = torch.randn(1, heads * groups, 1, dim, generator=gen).to(device, dtype)
            read = sum(m[2] for m in made)
            plain = [torch.ones(max(1, m[2] // 4), device=device) for m in made]  # float32 buffers of the same bytes

            def kernel():  # the kernel's entry on validated inputs (what a step pays once its inputs are checked)
                for ks, vs, _ in made:
                    entry(query, [ks], [vs], n, None, dim**-0.5, 0, None, None, False)

            def checked():  # the same through blockwise_attention (its input checks and backend choice per call)
                for ks, vs, _ in made:
                    blockwise_attention(query, ks, vs, None, dim**-0.5, backend=backend)

            def memory():
                for buffer in plain:
                    buffer.sum()

            def cached():  # the same calls on the first layer's bytes only: after the first, from the CPU's caches
                ks, vs, _ = made[0]
                for _ in made:
                    entry(query, [ks], [vs], n, None, dim**-0.5, 0, None, None, False)

            kernel(), checked(), memory(), cached()  # warm-up (and the kernel's build)
            k_times, c_times, m_times, h_times = [], [], [], []
            for _ in range(repeats):
                for fn, out in ((kernel, k_times), (checked, c_times), (memory, m_times), (cached, h_times)):
                    _sync(device)
                    t0 = time.perf_counter()
                    fn()
                    _sync(device)
                    out.append(time.perf_counter() - t0)
            k_s, c_s, m_s, h_s = (statistics.median(t) for t in (k_times, c_times, m_times, h_times))
            floor = None  # (a GPU's arithmetic is not what bounds its kernel)
            if torch.device(device).type == "cpu" and dtype == torch.float32:
                floor = multiply_add_floor_ms(2 * layers * heads * n * dim, groups, repeats)
            rows.append(
                {
                    "part": "kernel",
                    "cache": f"{layout} ({backend} kernel)",
                    "context": n,
                    "layers": layers,
                    "bytes_read": read,
                    "kernel_gb_per_s": read / k_s / 1e9,
                    "read_bound_gb_per_s": read / m_s / 1e9,
                    "share_of_bound": m_s / k_s,
                    "read_bound_ms": m_s * 1000,
                    "multiply_add_floor_ms": floor,
                    "kernel_on_cached_bytes_ms": h_s * 1000,
                    "kernel_ms": k_s * 1000,
                    "through_blockwise_attention_ms": c_s * 1000,
                    "share_of_bound_through_blockwise_attention": m_s / c_s,
                    "repeats": repeats,
                }
            )
            print(
                f"{n:6d} {layout:14s} kernel {k_s * 1000:.1f} ms, {rows[-1]['kernel_gb_per_s']:.2f} GB/s; plain "
                f"read {rows[-1]['read_bound_gb_per_s']:.2f} GB/s ({m_s * 1000:.2f} ms): "
                f"{rows[-1]['share_of_bound']:.2f} of the bound ({m_s / c_s:.2f} through blockwise_attention's "
                f"checks); on one layer's cached bytes {h_s * 1000:.1f} ms"
                + ("" if floor is None else f"; its float32 multiply-adds alone {floor:.2f} ms"),
                flush=True,
            )
    return rows


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def attention_shape(config) -> dict:
    """The kernel-alone part's shape from a model config: KV heads, query heads per KV head, head dim."""
    config = getattr(config, "get_text_config", lambda: config)()
    heads = config.num_key_value_heads or config.num_attention_heads
    return {"heads": heads, "groups": config.num_attention_heads // heads, "dim": attention_head_dim(config)}


def plot(rows: list[dict], path: Path, title: str = "SmolLM2-135M decode cost vs context") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    decode = [r for r in rows if r["part"] == "decode"]
    for label in dict.fromkeys(r["cache"] for r in decode):
        mine = sorted((r["context"], r["decode_ms_per_token"]) for r in decode if r["cache"] == label)
        ax.plot([m[0] for m in mine], [m[1] for m in mine], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode ms/token (median)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers of the kernel-alone part (default: the model's; 30 with --skip-model)",
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu (the native kernel) or cuda (Triton)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPES),
        help="model and query dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    parser.add_argument("--skip-model", action="store_true", help="only the kernel-alone part (SmolLM2's shape)")
    parser.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "decode_bandwidth")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype or ("bfloat16" if torch.device(args.device).type == "cuda" else "float32")]
    shape, model = {}, None
    if not args.skip_model:
        from hf_kvcache.sharing.corpus import load_text
        from hf_kvcache.sharing.models import load_model

        model, tokenizer = load_model(args.model, dtype=dtype, device=args.device)
        shape = attention_shape(model.config)
    layers = args.layers or (model.config.num_hidden_layers if model is not None else 30)
    rows = kernel_rows(args.lengths, layers, args.repeats, device=args.device, dtype=dtype, **shape)
    if model is not None:
        ids = tokenizer(load_text("pydoc"), return_tensors="pt").input_ids[:, : max(args.lengths) + 1]
        caches = {label: CACHES[label] for label in ["dynamic"] + [c for c in args.caches if c != "dynamic"]}
        rows += decode_rows(model, ids.to(args.device), args.lengths, caches, args.rounds, args.steps, args.chunk)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    info = {
        "threads": args.threads,
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "model": args.model,
    }
    args.out.with_suffix(".json").write_text(
        json.dumps({**info, "rows": rows, "environment": environment()}, indent=1) + "\n"
    )
    with args.out.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    if not args.skip_model:
        name = "SmolLM2-135M" if args.model == "smollm2" else args.model
        plot(rows, args.out.with_suffix(".png"), f"{name} ({info['dtype']}, {args.device}) decode cost vs context")


if __name__ == "__main__":
    main()
