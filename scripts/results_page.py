"""Regenerate docs/results.md (and its plots under docs/assets/results/) from the committed files in eval/results/.

    python scripts/results_page.py            # rewrite the page and copy the plots
    python scripts/results_page.py --check    # exit 1 if the page or a plot is stale (tests/test_docs_site.py)

Every figure on the page is read from a result file, which the page names; nothing is typed by hand, so the page
cannot drift from the measurements. To change a figure, re-run the benchmark that writes its file (eval/README.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "eval" / "results"
PAGE = ROOT / "docs" / "results.md"
ASSETS = ROOT / "docs" / "assets" / "results"
#: plots shown on the page: (file under eval/results, name under docs/assets/results, caption)
PLOTS = [
    ("h2o/quality_vs_bytes.png", "budget_sweep.png", "Budget sweep: KL divergence vs bytes held"),
    ("quantization/quality_vs_bytes.png", "quantization.png", "Quantized caches: KL divergence vs bytes held"),
    ("stream_ppl.png", "stream_ppl.png", "Streaming perplexity per 1K tokens, 32K-token stream"),
    ("serve_bench.png", "serve_bench.png", "Continuous batching: concurrent requests vs KV memory"),
    ("ruler/board_h200/board.png", "ruler_board.png", "Generated RULER-style tasks: score vs compression (H200, bf16)"),
]


def _rows(path: pathlib.Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _num(value, digits: int = 3) -> str:
    if value in (None, ""):
        return ""
    x = float(value)
    if x != 0 and (abs(x) < 10**-digits or abs(x) >= 10**6):
        return f"{x:.2e}"
    text = f"{x:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _env(path: pathlib.Path) -> str:
    """'(date, transformers X, torch Y)' from a result's environment record, when it has one."""
    env = None
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        env = data.get("environment") if isinstance(data, dict) else None
        if env is None and isinstance(data, dict) and "transformers" in data:
            env = {"transformers": data["transformers"], "torch": data.get("torch")}
    elif (path.parent / "environment.json").exists():
        env = json.loads((path.parent / "environment.json").read_text(encoding="utf-8"))
    if isinstance(env, list):  # a sweep appends one record per (resumed) run: the last one wrote the newest cells
        env = env[-1] if env else None
    if not env:
        return ""
    parts = [
        env.get("date", "")[:10],
        f"transformers {env['transformers']}" if env.get("transformers") else "",
        f"torch {env['torch']}" if env.get("torch") else "",
    ]
    return " (" + ", ".join(p for p in parts if p) + ")"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _share(row: dict) -> float:
    """A sweep row's budget as a share of its prompt, to 2 digits (H2O-average's rows keep one token less)."""
    return round(int(row["budget_tokens"]) / int(row["context_len"]), 2)


def _source(path: pathlib.Path) -> str:
    return f"Source: `{path.relative_to(ROOT)}`{_env(path)}."


def budget_sweep() -> str:
    path = RESULTS / "h2o" / "results.csv"
    rows = [r for r in _rows(path) if r["metric"] == "quality" and r["cache"] != "dynamic"]
    rows.sort(key=lambda r: (r["label"].rsplit(" ", 1)[0], float(r["budget"] or 1)))
    body = [[r["label"], _num(r["kl_mean"]), _num(r["top1_agreement"]), _num(r["bytes_vs_dense"])] for r in rows]
    return (
        "## Budget sweep (eviction)\n\nSmolLM2-135M, float32, 2K-token prompt from the offline corpus, 256 scored "
        "tokens, KL divergence and top-1 agreement against the full cache on the same positions.\n\n"
        + _table(["cache and budget", "KL mean", "top-1", "bytes vs full"], body)
        + "\n\n"
        + _source(path)
    )


#: our scorer -> the kvpress press computing the same score (ObservedAttentionPress: H2O's attention averaged over the
#: queries that saw each token, our `attention_score="average"`)
PEER_PRESSES = {
    "ExpectedAttention": "ExpectedAttentionPress",
    "SnapKV": "SnapKVPress",
    "TOVA": "TOVAPress",
    "KeyDiff": "KeyDiffPress",
    "Knorm": "KnormPress",
    "H2O-average": "ObservedAttentionPress",
}
PEER_ADAPTIVE = {"ExpectedAttention": "AdaKV(ExpectedAttentionPress)", "SnapKV": "AdaKV(SnapKVPress)"}


PEER_RESULTS = RESULTS / "peers_kvpress" / "results.jsonl"


def _peer_records() -> list[dict]:
    """kvpress's rows on our positions (eval/peers/), one JSON record per line; none when not run."""
    if not PEER_RESULTS.exists():
        return []
    return [json.loads(line) for line in PEER_RESULTS.read_text(encoding="utf-8").splitlines() if line.strip()]


