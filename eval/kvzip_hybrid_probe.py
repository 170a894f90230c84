"""Why KVzip loses on a hybrid model (issue 61): does what KVzip keeps in the full-attention layers match what the
continuation attends to there?

On the model (default the offline Gemma 3 270M: 5 sliding-window layers to 1 full-attention layer, one KV head), per
text offset: a `context`-token prompt is prefilled into a KVzipCache and scored (`score_context`: the reconstruction's
largest attention per context token); the model's reconstruction accuracy (teacher-forced top-1 while repeating the
context after KVzip's request) says whether the model can repeat at all. Then one eager forward over the prompt and the
next `continuation` tokens gives, per full-attention layer, the attention the continuation's queries pay to each
context token (summed over queries and heads: the "oracle" a method would keep). Each selection of `budget` tokens
is rated by the share of that oracle mass it covers:

- kvzip: KVzip's reconstruction scores (what KVzipCache keeps in the layer, uniform allotment);
- h2o: the prompt's average attention received (H2O's average score, kvpress's ObservedAttentionPress);
- snapkv: the attention of the prompt's last 64 queries (SnapKV's observation window, no pooling);
- oracle-max: the continuation's own max attention (an upper reference, not a method).

    python eval/kvzip_hybrid_probe.py [--model gemma3] [--offsets 20000 60000] [--out eval/results/kvzip_hybrid]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_kvcache import KVzipCache  # noqa: E402
from hf_kvcache.caches.kvzip_request import request_ids_for_model  # noqa: E402
from hf_kvcache.integration.cache_argument import cache_kwargs  # noqa: E402
from hf_kvcache.sharing.corpus import load_tokens  # noqa: E402
from hf_kvcache.sharing.models import load_model  # noqa: E402

SNAPKV_WINDOW = 64


def covered(selection_scores: torch.Tensor, oracle: torch.Tensor, budget: int) -> dict:
    """The share of the oracle's mass the top-`budget` tokens by `selection_scores` hold, and where they lie."""
    kept = selection_scores.topk(budget).indices
    context = oracle.shape[0]
    return {
        "oracle_mass_covered": float(oracle[kept].sum() / oracle.sum()),
        "share_in_last_512": float((kept >= context - 512).float().mean()),
    }


@torch.no_grad()
def probe(model, tokenizer, offset: int, context: int, continuation: int, budget: float) -> dict:
    ids = load_tokens(tokenizer, "pydoc", max_tokens=offset + context + continuation)[:, offset:]
    prompt = ids[:, :context]
    cache = KVzipCache(model, budget=budget)
    model(input_ids=prompt, use_cache=True, **cache_kwargs(cache))
    scores = cache.score_context(model)
    layers = cache.scoring_layer_indices
    request = request_ids_for_model(tokenizer, model)  # (KVzipCache's own request, from the same tokenizer)
    request_ids = torch.tensor([request["first"] + request["suffix"]])
    repeat = model(input_ids=torch.cat([prompt, request_ids, prompt], 1), use_cache=False).logits
    start = context + request_ids.shape[1]
    accuracy = float((repeat[0, start:-1].argmax(-1) == prompt[0, 1:]).float().mean())
    attentions = model(input_ids=ids, use_cache=False, output_attentions=True).attentions
    kept = max(1, round(budget * context))
    per_layer = {}
    for layer, kvzip in zip(layers, scores):
        attention = attentions[layer][0]  # [heads, queries, keys]
        oracle = attention[:, context:, :context].sum(dim=(0, 1))
        received = attention[:, :context, :context].sum(dim=(0, 1))
        selections = {
            "kvzip": kvzip[0].amax(0),
            "h2o": received / torch.arange(context, 0, -1),  # average over the queries that could attend
            "snapkv": attention[:, context - SNAPKV_WINDOW : context, :context].sum(dim=(0, 1)),
            "oracle-max": attention[:, context:, :context].amax(dim=(0, 1)),
        }
        per_layer[str(layer)] = {name: covered(s, oracle, kept) for name, s in selections.items()}
        per_layer[str(layer)]["oracle_share_in_last_512"] = float(oracle[-512:].sum() / oracle.sum())
    return {"offset": offset, "reconstruction_top1": accuracy, "layers": per_layer}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3")
    parser.add_argument("--offsets", type=int, nargs="+", default=[20000, 60000])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "eval/results/kvzip_hybrid"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=torch.float32)
    model.config._attn_implementation = "eager"  # (the attention weights)
    runs = [probe(model, tokenizer, o, args.context, args.continuation, args.budget) for o in args.offsets]
    result = {"settings": vars(args) | {"out": Path(args.out).name}, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for run in runs:
        print(f"offset {run['offset']}: reconstruction top-1 {run['reconstruction_top1']:.3f}")
        for layer, rows in run["layers"].items():
            cells = ", ".join(f"{k} {v['oracle_mass_covered']:.2f}" for k, v in rows.items() if isinstance(v, dict))
            print(f"  layer {layer}: oracle mass covered: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
