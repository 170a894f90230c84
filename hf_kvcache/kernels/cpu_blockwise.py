"""The native CPU backend of `blockwise_attention`: a C++ kernel (`cpu_decode.cpp`) built on first use.

On CPU, eager torch ops cannot fuse "decode the codes, scale them, attend": every step the torch path writes a float32
copy of each block and walks it again (docs/blockwise_attention.md). The kernel decodes one token's codes into a row
that stays in L1, takes its dot products with the query rows of its KV head, and after an exact softmax adds the
decoded value rows; one task per (batch row, KV head) on torch's intra-op threads, its columns split into ranges
merged afterwards when there are few such tasks and many columns (batch-1 decode, flash-decoding). Same contract as
the torch path (every `QuantizedKV` layout, masks, causal tail, softcap, sinks, weighted column scores), same float32
arithmetic up to summation order.

The same extension holds the FP8 write of a decode step's new tokens (`cpu_encode.cpp`, hf_kvcache.kernels.cpu_encode).

Building: `torch.utils.cpp_extension.load` with the machine's C++ compiler and ninja, `-O3 -march=TARGET -fopenmp`,
once per version of the sources, torch, Python and instruction set (`module_name`) into torch's extension cache
(`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions); about a minute on 2 cores, then milliseconds. TARGET is
the instruction set the build may use (`isa_target`): on x86-64 the highest psABI level this CPU has (x86-64-v4 for
AVX-512, v3 for AVX2 + FMA + F16C: the kernel's code paths), elsewhere `native` keyed by the CPU's feature list. It is
part of the build's name, so a home directory shared by nodes of different CPUs (`~/.cache` on NFS) holds one build per
instruction set, and an AVX2 node never loads a build with AVX-512 instructions (that is an illegal instruction, a
crash, not an exception). Processes building the same folder at once take turns (`builder_lock`) and the later ones
load the first's build, however long it takes. No compiler, or `HF_KVCACHE_NATIVE=0`: `unavailable()` says why and
"auto" keeps the torch path. Eager only: under `torch.compile` the torch path is traced (inductor writes its own
kernels).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path

import torch

from .codes import QuantizedKV

logger = logging.getLogger(__name__)

#: attention (cpu_decode.cpp, which holds the bindings), the FP8 write of new tokens (cpu_encode.cpp) and the sinks'
#: re-rotation (cpu_rope.cpp), one extension
SOURCES = [Path(__file__).with_name(name) for name in ("cpu_decode.cpp", "cpu_encode.cpp", "cpu_rope.cpp")]
#: x86-64's micro-architecture levels (the psABI's), lowest first, with the CPU flags (as Linux's /proc/cpuinfo names
#: them) each adds to the one below; the kernel's code paths are AVX-512F (v4), AVX2 + FMA + F16C (v3) and scalar
X86_LEVELS = (
    ("x86-64-v2", frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})),
    ("x86-64-v3", frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})),
    ("x86-64-v4", frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})),
)


def cpu_features() -> str:
    """This CPU's feature list as the OS reports it (Linux: the first `flags` line of /proc/cpuinfo on x86, `Features`
    on Arm); "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return value.strip()
    except OSError:
        pass
    return ""


def isa_target(machine: str | None = None, features: str | None = None) -> str:
    """The instruction set a build here targets (the `-march` value): on x86-64 the highest level whose flags the CPU
    has (any CPU of that level runs the build), else `native:<machine>:<digest of the feature list>` (built with
    -march=native: only CPUs of the same features share it). `machine` / `features` default to this one's (tests fake
    other CPUs)."""
    machine = (machine if machine is not None else platform.machine()).lower()
    features = features if features is not None else cpu_features()
    if machine in ("x86_64", "amd64") and features:
        have, target = set(features.split()), "x86-64"
        for level, flags in X86_LEVELS:
            if not flags <= have:
                break
            target = level
        return target
    return f"native:{machine}:{hashlib.sha1(' '.join(sorted(features.split())).encode()).hexdigest()[:10]}"


def compile_flags(target: str | None = None) -> list[str]:
    """The compiler flags of a build for `target` (`isa_target()` by default). -fopenmp: torch's at::parallel_for is
    inline OpenMP in its headers (AT_PARALLEL_OPENMP); compiled without it, the pragma is dropped and every task runs
    on the calling thread. -mtune=native only schedules (any CPU of the target runs the code)."""
    target = target if target is not None else isa_target()
    march = "native" if target.startswith("native:") else target
    return ["-O3", f"-march={march}", "-mtune=native", "-fno-math-errno", "-fopenmp"]