def scorer_modes() -> str:
    """Per scorer and budget: prompt mode, decode-time ("always"), head-adaptive (prompt), and kvpress's press."""
    path = RESULTS / "scorers_decode" / "results.csv"
    ours: dict[tuple[str, str, int], dict] = {}  # (scorer, mode, tokens kept of the prompt) -> row
    for r in _rows(path):
        name, mode = r["label"].split(" ")[:2]
        ours[(name, mode, int(r["budget_tokens"]))] = r
    adaptive_path = RESULTS / "head_budgets" / "results.csv"
    if adaptive_path.exists():
        for r in _rows(adaptive_path):
            ours[(r["label"].split(" ")[0], "adaptive", int(r["budget_tokens"]))] = r
    peer = {(record["label"], float(record["budget"])): record for record in _peer_records()}

    def kl(key):
        return _num(ours[key]["kl_mean"]) if key in ours else ""

    def peer_kl(press, share):
        record = peer.get((press, share))
        return _num(record["kl_mean"]) if record else ""

    body = []
    for name, _mode, tokens in sorted({k for k in ours if k[1] == "prompt"}, key=lambda k: (k[2], k[0])):
        prompt, always = ours[(name, "prompt", tokens)], ours.get((name, "always", tokens))
        share = round(tokens / int(prompt["context_len"]), 1)  # the budget as kvpress states it (10%, 20%, 50%)
        ratio = _num(float(always["kl_mean"]) / float(prompt["kl_mean"]), 2) if always else ""
        body.append(
            [
                f"{share:.0%} ({tokens})",
                name,
                _num(prompt["kl_mean"]),
                kl((name, "always", tokens)),
                ratio,
                _num(always["top1_agreement"]) if always else "",
                kl((name, "adaptive", tokens)),
                peer_kl(PEER_PRESSES.get(name, ""), share),
                peer_kl(PEER_ADAPTIVE.get(name, ""), share),
            ]
        )
    # (KVzipPress: next to our KVzip in its own table below)
    others = sorted(
        {press for press, _ in peer} - set(PEER_PRESSES.values()) - set(PEER_ADAPTIVE.values()) - {"KVzipPress"}
    )
    other_rows = [
        [
            press,
            f"{share:.0%}",
            _num(peer[(press, share)]["kl_mean"]),
            _num(peer[(press, share)]["top1_agreement"]),
            str(peer[(press, share)]["prompt_tokens_held_layer0"]),
        ]
        for press in others
        for share in sorted({s for p, s in peer if p == press})
    ]
    other_table = (
        (
            "\n\nkvpress presses with no counterpart here (the whole prompt held means the press masks "
            "the dropped tokens instead of freeing them):\n\n"
            + _table(["kvpress press", "budget", "KL mean", "top-1", "prompt tokens held (layer 0)"], other_rows)
        )
        if other_rows
        else ""
    )
    return (
        "## Scorers: prompt mode, decode-time eviction, head-adaptive budgets, kvpress\n\nKL against the full "
        "cache on the same 256 teacher-forced positions after a 2K-token prompt. *prompt*: compressed once, the "
        "rest appended (kvpress's protocol); *always*: the budget holds through the 256 tokens (half of it a "
        'protected recent window by default); *adaptive*: `head_budget="adaptive"` in prompt mode (AdaKV '
        "allotment, one slot pool per layer holding exactly the budget); *kvpress*: the same press in kvpress "
        "0.5.5 on the same positions (eval/peers/), AdaKV there masks dropped keys and holds the whole prompt."
        "\n\n"
        + _table(
            [
                "budget",
                "scorer",
                "prompt",
                "always",
                "always / prompt",
                "always top-1",
                "adaptive",
                "kvpress",
                "kvpress AdaKV",
            ],
            body,
        )
        + other_table
        + "\n\n"
        + _source(path)
        + " "
        + _source(adaptive_path)
        + (" " + _source(PEER_RESULTS) if peer else "")
    )


