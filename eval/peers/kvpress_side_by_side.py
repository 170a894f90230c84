"""NVIDIA kvpress's presses on our protocol, for the side-by-side in docs/results.md (issue 26).

Runs in kvpress's own virtual environment (eval/peers/setup_kvpress.sh: kvpress 0.5.5 pins transformers<5.3), so it
imports nothing of hf_kvcache. The protocol is our sweep's (eval/specs/scorers_decode.yaml, prompt mode):
- tokens: Python's `pydoc_data.topics` joined as hf_kvcache.sharing.corpus.pydoc_text does, tokenized without
  special tokens, tokens [offset, offset + prompt + scored) (defaults 20000, 2048, 256);
- the prompt is prefilled once inside the press (kvpress compresses at the end of the prefill), then the `scored`
  tokens are fed one per forward, teacher-forced, outside the press (nothing more is compressed: our prompt mode);
- the reference is the same with no press; per scored position KL(p_ref || p_press) in float64, top-1 agreement,
  the log-probs of position i predicting token prompt + i, as hf_kvcache.evaluation.divergence computes them.
Budgets are our "kept" fractions: kvpress's compression_ratio = 1 - budget (kvpress keeps int(n x budget) tokens per
head, we keep round(n x budget): 409 vs 410 at 20% of 2048).

    eval/peers/run_kvpress.sh                       # set-up, model, this script, the joined table
    .venv-kvpress/bin/python eval/peers/kvpress_side_by_side.py --model DIR --out eval/results/peers_kvpress
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch


def pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def presses(budget: float) -> dict:
    from kvpress import (
        AdaKVPress,
        ExpectedAttentionPress,
        KeyDiffPress,
        KnormPress,
        KVzipPress,
        ObservedAttentionPress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
    )

    ratio = 1.0 - budget
    return {
        "ExpectedAttentionPress": ExpectedAttentionPress(compression_ratio=ratio),
        "SnapKVPress": SnapKVPress(compression_ratio=ratio),
        "TOVAPress": TOVAPress(compression_ratio=ratio),
        "KnormPress": KnormPress(compression_ratio=ratio),
        "KeyDiffPress": KeyDiffPress(compression_ratio=ratio),
        "StreamingLLMPress": StreamingLLMPress(compression_ratio=ratio, n_sink=4),
        "ObservedAttentionPress": ObservedAttentionPress(compression_ratio=ratio),  # H2O's scores (eager attention)
        "AdaKV(ExpectedAttentionPress)": AdaKVPress(ExpectedAttentionPress(compression_ratio=ratio)),
        "AdaKV(SnapKVPress)": AdaKVPress(SnapKVPress(compression_ratio=ratio)),
        "KVzipPress": KVzipPress(compression_ratio=ratio),
    }


@torch.inference_mode()
def scored_logprobs(model, ids: torch.Tensor, prompt: int, press=None) -> torch.Tensor:
    """[scored, V] float32 log-probs: row i predicts token prompt + i (last prompt position, then each fed token)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if press is None:
        out = model(input_ids=ids[:, :prompt], past_key_values=cache, logits_to_keep=1)
    else:
        with press(model):
            out = model(input_ids=ids[:, :prompt], past_key_values=cache, logits_to_keep=1)
    rows = [torch.log_softmax(out.logits[0, -1].float(), -1)]
    for t in range(prompt, ids.shape[1] - 1):
        # positions given: after a press the cache holds fewer tokens than were seen (kvpress's pipeline does so too)
        position = torch.tensor([[t]])
        out = model(
            input_ids=ids[:, t : t + 1], past_key_values=cache, position_ids=position, cache_position=position[0]
        )
        rows.append(torch.log_softmax(out.logits[0, -1].float(), -1))
    return torch.stack(rows), cache


def metrics(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict:
    ref64, got64 = ref.double(), got.double()
    kl = (ref64.exp() * (ref64 - got64)).sum(-1)
    return {
        "kl_mean": kl.mean().item(),
        "kl_p99": torch.quantile(kl, 0.99).item(),
        "kl_max": kl.max().item(),
        "top1_agreement": (ref.argmax(-1) == got.argmax(-1)).double().mean().item(),
        "nll": -got.gather(-1, targets[:, None]).double().mean().item(),
        "nll_ref": -ref.gather(-1, targets[:, None]).double().mean().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="SmolLM2 converted to safetensors (hf_kvcache's cache dir)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.2, 0.1, 0.5])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--scored", type=int, default=256)
    parser.add_argument("--offset", type=int, default=20000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="press names to run (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(pydoc_text(), return_tensors="pt", add_special_tokens=False).input_ids
    ids = ids[:, args.offset : args.offset + args.prompt + args.scored].long()
    targets = ids[0, args.prompt :]
    models = {
        impl: AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=impl)
        for impl in ("sdpa", "eager")
    }  # ObservedAttentionPress needs the attention weights (eager)
    args.out.mkdir(parents=True, exist_ok=True)
    records_path = args.out / "results.jsonl"
    done = set()
    if records_path.exists():
        done = {(r["label"], r["budget"]) for r in map(json.loads, records_path.read_text().splitlines())}
    reference, _ = scored_logprobs(models["sdpa"], ids, args.prompt)
    for budget in args.budgets:
        for name, press in presses(budget).items():
            if (args.only and name not in args.only) or (name, budget) in done:
                continue
            model = models["eager" if name == "ObservedAttentionPress" else "sdpa"]
            start = time.perf_counter()
            got, cache = scored_logprobs(model, ids, args.prompt, press)
            seconds = time.perf_counter() - start
            record = {
                "label": name,
                "budget": budget,
                "context_len": args.prompt,
                "scored_tokens": args.scored,
                **metrics(reference, got, targets),
                "seconds": round(seconds, 1),
                # what layer 0 holds of the prompt (AdaKV presses mask dropped keys: they hold all of it)
                "prompt_tokens_held_layer0": int(cache.layers[0].keys.shape[-2]) - (args.scored - 1),
            }
            with records_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(
                f"{name:32s} {budget:4.0%}  KL {record['kl_mean']:.4f}  top-1 {record['top1_agreement']:.3f}  "
                f"({seconds:.0f} s)",
                flush=True,
            )
    environment = {
        "kvpress": "0.5.5",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": args.threads,
        "kvpress_path": os.path.dirname(kvpress.__file__),
        "protocol": vars(args) | {"out": str(args.out)},
    }
    (args.out / "environment.json").write_text(json.dumps(environment, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