FLAGS = compile_flags()
_FORMAT_IDS = {"none": 0, "fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3, "int4": 3, "int2": 3}
_PACK_IDS = {"channel": 1, "token": 2}
_META = 9  # ints per segment in the kernel's metadata, its token count first (cpu_decode.cpp)
#: full-precision ("none") codes the kernel reads in their own dtype (widened to float32 in registers, exactly)
_FULL_PRECISION_IDS = {torch.float32: 0, torch.bfloat16: 4, torch.float16: 5}

_lock = threading.Lock()
_module = None
_failure: str | None = None


def build_key(flags: list[str]) -> str:
    """What a build depends on besides its sources: the flags (the instruction set among them), torch's version (its
    headers and ABI: a module built against one torch must not load in another, as it would after an in-place upgrade
    that keeps every path) and the Python version. Two environments on one machine share torch's extension folder,
    each with its own builds; so do nodes of different CPUs sharing one home directory. `-march=native` means this CPU:
    its key names the CPU's features (`isa_target`)."""
    isa = [f"isa={isa_target()}"] if "-march=native" in flags else []
    return " ".join([*flags, *isa, f"torch={torch.__version__}", f"python={sys.version_info[0]}.{sys.version_info[1]}"])


def module_name(flags: list[str] = FLAGS) -> str:
    """The extension's name (and its folder's): a digest of the sources and `build_key`."""
    digest = hashlib.sha1(b"".join(s.read_bytes() for s in SOURCES) + build_key(flags).encode()).hexdigest()[:10]
    return f"hf_kvcache_cpu_decode_{digest}"


#: a build lock older than this is left by a process killed while it held it (a build takes about a minute)
STALE_LOCK_S = 600


def _load_built(name: str, directory: Path):
    """The module from the build already in `directory`, loaded directly, or None when there is none (or it is
    incomplete). The folder's name is a digest of the sources, flags, torch and Python (`module_name`), so a build
    there is of exactly these; loading it does not go through torch's build lock, which a process killed while
    holding it (an interrupted first load, a killed test run) leaves behind for every later load to wait on."""
    import importlib.util

    path = directory / f"{name}.so"
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError):  # (being written by a concurrent build: build or wait through torch)
        return None
    return module


def clear_stale_lock(directory: Path, now: float | None = None) -> bool:
    """Remove `directory`'s build lock if it is older than `STALE_LOCK_S` (its process is gone: torch would wait on it
    forever, silently); True if removed."""
    import time

    lock = directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    logger.warning("hf_kvcache: removing a stale build lock (%.0f s old) left by a killed process: %s", age, lock)
    lock.unlink(missing_ok=True)
    return True


def build_root() -> Path:
    """Where builds go: `TORCH_EXTENSIONS_DIR` when set (as torch's own loader honours it), else torch's default
    extension folder (~/.cache/torch_extensions)."""
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())