def two_models() -> str:
    """Prompt mode at 20% kept on both offline models, side by side by label: SmolLM2-135M's rows (scorers_prompt,
    scorers_decode's H2O-average, kvzip's default) and Gemma 3 270M's (scorers_prompt_gemma3)."""
    gemma_path = RESULTS / "scorers_prompt_gemma3" / "results.csv"
    if not gemma_path.exists():
        return ""
    smol_paths = [RESULTS / d / "results.csv" for d in ("scorers_prompt", "scorers_decode", "kvzip")]

    def at_20(rows):  # label without its budget -> row, the rows keeping 20% of the prompt
        kept = [r for r in rows if _share(r) == 0.2]
        return {r["label"].rsplit(" ", 1)[0]: r for r in kept}

    smol = at_20([r for path in smol_paths for r in _rows(path)])
    gemma = at_20(_rows(gemma_path))
    best_smol = min(float(smol[k]["kl_mean"]) for k in gemma if k in smol)
    best_gemma = min(float(r["kl_mean"]) for r in gemma.values())
    body = [
        [
            label.removesuffix(" prompt"),
            _num(smol[label]["kl_mean"]) if label in smol else "",
            _num(float(smol[label]["kl_mean"]) / best_smol, 2) if label in smol else "",
            _num(smol[label]["top1_agreement"]) if label in smol else "",
            _num(r["kl_mean"]),
            _num(float(r["kl_mean"]) / best_gemma, 2),
            _num(r["top1_agreement"]),
        ]
        for label, r in sorted(gemma.items(), key=lambda item: float(item[1]["kl_mean"]))
    ]
    return (
        "## Two models: prompt mode at 20% kept\n\nKL against the full cache on the same 256 teacher-forced "
        "positions after a 2K-token pydoc prompt (offset 20000), 20% of the prompt kept, on SmolLM2-135M (a Llama: "
        "30 full-attention layers) and Gemma 3 270M (a hybrid: 15 sliding-window layers of 512 tokens, which every "
        "cache keeps as the model does, and 3 full-attention layers, which are compressed). *x best*: the KL over "
        "the best row of the same model. Why KVzip falls behind on Gemma 3: docs/scorers.md.\n\n"
        + _table(["method", "SmolLM2 KL", "x best", "SmolLM2 top-1", "Gemma 3 KL", "x best", "Gemma 3 top-1"], body)
        + "\n\n"
        + " ".join(_source(path) for path in smol_paths + [gemma_path])
    )


def kvzip() -> str:
    """KVzip's configurations per budget, next to the best prompt-mode row of the other scorers (uniform budgets) and
    kvpress's KVzipPress on the same positions."""
    path = RESULTS / "kvzip" / "results.csv"
    if not path.exists():
        return ""

    uniform: dict[float, tuple[float, str]] = {}  # share -> (KL, label) of the best non-adaptive prompt-mode row
    for r in _rows(RESULTS / "scorers_decode" / "results.csv") + _rows(path):
        uniform_prompt_mode = " prompt" in r["label"] and not any(w in r["label"] for w in ("adaptive", "model-wide"))
        if uniform_prompt_mode and (_share(r) not in uniform or float(r["kl_mean"]) < uniform[_share(r)][0]):
            uniform[_share(r)] = (float(r["kl_mean"]), r["label"].rsplit(" ", 1)[0])
    peer = {round(float(record["budget"]), 2): record for record in _peer_records() if record["label"] == "KVzipPress"}
    rows = sorted(_rows(path), key=lambda r: (int(r["budget_tokens"]), float(r["kl_mean"])))
    body = []
    for r in rows:
        best, best_label = uniform[_share(r)]
        body.append(
            [
                f"{_share(r):.0%} ({r['budget_tokens']})",
                r["label"].rsplit(" ", 1)[0].removesuffix(" prompt"),
                _num(r["kl_mean"]),
                _num(r["top1_agreement"]),
                _num(r["bytes_vs_dense"]),
                _num(float(r["kl_mean"]) / best, 2),
                f"{best_label} ({_num(best)})",
                _num(peer[_share(r)]["kl_mean"]) if _share(r) in peer else "",
            ]
        )
    cost = RESULTS / "kvzip" / "prefill_cost.json"
    cost_text = ""
    if cost.exists():
        ratios = json.loads(cost.read_text(encoding="utf-8"))["ratio_to_dynamic_prefill"]
        cost_text = (
            f" Prefill with the reconstruction: {ratios['kvzip']:.2f}x a plain prefill (H2O's scored "
            f"prefill {ratios['h2o']:.2f}x). " + _source(cost)
        )
    return (
        "## KVzip: context reconstruction (prompt mode)\n\nSame positions as the scorer table. *model-wide*: "
        '`head_budget="adaptive", layer_budget="adaptive"` (the model\'s budget allotted over layers and '
        "heads by score, KVzip's own; bytes held are the budget); *adaptive*: per layer over its heads; "
        "*layer-adaptive*: over layers, uniform heads. *vs best uniform*: KL over the best non-adaptive "
        "prompt-mode row at the same budget (any scorer)."
        + cost_text
        + "\n\n"
        + _table(
            [
                "budget",
                "configuration",
                "KL mean",
                "top-1",
                "bytes vs full",
                "vs best uniform",
                "best uniform",
                "kvpress KVzipPress",
            ],
            body,
        )
        + "\n\n"
        + _source(path)
    )


EQUAL_BYTES_TARGETS = (0.1, 0.2, 0.5)


