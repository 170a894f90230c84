"""Our rows next to kvpress's on the same positions: eval/results/peers_kvpress/side_by_side.md (and .json).

Reads kvpress's records (eval/peers/kvpress_side_by_side.py) and ours from eval/results/scorers_decode (uniform
budgets, prompt and "always" modes), eval/results/head_budgets (head-adaptive, prompt mode) and eval/results/kvzip
(KVzip, prompt mode).

    .venv/bin/python eval/peers/join_kvpress.py
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "eval" / "results"
OURS = ("scorers_decode", "head_budgets", "kvzip")
PEER = RESULTS / "peers_kvpress"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def main() -> None:
    rows = []
    for name in OURS:
        for r in (row for record in _records(RESULTS / name / "results.jsonl") for row in record["rows"]):
            label = r["label"].rsplit(" ", 1)[0] if r["label"].endswith("%") else r["label"]
            rows.append(
                {
                    "who": "hf-kvcache",
                    "method": label,
                    "budget": float(r["budget"]),
                    "kl_mean": r["kl_mean"],
                    "top1_agreement": r["top1_agreement"],
                    "bytes_held": r.get("bytes_held"),
                }
            )
    for r in _records(PEER / "results.jsonl"):
        rows.append(
            {
                "who": "kvpress 0.5.5",
                "method": r["label"],
                "budget": float(r["budget"]),
                "kl_mean": r["kl_mean"],
                "top1_agreement": r["top1_agreement"],
                "prompt_tokens_held_layer0": r.get("prompt_tokens_held_layer0"),
            }
        )
    if not rows:
        raise SystemExit("no results yet: run the sweeps and eval/peers/run_kvpress.sh first")
    # (H2O-average's budgets are given as heavy 0.0995 + 1 recent token: the same 10 / 20 / 50% as the others)
    rows.sort(key=lambda r: (round(r["budget"], 2), r["kl_mean"]))
    lines = ["| budget | method | by | KL mean | top-1 |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['budget']:.0%} | {r['method']} | {r['who']} | {r['kl_mean']:.4f} | {r['top1_agreement']:.3f} |"
        )
    PEER.mkdir(parents=True, exist_ok=True)
    (PEER / "side_by_side.md").write_text(
        "KL(full || compressed) on the same 256 teacher-forced positions after a 2048-token pydoc prompt (SmolLM2-135M,"
        " float32, CPU), lowest first per budget. kvpress rows: prompt compression inside the press; ours: labels say"
        " the mode.\n\n" + "\n".join(lines) + "\n"
    )
    (PEER / "side_by_side.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
