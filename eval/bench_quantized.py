"""Quantized KV caches side by side on SmolLM2-135M (float32, CPU): ours (QuantizedFP8Cache, KIVICache) against
transformers' QuantizedCache (fp8, quanto int4/int2, hqq int4/int2) and DynamicCache, in one run.

Protocol: a 2048-token prompt of the offline corpus (pydoc) is prefilled (attention in full precision for every
cache, as all of them do), then 512 tokens are fed one per forward (teacher forcing) and each next-token
distribution is scored against DynamicCache's at the same step:
- KL: mean KL(full || cache) over the 512 distributions; top-1: fraction of steps with the same argmax;
- PPL: exp(mean NLL) of the actual next tokens;
- bytes held: cache_nbytes() (quantized data, scales, zero points, residual window, our slot metadata, as
  allocated), averaged over the 512 steps (transformers' residual buffers fill and flush every 128 tokens) and at the
  end; `store_bytes_mean` is the same without our layers' slot metadata (int32 position + validity per slot, grown
  1/8 at a time; a keep-all layer keeps only the validity byte: ~0.3% of an FP8 cache); our stores grow by 1/256 at
  a time (transformers' concatenate every step, which briefly holds old and new copies: not counted); our shared
  dequantization workspace (one layer in float32) is listed separately;
- decode ms/token: every configuration runs each step in turn (order rotated per step), so machine noise hits all
  alike; the ratio is the median over steps of (config time / DynamicCache time in the same step).
Static FP8 scales ("head, calibrated") come from `calibrate` on the last 4096 tokens of the corpus (never scored).

    .venv/bin/python eval/bench_quantized.py                 # ~20 min (one thread)
    .venv/bin/python eval/bench_quantized.py --prompt 512 --scored 64 --only dynamic hf_fp8 ours_fp8   # smoke
Writes eval/results/quantized.{csv,json,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stream_ppl import environment  # noqa: E402
from transformers import DynamicCache, QuantizedCache  # noqa: E402

import hf_kvcache  # noqa: E402
from hf_kvcache import KIVICache, QuantizedFP8Cache, cache_kwargs  # noqa: E402
from hf_kvcache.evaluation.memory import cache_nbytes  # noqa: E402
from hf_kvcache.sharing.calibration import calibrate  # noqa: E402

# name: (label, family, factory(model, scales))
CONFIGS = {
    "dynamic": ("DynamicCache (float32)", "reference", lambda m, s: DynamicCache(config=m.config)),
    "hf_fp8": (
        "transformers fp8 (E4M3, per-tensor)",
        "transformers",
        lambda m, s: QuantizedCache(backend="fp8", config=m.config),
    ),
    "hf_quanto_int4": (
        "transformers quanto int4 (g64, R128)",
        "transformers",
        lambda m, s: QuantizedCache(backend="quanto", config=m.config, nbits=4),
    ),
    "hf_quanto_int2": (
        "transformers quanto int2 (g64, R128)",
        "transformers",
        lambda m, s: QuantizedCache(backend="quanto", config=m.config, nbits=2),
    ),
    "hf_hqq_int4": (
        "transformers hqq int4 (g64, R128)",
        "transformers",
        lambda m, s: QuantizedCache(backend="hqq", config=m.config, nbits=4),
    ),
    "hf_hqq_int2": (
        "transformers hqq int2 (g64, R128)",
        "transformers",
        lambda m, s: QuantizedCache(backend="hqq", config=m.config, nbits=2),
    ),
    "ours_fp8_same_bytes": (
        "ours FP8 E4M3 per-head (warm-up) + Hadamard keys: transformers' fp8 bytes",
        "ours",
        lambda m, s: QuantizedFP8Cache(m, granularity="head", key_smoothing=False),
    ),
    "ours_fp8": ("ours FP8 E4M3 default (per-token, Hadamard keys)", "ours", lambda m, s: QuantizedFP8Cache(m)),
    "ours_fp8_smooth": (
        "ours FP8 E4M3 per-token + Hadamard keys + key smoothing",
        "ours",
        lambda m, s: QuantizedFP8Cache(m, key_smoothing=True),
    ),
    "ours_fp8_norot": (
        "ours FP8 E4M3 per-token + key smoothing, keys not rotated (the previous default)",
        "ours",
        lambda m, s: QuantizedFP8Cache(m, key_rotation="none", key_smoothing=True),
    ),
    "ours_fp8_head_norot": (
        "ours FP8 E4M3 per-head (warm-up), keys not rotated",
        "ours",
        lambda m, s: QuantizedFP8Cache(m, granularity="head", key_smoothing=False, key_rotation="none"),
    ),
    "ours_fp8_head_calibrated": (
        "ours FP8 E4M3 per-head, calibrated (Hadamard keys)",
        "ours",
        lambda m, s: QuantizedFP8Cache(m, granularity="head", scales=s),
    ),
    "ours_fp8_r64": ("ours FP8 default + residual 64", "ours", lambda m, s: QuantizedFP8Cache(m, residual=64)),
    "ours_int8k_fp8v": (
        "ours keys INT8 + values FP8 (per-token)",
        "ours",
        lambda m, s: QuantizedFP8Cache(m, key={"format": "int8"}),
    ),
    "ours_kivi4": (
        "ours KIVI int4 quanto (keys g32, values g64, fp16 scales, residual 8)",
        "ours",
        lambda m, s: KIVICache(
            m, bits=4, group_size=32, value_group_size=64, residual=8, backend="quanto", scale_dtype="float16"
        ),
    ),
    "ours_kivi4_rot": (
        "ours KIVI int4 quanto (as ours_kivi4) + Hadamard keys",
        "ours",
        lambda m, s: KIVICache(
            m,
            bits=4,
            group_size=32,
            value_group_size=64,
            residual=8,
            backend="quanto",
            scale_dtype="float16",
            key_rotation="hadamard",
        ),
    ),
    "ours_kivi4_hqq": (
        "ours KIVI int4 hqq (keys g32, values g64, fp16 scales, residual 8)",
        "ours",
        lambda m, s: KIVICache(
            m, bits=4, group_size=32, value_group_size=64, residual=8, backend="hqq", scale_dtype="float16"
        ),
    ),
    "ours_kivi4_g32_r128": (
        "ours KIVI int4 quanto (g32, residual 128: the paper's)",
        "ours",
        lambda m, s: KIVICache(m, bits=4, group_size=32, residual=128, backend="quanto"),
    ),
    "ours_kivi2": (
        "ours KIVI int2 quanto (keys g32, values g64, fp16 scales, residual 8)",
        "ours",
        lambda m, s: KIVICache(
            m, bits=2, group_size=32, value_group_size=64, residual=8, backend="quanto", scale_dtype="float16"
        ),
    ),
    "ours_kivi2_r128": (
        "ours KIVI int2 quanto (g32, residual 128)",
        "ours",
        lambda m, s: KIVICache(m, bits=2, group_size=32, residual=128, backend="quanto"),
    ),
}
HEADLINE = {
    "fp8": ("ours_fp8_same_bytes", "hf_fp8"),
    "fp8_default": ("ours_fp8", "hf_fp8"),
    "int4": ("ours_kivi4", "hf_quanto_int4"),
}
TARGETS = {"kl_ratio": 0.5, "fp8_decode": 1.15, "int4_decode": 1.5}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--scored", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=None, help="subset of configurations (dynamic is always run)")
    parser.add_argument("--bytes-every", type=int, default=8, help="sample bytes held every N steps")
    parser.add_argument("--results", type=Path, default=ROOT / "eval" / "results")
    parser.add_argument("--name", default="quantized", help="output file stem")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import transformers

    transformers.logging.set_verbosity_error()
    from hf_kvcache.sharing.corpus import load_tokens
    from hf_kvcache.sharing.models import load_model

    model, tokenizer = load_model("smollm2")
    hf_kvcache.enable(model)
    corpus = load_tokens(tokenizer, "pydoc")
    ids = corpus[:, : args.prompt + args.scored + 1]
    names = ["dynamic"] + [n for n in (args.only or CONFIGS) if n != "dynamic"]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")

    t0 = time.perf_counter()
    scales = calibrate(model, input_ids=corpus[:, -4096:], window=1024) if "ours_fp8_head_calibrated" in names else None
    calibration_s = time.perf_counter() - t0

    caches, prefill_s = {}, {}
    with torch.inference_mode():
        for n in names:
            caches[n] = CONFIGS[n][2](model, scales)
            t0 = time.perf_counter()
            model(input_ids=ids[:, : args.prompt], **cache_kwargs(caches[n]), use_cache=True, logits_to_keep=1)
            prefill_s[n] = time.perf_counter() - t0
            print(f"prefill {n}: {prefill_s[n]:.1f} s", flush=True)

        times = {n: [] for n in names}
        kl = {n: [] for n in names}
        top1 = {n: [] for n in names}
        nll = {n: [] for n in names}
        held = {n: [] for n in names}
        stored = {n: [] for n in names}  # ours: the stores alone (without the layers' slot metadata)
        workspace = {n: 0 for n in names}
        t_start = time.perf_counter()
        for step in range(args.scored):
            pos = args.prompt + step
            token, target = ids[:, pos : pos + 1], ids[0, pos + 1]
            order = names[step % len(names) :] + names[: step % len(names)]
            logprobs = {}
            for n in order:
                t0 = time.perf_counter()
                out = model(input_ids=token, **cache_kwargs(caches[n]), use_cache=True)
                times[n].append(time.perf_counter() - t0)
                logprobs[n] = out.logits[0, -1].float().log_softmax(-1)
            ref = logprobs["dynamic"]
            ref_top = int(ref.argmax())
            for n in names:
                lp = logprobs[n]
                kl[n].append(float((ref.exp() * (ref - lp)).sum()))
                top1[n].append(int(lp.argmax()) == ref_top)
                nll[n].append(-float(lp[target]))
            if step % args.bytes_every == 0 or step == args.scored - 1:
                for n in names:
                    held[n].append(cache_nbytes(caches[n]))
                    layers = getattr(caches[n], "layers", [])
                    has_store = all(hasattr(layer, "store") for layer in layers)
                    stored[n].append(sum(layer.store.nbytes() for layer in layers) if has_store else held[n][-1])
                    if hasattr(caches[n], "workspace_nbytes"):
                        workspace[n] = max(workspace[n], caches[n].workspace_nbytes())
            if (step + 1) % 32 == 0:
                print(f"step {step + 1}/{args.scored} ({time.perf_counter() - t_start:.0f} s)", flush=True)

    base = times["dynamic"]
    dyn_bytes = statistics.mean(held["dynamic"])
    rows = []
    for n in names:
        paired = statistics.median(a / b for a, b in zip(times[n], base))
        mean_bytes = statistics.mean(held[n])
        rows.append(
            {
                "config": n,
                "label": CONFIGS[n][0],
                "family": CONFIGS[n][1],
                "kl_mean": kl_value(kl[n]),
                "top1_agreement": round(sum(top1[n]) / len(top1[n]), 4),
                "ppl": round(math.exp(statistics.mean(nll[n])), 4),
                "bytes_held_mean": int(mean_bytes),
                "bytes_held_final": int(held[n][-1]),
                "bytes_ratio_to_dynamic": round(mean_bytes / dyn_bytes, 4),
                "store_bytes_mean": int(statistics.mean(stored[n])),
                "workspace_bytes": workspace[n],
                "decode_ms_median": round(1000 * statistics.median(times[n]), 2),
                "decode_ratio_to_dynamic": round(paired, 3),
                "prefill_s": round(prefill_s[n], 2),
            }
        )
    by_name = {r["config"]: r for r in rows}
    targets = evaluate_targets(by_name)

    args.results.mkdir(parents=True, exist_ok=True)
    with open(args.results / f"{args.name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    info = {
        "what": f"SmolLM2-135M float32, pydoc prompt of {args.prompt} tokens + {args.scored} scored tokens (one per "
        "forward), next-token distributions against DynamicCache's",
        "targets": targets,
        "calibration_seconds": round(calibration_s, 1),
        "threads": args.threads,
        "environment": environment(),
        "rows": rows,
    }
    with open(args.results / f"{args.name}.json", "w") as f:
        json.dump(info, f, indent=2)
    plot(rows, args.results / f"{args.name}.png", args)
    print_table(rows)
    print(json.dumps(targets, indent=2))


def kl_value(values: list[float]) -> float:
    return float(f"{statistics.mean(values):.4g}")


def evaluate_targets(rows: dict) -> dict:
    out = {}
    for kind, (ours, theirs) in HEADLINE.items():
        if ours not in rows or theirs not in rows:
            continue
        a, b = rows[ours], rows[theirs]
        kl_ratio = a["kl_mean"] / b["kl_mean"] if b["kl_mean"] > 0 else float("inf")
        bytes_ratio = a["bytes_held_mean"] / b["bytes_held_mean"]
        store_ratio = a["store_bytes_mean"] / b["store_bytes_mean"]
        decode_target = TARGETS["fp8_decode" if kind.startswith("fp8") else "int4_decode"]
        out[kind] = {
            "ours": ours,
            "transformers": theirs,
            "kl_ours": a["kl_mean"],
            "kl_transformers": b["kl_mean"],
            "kl_ratio": round(kl_ratio, 3),
            "kl_target": f"<= {TARGETS['kl_ratio']}",
            "kl_met": kl_ratio <= TARGETS["kl_ratio"],
            "bytes_ratio_ours_over_transformers": round(bytes_ratio, 3),
            "store_bytes_ratio_ours_over_transformers": round(store_ratio, 3),
            "bytes_target": "same bytes (within 5%)" if kind.startswith("fp8") else "no more bytes",
            "bytes_met": bytes_ratio <= (1.05 if kind.startswith("fp8") else 1.0),
            "decode_ratio": a["decode_ratio_to_dynamic"],
            "decode_target": f"<= {decode_target}",
            "decode_met": a["decode_ratio_to_dynamic"] <= decode_target,
            "transformers_decode_ratio": b["decode_ratio_to_dynamic"],
        }
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'config':26s} {'KL':>9s} {'top1':>6s} {'PPL':>8s} {'bytes/dyn':>9s} {'decode/dyn':>10s}")
    for r in rows:
        print(
            f"{r['config']:26s} {r['kl_mean']:9.2e} {r['top1_agreement']:6.3f} {r['ppl']:8.3f} "
            f"{r['bytes_ratio_to_dynamic']:9.3f} {r['decode_ratio_to_dynamic']:10.2f}"
        )


def plot(rows: list[dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"reference": "black", "transformers": "tab:orange", "ours": "tab:blue"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6))
    for r in rows:
        if r["config"] == "dynamic":
            continue
        ax1.scatter(r["bytes_ratio_to_dynamic"], r["kl_mean"], color=colors[r["family"]], s=40)
        ax1.annotate(
            r["config"],
            (r["bytes_ratio_to_dynamic"], r["kl_mean"]),
            fontsize=7,
            xytext=(4, 3),
            textcoords="offset points",
        )
    ax1.set_yscale("log")
    ax1.set_xlabel("bytes held / DynamicCache (mean over scored steps)")
    ax1.set_ylabel("mean KL(full || cache) per next-token distribution")
    ax1.set_title(f"SmolLM2-135M, {args.prompt}-token prompt + {args.scored} scored tokens")
    ax1.grid(True, which="both", alpha=0.3)
    names = [r["config"] for r in rows]
    ax2.barh(names, [r["decode_ratio_to_dynamic"] for r in rows], color=[colors[r["family"]] for r in rows])
    ax2.axvline(1.0, color="black", lw=0.8)
    ax2.axvline(TARGETS["fp8_decode"], color="tab:blue", ls="--", lw=0.8, label="FP8 target 1.15")
    ax2.axvline(TARGETS["int4_decode"], color="tab:blue", ls=":", lw=0.8, label="INT4 target 1.5")
    ax2.set_xlabel("decode ms/token / DynamicCache (median of per-step ratios)")
    ax2.invert_yaxis()
    ax2.legend(fontsize=8)
    ax2.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