def equal_bytes() -> str:
    """Our quantized KVzip / KVzap placements at 10 / 20 / 50% of a bfloat16 cache's bytes for the prompt, against
    kvpress's presses at their token ratios (what they hold: a pruning press its kept tokens in bfloat16, KVzipPress
    the whole prompt, masked)."""
    path = RESULTS / "equal_bytes" / "results.csv"
    if not path.exists():
        return ""
    peers = _peer_records()
    kvzip_press = {round(float(r["budget"]), 2): r for r in peers if r["label"] == "KVzipPress"}
    body = []
    for target in EQUAL_BYTES_TARGETS:
        rows = []
        for r in _rows(path):
            held = float(r["prompt_bytes_vs_bf16"])
            if held <= target and not any(held <= lower for lower in EQUAL_BYTES_TARGETS if lower < target):
                rows.append((float(r["kl_mean"]), r["label"].rsplit(" ", 1)[0], "hf-kvcache", held, r))
        for record in peers:
            held = record.get("prompt_tokens_held_layer0", 0) / record["context_len"]
            if held <= target + 0.005 and round(float(record["budget"]), 2) == target:
                rows.append((record["kl_mean"], record["label"], "kvpress 0.5.5", held, record))
        reference = kvzip_press.get(target)
        for kl, label, by, held, r in sorted(rows, key=lambda item: item[0]):
            tokens = r.get("budget_tokens") or r.get("prompt_tokens_held_layer0")
            body.append(
                [
                    f"{target:.0%}",
                    label,
                    by,
                    _num(held),
                    str(tokens),
                    _num(kl),
                    _num(r["top1_agreement"]),
                    _num(kl / reference["kl_mean"], 2) if reference else "",
                ]
            )
    return (
        "## Equal bytes: eviction and quantization together\n\n"
        "KL and top-1 on the scorer table's positions with the cache holding at most 10 / 20 / 50% of a bfloat16 "
        "cache's bytes for the 2K prompt (*bytes*: what `nbytes()` reports once the prompt is compressed, "
        "metadata included, over a bfloat16 cache of the prompt). Ours: KVzip's model-wide placement (and KVzap's "
        "predicted one) with the kept tokens quantized per token, keys Hadamard-rotated, and a window of the newest "
        "64 tokens per head kept (part of the budget). kvpress's presses at the "
        "same share of the tokens, which they hold in bfloat16. KVzipPress masks and holds the whole prompt (all "
        "its bytes), so it has no row here; *vs KVzipPress*: the KL over KVzipPress's at that share of the "
        "tokens.\n\n"
        + _table(
            ["bytes target", "method", "by", "bytes vs bf16", "tokens kept", "KL mean", "top-1", "vs KVzipPress"],
            body,
        )
        + "\n\n"
        + _source(path)
    )


def kvzap_cost() -> str:
    """KVzap against KVzip: quality at 20% in both modes, and the prefill cost."""
    path = RESULTS / "kvzap" / "results.csv"
    if not path.exists():
        return ""
    rows = _rows(path)
    body = [
        [r["label"].rsplit(" ", 1)[0], f"{float(r['budget']):.0%}", _num(r["kl_mean"]), _num(r["top1_agreement"])]
        for r in sorted(rows, key=lambda r: (float(r["budget"]), float(r["kl_mean"])))
    ]
    cost = RESULTS / "kvzip" / "prefill_cost.json"
    cost_text = ""
    if cost.exists():
        ratios = json.loads(cost.read_text(encoding="utf-8"))["ratio_to_dynamic_prefill"]
        if "kvzap" in ratios:
            cost_text = (
                f" Prefill and placement: KVzap {ratios['kvzap']:.2f}x a plain prefill, KVzip {ratios['kvzip']:.2f}x "
                "(interleaved). " + _source(cost)
            )
    ruler = RESULTS / "ruler" / "kvzap_cpu" / "cells.csv"
    ruler_text = ""
    if ruler.exists():
        cells = [
            [r["method"], r["task"], r["context_len"], f"{float(r['compression']):.0%}", _num(r["score"], 2)]
            + [" - ".join(_num(x, 2) for x in json.loads(r["ci95"])), r["n"]]
            for r in _rows(ruler)
        ]
        ruler_text = (
            "\n\nNeedle retrieval with a natural-text haystack (SmolLM2, float32, CPU; question after the compressed "
            "context):\n\n"
            + _table(["method", "task", "tokens", "compression", "score", "95% interval", "n"], cells)
            + "\n\n"
            + _source(ruler)
        )
    return (
        "## KVzap: KVzip's scores predicted\n\nThe shipped linear surrogate for SmolLM2 (docs/scorers.md) on the "
        "scorer table's positions, which it never trained on. *always*: decode-time eviction, with its default "
        "window of the newest tokens (a third of the budget, 136 tokens here); the *window-N* rows are the "
        "alternatives it was chosen from."
        + cost_text
        + "\n\n"
        + _table(["configuration", "budget", "KL mean", "top-1"], body)
        + "\n\n"
        + _source(path)
        + ruler_text
    )