@contextlib.contextmanager
def builder_lock(directory: Path):
    """Held while this process builds into `directory`: an OS file lock (`flock`), which the kernel releases when its
    process ends, however it ends. Builders of one folder wait for each other as long as a build takes (a busy machine
    once took a build past any age limit, and a second builder then removed the first one's lock and both wrote the
    same files); where `fcntl` is missing (Windows), torch's own lock with the age rule (`clear_stale_lock`)."""
    try:
        import fcntl
    except ImportError:
        clear_stale_lock(directory)
        yield False
        return
    with open(directory.parent / f"{directory.name}.builder.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(flags: list[str] = FLAGS):
    """The compiled module: loaded from torch's extension cache, or built into it (named by a digest of the source,
    the flags and the torch and Python it is built for (`build_key`), so an edited source or an upgraded torch never
    loads a stale build). Tests build other targets with `flags` (e.g. -march=x86-64-v3: the AVX2 code of a CPU
    without AVX-512). Concurrent builders of one folder take turns (`builder_lock`): the second loads the first's
    build."""
    from torch.utils import cpp_extension

    name = module_name(flags)
    directory = build_root() / name
    built = _load_built(name, directory)
    if built is not None:
        return built
    directory.mkdir(parents=True, exist_ok=True)
    with builder_lock(directory) as exclusive:
        built = _load_built(name, directory)  # (built by the builder this one waited for)
        if built is not None:
            return built
        if exclusive:  # no live builder of this version holds torch's lock now: one left there is a killed process's
            (directory / "lock").unlink(missing_ok=True)
        if not any(directory.glob(f"{name}*.so")):
            logger.warning(
                "hf_kvcache: building the native CPU attention kernel into %s (once, about a minute)", directory
            )
        return cpp_extension.load(
            name=name,
            sources=[str(s) for s in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )


def unavailable() -> str | None:
    """Why the native kernel cannot run here (None: it is built and loaded). Builds it on the first call."""
    global _module, _failure
    if os.environ.get("HF_KVCACHE_NATIVE", "1") == "0":
        return "HF_KVCACHE_NATIVE=0 switches the native CPU kernel off"
    if _module is not None:
        return None
    with _lock:
        if _module is None and _failure is None:
            try:
                _module = _build()
            except Exception as error:  # no compiler, no ninja, headers missing: the torch path remains
                _failure = f"building the native CPU kernel failed ({type(error).__name__}: {error})"
                logger.warning("hf_kvcache: %s; attention stays on the torch path", _failure)
    return _failure


def unusable(*tensors: torch.Tensor) -> str | None:
    """Why a native call cannot take `tensors` here (None: it can): compiled code traces the torch path instead, the
    native code runs on CPU tensors, and the extension must build (`unavailable`, built on the first call). The one
    check of the attention kernel, the FP8 write (cpu_encode) and the sinks' re-rotation (cpu_rope)."""
    if torch.compiler.is_compiling():
        return "the code is being compiled (torch.compile traces the torch path)"
    if not all(t.is_cpu for t in tensors):
        return "the native kernel runs on CPU tensors"
    return unavailable()


def unsupported(query, ks, vs) -> str | None:
    """Why the native kernel cannot run these inputs here (None: it can); builds it on the first call."""
    return unusable(
        query, *(t for s in list(ks) + list(vs) for t in (s.codes, s.scale, s.zero, s.bias) if t is not None)
    )


def _flatten(segments: list[QuantizedKV]) -> tuple[list, list[int]]:
    """The kernel's view of segments: four tensors (codes, scale, zero, bias; codes contiguous along channels, FP8 /
    integer codes as bytes; scales and zero points in float32, bfloat16 or float16, bias float32) and nine ints each
    (see cpu_decode.cpp)."""
    tensors, meta = [], []
    for s in segments:
        codes, fmt = s.codes, _FORMAT_IDS[s.format]
        if s.format == "none":  # float32, bfloat16 and float16 values are read as they are; others as float32
            fmt = _FULL_PRECISION_IDS.get(codes.dtype)
            if fmt is None:
                codes, fmt = codes.float(), 0
        if codes.stride(-1) != 1:
            codes = codes.contiguous()
        scale, zero = s.scale, s.zero  # float32, bfloat16 and float16 are read as they are (cpu_decode.cpp)
        if scale is not None and (s.scale_pow2 or scale.dtype not in _FULL_PRECISION_IDS):
            scale = torch.exp2(scale.float()) if s.scale_pow2 else scale.float()
        if zero is not None and zero.dtype not in _FULL_PRECISION_IDS:
            zero = zero.float()
        bias = None if s.bias is None else s.bias.float()
        if s.granularity == "token":
            s_tok, s_ch = 1, s.group_size or s.head_dim
        elif s.granularity == "channel":
            s_tok, s_ch = s.group_size, 1
        else:
            s_tok, s_ch = 1, s.head_dim
        packed = s.per_byte > 1
        tensors += [codes, scale, zero, bias]
        meta += [
            s.length,
            fmt,
            s.per_byte,
            int(s.pack_order == "hqq"),
            _PACK_IDS[s.packing] if packed else 0,
            (s.pack_block or 1) if packed else 1,
            s_tok,
            s_ch,
            int(s.zero_is_code),
        ]
    return tensors, meta


def flatten_views(segments: list[QuantizedKV]) -> tuple[list, list[int]] | None:
    """`_flatten`, or None where it would convert or copy a tensor (the kernel's view must stay a view of the
    segments' buffers to be kept across writes: `with_lengths`)."""
    tensors, meta = _flatten(segments)
    originals = [t for s in segments for t in (s.codes, s.scale, s.zero, s.bias)]
    return (tensors, meta) if all(a is b for a, b in zip(tensors, originals)) else None


def with_lengths(meta: list[int], lengths: list[int]) -> list[int]:
    """`meta` of flattened segments with each segment's token count replaced by `lengths` (the kernel reads tokens
    [0, length) of each; cpu_decode.cpp checks that they fit its buffers)."""
    meta = list(meta)
    meta[::_META] = lengths
    return meta


def cpu_blockwise_attention(
    query,
    ks,
    vs,
    n,
    valid,
    scaling,
    causal_tail,
    softcap,
    sinks,
    column_scores,
    query_weight=None,
    split_columns: int = 0,
    query_rotation=None,
):
    """`blockwise_attention` on validated CPU inputs through the native kernel (call `unavailable()` first).
    `split_columns`: columns per range of the flash-decoding split (0: chosen from the shapes, see cpu_decode.cpp;
    tests force small ranges). `query_rotation`: see `attend_flat`."""
    return attend_flat(
        query,
        _flatten(ks),
        _flatten(vs),
        vs[0].head_dim,
        ks[0].heads,
        valid,
        scaling,
        causal_tail,
        softcap,
        sinks,
        column_scores,
        query_weight,
        split_columns,
        query_rotation,
    )


def attend_flat(
    query,
    keys,
    values,
    value_dim,
    heads,
    valid,
    scaling,
    causal_tail=0,
    softcap=None,
    sinks=None,
    column_scores=False,
    query_weight=None,
    split_columns: int = 0,
    query_rotation=None,
):
    """`cpu_blockwise_attention` over flattened segments (`keys`, `values`: `_flatten`'s (tensors, meta) pairs, or
    `flatten_views` with `with_lengths`); `value_dim` and `heads`: the values' head dim and the KV heads.
    `query_rotation` [Dk, Dk]: attend with `query @ query_rotation` (a cache that stores its keys rotated), rotated
    inside the call: in a decode step a separate matmul costs ~15 us a layer, cold."""
    out, scores = _module.decode_attention(
        query.float().contiguous(),
        keys[0],
        keys[1],
        values[0],
        values[1],
        value_dim,
        None if valid is None else valid.contiguous(),
        float(scaling),
        int(causal_tail),
        float(softcap or 0.0),
        None if sinks is None else sinks.float().contiguous(),
        bool(column_scores),
        None if query_weight is None else query_weight.float().contiguous(),
        heads,
        int(split_columns),
        None if query_rotation is None else query_rotation.float().contiguous(),
    )
    out = out.to(query.dtype)
    return (out, scores) if column_scores else out


def paged_attention(
    query,
    pages,
    fresh,
    value_dim,
    heads,
    cu_seq_lens_q,
    cu_seq_lens_k,
    read_index,
    scaling,
    softcap=None,
    sinks=None,
    split_columns: int = 0,
    query_rotation=None,
):
    """Continuous batching's packed batch attended request by request straight from paged codes (cpu_decode.cpp's
    `paged_attention`; call `unavailable()` first).

    query [Hq, N, Dk] (the batch's queries, packed); `pages`: (keys, values) flattened segments (`flatten_views` of
    the pages' codec views, one segment each, reading all their rows); `fresh`: (keys, values) flattened segments of
    the batch's new tokens [1, Hkv, N, D] in full precision (what a request in its first forward attends to);
    `cu_seq_lens_q` / `cu_seq_lens_k` [R + 1]: each request's queries and keys (the read rows
    `read_index[cu_k[r]:cu_k[r+1]]`, its new tokens last). Returns [Hq, N, Dv] float32 (zero for padding queries)."""
    keys = (pages[0][0] + fresh[0][0], pages[0][1] + fresh[0][1])
    values = (pages[1][0] + fresh[1][0], pages[1][1] + fresh[1][1])
    return _module.paged_attention(
        query.float().contiguous(),
        keys[0],
        keys[1],
        values[0],
        values[1],
        value_dim,
        cu_seq_lens_q.long().contiguous(),
        cu_seq_lens_k.long().contiguous(),
        read_index.long().contiguous(),
        float(scaling),
        float(softcap or 0.0),
        None if sinks is None else sinks.float().contiguous(),
        heads,
        int(split_columns),
        None if query_rotation is None else query_rotation.float().contiguous(),
    )


__all__ = [
    "attend_flat",
    "cpu_blockwise_attention",
    "flatten_views",
    "module_name",
    "paged_attention",
    "unavailable",
    "unsupported",
    "unusable",
    "with_lengths",
]
