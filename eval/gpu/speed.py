"""Stage 2 of the GPU acceptance run (eval/gpu/accept.sh): speed, as cells in priority order until a deadline.

    python eval/gpu/speed.py --device cuda --out DIR --minutes 4          # the lent GPU's plan (PLANS["cuda"])
    python eval/gpu/speed.py --device cpu --out DIR --minutes 1           # the CPU plan: tiny sizes (the test)

Each model cell is one `eval/bench_gpu.py` process (eager; every cache against DynamicCache in interleaved rounds,
ratios and absolute ms side by side; prefill seconds; `torch.cuda.max_memory_allocated` per cache) on random weights
in a published shape (eval/gpu/random_models.py), written as DIR/speed/CELL.{json,csv} when it finishes. The kernel
cell is the code-reading kernel alone (Triton on CUDA, native on CPU) in bytes/s against a plain read of the same
bytes (eval/bench_decode_bandwidth.kernel_rows, the attention shape of the first model), DIR/speed/kernel.json.
Cells run in the order of the plan: the short contexts at batch 1 and 8 first, 64K last, the kernel cell after
the first model cell. A cell is started only if the deadline leaves it its minimum, and is stopped at the deadline;
DIR/speed/cells.json says of every cell whether it finished, timed out or failed (and why), rewritten after each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
EVAL = HERE.parent

#: the caches timed against DynamicCache (bench_gpu's --cache syntax); budgets are fractions of the prompt
CACHES = [
    "fp8",
    "kivi:bits=4,group_size=32,residual=32",
    "sink:sinks=4,budget=0.25",
    "h2o:budget=0.25",
    # (random weights have no tokenizer: KVzip's reconstruction request is given as token ids)
    'kvzip:{"budget": 0.25, "head_budget": "adaptive", "layer_budget": "adaptive", '
    '"request_ids": {"first": [5, 6], "next": [7, 8], "suffix": [9, 10]}}',
    "composite:preset=sinks_heavy_recent,budget=0.25",
]

#: device -> (model cells in priority order: (config, layers, context, batch), decode steps, rounds, kernel lengths)
PLANS = {
    "cuda": {
        "cells": [
            ("llama-3.1-8b", 4, 8192, 1),
            ("llama-3.1-8b", 4, 8192, 8),
            ("qwen3-8b", 4, 8192, 1),
            ("llama-3.1-8b", 4, 32768, 1),
            ("llama-3.1-8b", 4, 65536, 1),
            ("llama-3.1-8b", 4, 32768, 8),
            ("qwen3-8b", 4, 32768, 1),
            ("llama-3.1-8b", 4, 65536, 8),
        ],
        "steps": 32,
        "rounds": 3,
        "kernel_lengths": [8192, 32768, 65536],
        "kernel_layers": 8,
        "repeats": 10,
        "min_cell_s": 45,
    },
    "cpu": {
        "cells": [("smollm2-135m", 2, 64, 2)],
        "steps": 4,
        "rounds": 2,
        "kernel_lengths": [128],
        "kernel_layers": 1,
        "min_cell_s": 5,
        "repeats": 2,
    },
}


def cell_name(config: str, layers: int, context: int, batch: int) -> str:
    size = f"{context // 1024}k" if context >= 1024 else str(context)
    return f"{config}_L{layers}_{size}_b{batch}"


def model_cell(cell, plan, device: str, out: Path, timeout: float) -> dict:
    """One bench_gpu.py process for a (config, layers, context, batch) cell; its outcome."""
    config, layers, context, batch = cell
    name = cell_name(*cell)
    argv = [
        sys.executable,
        str(EVAL / "bench_gpu.py"),
        "--device",
        device,
        "--config",
        config,
        "--layers",
        str(layers),
        "--prompt-tokens",
        str(context),
        "--batch",
        str(batch),
        "--new-tokens",
        str(plan["steps"]),
        "--rounds",
        str(plan["rounds"]),
        "--modes",
        "eager",
        "--references",
        "dynamic",
        "--sync-steps",
        "0",
        "--out",
        str(out),
        "--name",
        name,
    ]
    if device == "cpu":
        argv += ["--dtype", "float32"]
    for cache in CACHES:
        argv += ["--cache", cache]
    return _run(argv, name, timeout, out / f"{name}.log")


def kernel_cell(plan, device: str, out: Path, timeout: float) -> dict:
    """The code-reading kernel alone vs a plain read, in the first model cell's attention shape."""
    config = plan["cells"][0][0]
    code = (
        "import json, sys, torch; sys.path[:0] = [%r, %r]\n"  # noqa: UP031  (program text: %r writes each value as Python)
        "import bench_decode_bandwidth as b\n"
        "from gpu.random_models import published_config\n"
        "shape = b.attention_shape(published_config(%r, layers=1))\n"
        "dtype = torch.bfloat16 if %r == 'cuda' else torch.float32\n"
        "rows = b.kernel_rows(%r, %d, %d, device=%r, dtype=dtype, **shape)\n"
        "json.dump({'model_shape': %r, **shape, 'dtype': str(dtype), 'rows': rows}, open(%r, 'w'), indent=1)\n"
    ) % (
        str(EVAL),
        str(EVAL),
        config,
        device,
        plan["kernel_lengths"],
        plan["kernel_layers"],
        plan["repeats"],
        device,
        config,
        str(out / "kernel.json"),
    )
    return _run([sys.executable, "-c", code], "kernel", timeout, out / "kernel.log")


def _run(argv, name: str, timeout: float, log: Path) -> dict:
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode}; see {log.name})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout:.0f} s"
    return {"cell": name, "status": status, "seconds": round(time.monotonic() - t0, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=sorted(PLANS))
    parser.add_argument("--out", type=Path, required=True, help="the run's result folder (writes OUT/speed/)")
    parser.add_argument("--minutes", type=float, default=4.0, help="deadline for the whole stage (default 4)")
    args = parser.parse_args(argv)
    if not args.minutes > 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    plan = PLANS[args.device]
    out = args.out / "speed"
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + 60 * args.minutes
    jobs = [("model", c) for c in plan["cells"]]
    jobs.insert(1, ("kernel", None))
    done = []
    for kind, cell in jobs:
        left = deadline - time.monotonic()
        name = "kernel" if kind == "kernel" else cell_name(*cell)
        if left < plan["min_cell_s"]:
            done.append({"cell": name, "status": "skipped (no time left)", "seconds": 0})
        elif kind == "kernel":
            done.append(kernel_cell(plan, args.device, out, left))
        else:
            done.append(model_cell(cell, plan, args.device, out, left))
        print(f"speed {done[-1]['cell']}: {done[-1]['status']} ({done[-1]['seconds']} s)", flush=True)
        (out / "cells.json").write_text(json.dumps({"caches": CACHES, "plan": plan, "cells": done}, indent=1) + "\n")
    return 0 if any(d["status"] == "ok" for d in done) else 1


if __name__ == "__main__":
    sys.exit(main())