def ruler_tasks() -> str:
    """Which generated tasks the full cache can do (eval/ruler_full_cache.py): kept where it scores well above
    chance."""
    path = RESULTS / "ruler" / "full_cache.json"
    if not path.exists():
        return ""
    report = json.loads(path.read_text(encoding="utf-8"))
    body = [
        [
            r["task"],
            str(r["context_len"]),
            str(r["samples"]),
            _num(r["mean"]),
            f"[{_num(r['ci95'][0])}, {_num(r['ci95'][1])}]",
            _num(r["chance"]),
            "kept" if r["kept"] else "dropped",
        ]
        for r in report["rows"]
    ]
    return (
        "## Generated tasks: what the full cache can do\n\nEvery task of `hf_kvcache.evaluation.ruler` through "
        f"the full cache (DynamicCache), greedy, question after the context; kept for the leaderboard where the "
        f"mean is at least chance + {report['keep_rule'].rsplit('+ ', 1)[-1]} "
        f"([task accuracy](ruler.md)).\n\n"
        + _table(["task", "tokens", "samples", "full-cache score", "95% interval", "chance", "board"], body)
        + "\n\n"
        + _source(path)
    )


BOARD = RESULTS / "ruler" / "board_h200"


def ruler_board() -> str:
    """The board (hf-kvcache ruler) as run: the mean over its complete tasks per method and compression, with the
    95% half-width, then one task where every method is complete (KVzip too), then the 4K full-cache check."""
    if not (BOARD / "board.json").exists():
        return ""
    board = json.loads((BOARD / "board.json").read_text(encoding="utf-8"))
    run = json.loads((BOARD / "run.json").read_text(encoding="utf-8"))
    points = [0.25, 0.5, 0.75, 0.9]

    def grid(rows, value) -> list[list[str]]:
        by_method: dict[str, dict] = {}
        for r in rows:
            by_method.setdefault(r["method"], {})[round(r["compression"], 2)] = r
        body = []
        for method, got in sorted(by_method.items(), key=lambda kv: (kv[0] != "full", kv[0])):
            if method == "full" or all(p not in got for p in points):  # full cache / fixed methods: one point
                ((c, r),) = got.items()
                body.append([method, f"{value(r)} at {_num(c, 2)}"] + [""] * (len(points) - 1))
            else:
                body.append([method] + [value(got[p]) if p in got else "" for p in points])
        return body

    rows = [r for r in board["board"] if r["complete"] and r["context_len"] == 2048]
    mean = grid(rows, lambda r: f"{_num(r['score'], 2)} ± {_num(r['ci95_halfwidth'], 2)}")
    task = "niah_single_1"
    cells = [c for c in board["cells"] if c["task"] == task and c["context_len"] == 2048 and c["n"] == 50]
    single = grid(cells, lambda c: _num(c["score"], 2))
    check = json.loads((BOARD / "full_cache_4k.json").read_text(encoding="utf-8"))
    kept = [
        [r["task"], str(r["samples"]), _num(r["mean"], 2), _num(r["chance"], 2), "kept" if r["kept"] else "dropped"]
        for r in check["rows"]
    ]
    headers = ["method"] + [f"{int(p * 100)}%" for p in points]
    return (
        "## Generated tasks: the board (H200, bfloat16)\n\n" + run["what"] + f". {run['answers']} answers. "
        f"Complete: {run['complete']}. Not run: " + "; ".join(run["not_run"]) + ". "
        "Compression = share of the context's tokens dropped (FP8: its measured bytes against bf16). "
        "([task accuracy](ruler.md)).\n\nMean over " + ", ".join(board["tasks"]) + ", 50 samples each, "
        "± the 95% half-width of the mean:\n\n" + _table(headers, mean) + f"\n\n`{task}` alone (KVzip "
        "complete there):\n\n" + _table(headers, single) + "\n\nThe full cache at 4K tokens (20 samples per "
        "task, the same check as at 1K / 2K, in bf16 on the H200):\n\n"
        + _table(["task", "samples", "full-cache score", "chance", "board at 4K"], kept)
        + "\n\n"
        + _source(BOARD / "run.json")
    )


def quantized() -> str:
    path = RESULTS / "quantized.csv"
    body = [
        [
            r["label"],
            _num(r["kl_mean"], 4),
            _num(r["top1_agreement"]),
            _num(r["bytes_ratio_to_dynamic"]),
            _num(r["decode_ratio_to_dynamic"]),
        ]
        for r in _rows(path)
    ]
    return (
        "## Quantized caches vs transformers' QuantizedCache\n\n2K-token prompt + 512 scored tokens, one "
        "interleaved run.\n\n"
        + _table(["cache", "KL mean", "top-1", "bytes vs full", "decode vs full"], body)
        + "\n\n"
        + _source(RESULTS / "quantized.json")
    )


def streaming() -> str:
    path = RESULTS / "stream_ppl.csv"
    by_cache: dict[str, list[dict]] = {}
    for r in _rows(path):
        by_cache.setdefault(r["cache"], []).append(r)
    body = []
    for cache, rows in by_cache.items():
        ppl = [float(r["ppl"]) for r in rows]
        nll = sum(math.log(p) * int(r["tokens"]) for p, r in zip(ppl, rows)) / sum(int(r["tokens"]) for r in rows)
        body.append(
            [
                cache,
                str(sum(int(r["tokens"]) for r in rows)),
                _num(math.exp(nll), 2),
                _num(min(ppl), 2),
                _num(max(ppl), 2),
            ]
        )
    return (
        "## Streaming perplexity\n\nOne token per forward (StreamingLLM's protocol) through a 32K-token stream, "
        "4x the model's training context; perplexity per bucket of 1024 positions.\n\n"
        + _table(["cache", "tokens", "PPL (all)", "best bucket", "worst bucket"], body)
        + "\n\n"
        + _source(RESULTS / "stream_ppl.json")
    )


def serving() -> str:
    parts = [
        "## Continuous batching with quantized pages\n\n`hf-kvcache serve-bench`: the same requests through "
        "transformers' `generate_batch` at one KV memory budget, model-dtype (bfloat16) pages vs FP8 / INT8 "
        "pages; ratios to model-dtype pages in the same run. The two `serve_bench_transformers_*` runs were made "
        "one after the other on the same day with the same settings (one budget, one round each: the "
        "throughput and TTFT ratios move by tens of percent between runs on this shared CPU; the request counts "
        "and KL do not)."
    ]
    serve_bench = (
        "serve_bench.json",
        "serve_bench_transformers_5.23.json",
        "serve_bench_transformers_5.24.json",
        "serve_bench.gemma3_fp8.json",
    )
    for name in serve_bench:
        path = RESULTS / name
        if not path.exists():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        summary, settings = data["summary"], data["settings"]
        other_model = (  # (the page's model is SmolLM2: a run on another one says so)
            f"On {settings['model']}: {settings['requests']} requests with prompts of {settings['prompt_min']}-"
            f"{settings['prompt_max']} tokens, {settings['budget_tokens']} tokens of model-dtype pages.\n\n"
            if settings.get("model", "smollm2") != "smollm2"
            else ""
        )
        body = [
            [
                key,
                _num(v["concurrency_ratio"]),
                _num(v["pages_ratio"]),
                _num(v["tokens_per_s_ratio"]),
                _num(v["ttft_mean_ratio"]),
                _num(v["kl_mean"], 4),
            ]
            for key, v in summary.items()
        ]
        parts.append(
            other_model
            + _table(["pages @ budget", "mean concurrent requests", "pages", "tokens/s", "TTFT", "KL"], body)
            + "\n\n"
            + _source(path)
        )
    # what a committed run's unresolved label ran (a spec giving no chunk runs the default of its day)
    ran = {
        "serve_bench.defaults_f32.json": " `budget=0.25` ran KVzap every 512 prompt tokens, the default then.",
        "serve_bench.defaults256_f32.json": " `budget=0.25` ran KVzap every 256 prompt tokens, the default.",
        "serve_bench.fp8_defaults.json": " `budget=0.25` ran KVzap every 256 prompt tokens, the default.",
    }
    for path in (
        RESULTS / "serve_bench.compress.json",
        RESULTS / "serve_bench.compress_chunk.json",
        RESULTS / "serve_bench.heads.json",
        RESULTS / "serve_bench.defaults_f32.json",
        RESULTS / "serve_bench.defaults256_f32.json",
        RESULTS / "serve_bench.fp8_defaults.json",
    ):
        if not path.exists():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        settings = data["settings"]
        body = [
            [
                key,
                _num(v["concurrency_ratio"]),
                _num(v["steady_peak_ratio"]),
                _num(v["pages_ratio"]),
                _num(v.get("tokens_kept_share")),
                _num(v["tokens_per_s_ratio"]),
                _num(v["ttft_mean_ratio"]),
                _num(v.get("itl_mean_ratio")),
                _num(v["kl_mean"], 4),
            ]
            for key, v in data["summary"].items()
        ]
        parts.append(
            "Prompt eviction in continuous batching (`kv_compress`, `hf-kvcache serve-bench --kv-compress`): "
            f"{settings['requests']} requests with prompts of {settings['prompt_min']}-{settings['prompt_max']} "
            f"tokens and {settings['new_min']}-{settings['new_max']} new tokens, {settings['budget_tokens']} tokens of "
            f"model-dtype pages (page {settings['page_size']}); ratios to model-dtype pages without eviction in the "
            f"same run; `kept` is the share of the prompts' tokens kept.{ran.get(path.name, '')}\n\n"
            + _table(
                [
                    "run @ budget",
                    "mean concurrent requests",
                    "its peak",
                    "pages",
                    "kept",
                    "tokens/s",
                    "TTFT",
                    "inter-token latency",
                    "KL",
                ],
                body,
            )
            + "\n\n"
            + _source(path)
        )
    for path, through in (
        (RESULTS / "ruler_http" / "cells.json", "through `hf-kvcache serve`'s HTTP API"),
        (
            RESULTS / "ruler_http" / "generate" / "cells.json",
            "through `generate`, the same eviction one request at a time",
        ),
        (
            RESULTS / "ruler_http" / "chunk512_f32" / "cells.json",
            "through the server in float32, KVzap every 512 tokens",
        ),
        (
            RESULTS / "ruler_http" / "chunk256_f32" / "cells.json",
            "through the server in float32, KVzap every 256 tokens (the default)",
        ),
    ):
        if not path.exists():
            continue
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        body = [
            [c["kv_compress"], c["task"], str(c["context_len"]), str(c["n"]), _num(c["score"]), _ci(c["ci95"])]
            for c in cells
        ]
        parts.append(
            f"Needle tasks {through} (`eval/ruler_http.py`: the board's samples as completion prompts, each "
            "request naming its `kv_compress`; the prompt is compressed at the end of its prefill, or every `chunk` "
            "tokens).\n\n"
            + _table(["kv_compress", "task", "length", "n", "score", "95% interval"], body)
            + "\n\n"
            + _source(path)
        )
    parts.append(
        "`hf-kvcache serve` through HTTP (`eval/bench_serve_http.py`): the same streamed chat requests from concurrent "
        "clients to one server per page format at one KV memory; concurrency is the mean of the requests holding "
        "pages where requests waited; ratios to model-dtype pages (`:dequantize`: FP8 pages on the gather-and-"
        "dequantize path, attention otherwise reads the codes)."
    )
    for name in (
        "serve_http.json",
        "serve_http.decode_heavy.json",
        "serve_http.compress.json",
        "serve_http.compress_chunk.json",
    ):
        path = RESULTS / name
        if not path.exists():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        settings = data["settings"]
        body = [
            [
                key,
                _num(v["concurrency_mean_memory_bound_ratio"]),
                _num(v["tokens_capacity_ratio"]),
                _num(v["tokens_per_s_ratio"]),
                _num(v["ttft_median_s_ratio"]),
                _num(v["itl_median_s_ratio"]),
            ]
            for key, v in data["summary"].items()
        ]
        parts.append(
            f"{settings['requests']} requests from {settings['clients']} clients, prompts of "
            f"{settings['prompt_tokens']} tokens, max_tokens {settings['new_tokens']}, KV memory "
            f"{settings['kv_memory']}, {settings['rounds']} round(s).\n\n"
            + _table(["pages", "concurrent requests", "tokens held", "tokens/s", "TTFT", "inter-token latency"], body)
            + "\n\n"
            + _source(path)
        )
    return "\n\n".join(parts)


def _ci(interval) -> str:
    return f"[{interval[0]:.2f}, {interval[1]:.2f}]"


def demo() -> str:
    path = RESULTS / "demo" / "demo.csv"
    body = [
        [
            r["cache"],
            r["budget"],
            _num(float(r["bytes_held"]) / 2**20, 1),
            _num(r["generated_agreement"]),
            _num(r["top1_agreement"]),
        ]
        for r in _rows(path)
    ]
    return (
        "## The demo (`make demo`)\n\nSmolLM2, 512-token prompt + 32 generated tokens through every cache "
        "family.\n\n"
        + _table(["cache", "budget", "MiB held", "greedy agreement", "top-1"], body)
        + "\n\n"
        + _source(path)
    )


GPU_RUNS = RESULTS / "gpu"


def gpu_runs(folder: pathlib.Path = GPU_RUNS) -> str:
    """The GPU acceptance runs (eval/gpu/accept.sh, one folder DATE-DEVICE each): per run its environment and stages,
    then the speed cells (decode ms/token and ratio to DynamicCache, prefill, peak memory per cache), the kernel
    against a plain read, and serving (FP8 pages vs model-dtype pages at equal KV memory)."""
    head = (
        '## GPU acceptance runs\n\n`bash eval/gpu/accept.sh` on a lent GPU (eval/README.md, "GPU acceptance '
        'run"): correctness on CUDA, speed on random weights in Llama-3.1-8B / Qwen3-8B shapes, serving, and '
        "the RULER board's missing answers."
    )
    runs = sorted(p for p in folder.glob("*/summary.json")) if folder.exists() else []
    if not runs:
        return head + " No run has landed yet: `eval/results/gpu/` is empty."
    parts = [head]
    for path in runs:
        summary = json.loads(path.read_text(encoding="utf-8"))
        run = path.parent
        stages = ", ".join(
            f"{name} {s['status']} ({_num(s['seconds'], 0)} s)" for name, s in summary.get("stages", {}).items()
        )
        parts.append(
            f"### {run.name}\n\n{summary.get('device_name')}, driver {summary.get('driver')}, CUDA "
            f"{summary.get('cuda')}, torch {summary.get('torch')}, "
            f"transformers {summary.get('transformers')}, "
            f"commit {summary.get('commit')}. Stages: {stages or 'none'}."
        )
        rows = []
        for cell in sorted(run.glob("speed/*.csv")):
            for r in _rows(cell):
                label = r["cache"] if len(r["cache"]) <= 48 else r["name"] + " (config: the CSV)"
                rows.append(
                    [
                        cell.stem,
                        label,
                        _num(r["decode_ms_per_step"]),
                        _num(r["decode_vs_ref"]),
                        _num(r["prefill_s"]),
                        _num(r["prefill_vs_ref"]),
                        _num(float(r["cuda_peak_bytes"]) / 2**20, 1) if r["cuda_peak_bytes"] else "",
                    ]
                )
        if rows:
            parts.append(
                "Speed (eager, interleaved rounds; x dynamic: DynamicCache's time over the cache's, > 1 is "
                "faster):\n\n"
                + _table(["cell", "cache", "decode ms/token", "x dynamic", "prefill s", "x dynamic", "peak MiB"], rows)
            )
        kernel = run / "speed" / "kernel.json"
        if kernel.exists():
            krows = [
                [
                    r["cache"],
                    str(r["context"]),
                    _num(r["kernel_gb_per_s"]),
                    _num(r["read_bound_gb_per_s"]),
                    _num(r["share_of_bound"]),
                ]
                for r in json.loads(kernel.read_text(encoding="utf-8"))["rows"]
            ]
            parts.append(
                "The code-reading kernel alone against a plain read of the same bytes:\n\n"
                + _table(["layout", "tokens", "kernel GB/s", "plain read GB/s", "share"], krows)
            )
        serve = run / "serve" / "serve_bench.json"
        if serve.exists():
            data = json.loads(serve.read_text(encoding="utf-8"))
            srows = [
                [
                    r["format"],
                    _num(r["budget_scale"]),
                    _num(r.get("steady_mean_concurrent_requests")),
                    _num(r["tokens_per_s"], 1),
                    _num(r["ttft_mean_s"]),
                    _num(r.get("itl_mean_s")),
                ]
                for r in data["runs"]
            ]
            parts.append(
                "Serving (`serve-bench`, equal KV memory):\n\n"
                + _table(["pages", "budget x", "mean concurrent", "tokens/s", "TTFT s", "ITL s"], srows)
            )
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        parts.append(f"Source: `{shown}` and the files beside it.")
    return "\n\n".join(parts)


def render() -> str:
    plots = "\n\n".join(f"![{caption}](assets/results/{name})" for _, name, caption in PLOTS)
    sections = [
        budget_sweep(),
        scorer_modes(),
        kvzip(),
        two_models(),
        equal_bytes(),
        kvzap_cost(),
        ruler_tasks(),
        ruler_board(),
        quantized(),
        streaming(),
        serving(),
        gpu_runs(),
        demo(),
    ]
    return (
        "# Results\n\nGenerated by `scripts/results_page.py` from the files in `eval/results/` (each table names "
        "its file); do not edit by hand. Measured on SmolLM2-135M-Instruct on a shared 2-core CPU unless a "
        "file says otherwise: ratios measured side by side in one run, absolute times only as the files give "
        "them. The benchmarks and how to re-run them: `eval/README.md`.\n\n"
        + plots
        + "\n\n"
        + "\n\n".join(section for section in sections if section)  # (a section without its results: none)
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/results.md or a plot is stale")
    args = parser.parse_args(argv)
    text = render()
    stale = [] if PAGE.exists() and PAGE.read_text(encoding="utf-8") == text else [str(PAGE.relative_to(ROOT))]
    for source, name, _ in PLOTS:
        target = ASSETS / name
        if not target.exists() or target.read_bytes() != (RESULTS / source).read_bytes():
            stale.append(str(target.relative_to(ROOT)))
    if args.check:
        if stale:
            print("stale (run python scripts/results_page.py):", ", ".join(stale))
        return 1 if stale else 0
    PAGE.write_text(text, encoding="utf-8")
    ASSETS.mkdir(parents=True, exist_ok=True)
    for source, name, _ in PLOTS:
        shutil.copyfile(RESULTS / source, ASSETS / name)
    print(f"wrote {PAGE.relative_to(ROOT)} and {len(PLOTS)} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
