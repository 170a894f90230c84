"""How far quantized pages move the model in `hf-kvcache serve-bench`: KL and top-1 agreement of the recorded
log-probs against the model-dtype reference run, and our QuantizedFP8Cache scored on the same text.

`agreement_metrics`: for quantized formats, KL(model-dtype pages || quantized pages) and top-1 agreement over all
generated positions of every request (the runs are teacher-forced to the reference tokens, so they compare the same
positions; model-dtype runs at the other budgets batch the requests differently: their KL against the reference run
is the noise floor of batching in the model's dtype), and KL / top-1 over the first `same_text` requests.

`quantized_cache_kl`: on the same text (the first `kl_requests` requests, prompt + reference tokens), our
QuantizedFP8Cache (token scales, no rotation, and its default Hadamard key rotation) is scored against DynamicCache
and the model-dtype paged run with the teacher-forced protocol of hf_kvcache.evaluation.divergence, for comparison.

Log-probs are {request id ("req_N"): [generated tokens, vocab] tensor} (hf_kvcache.evaluation.agreement); requests are
taken in the order of N.
"""

from __future__ import annotations

import torch


def _request_order(request_ids) -> list[str]:
    return sorted(request_ids, key=lambda r: int(r.split("_")[-1]))


def agreement_metrics(reference: dict[str, torch.Tensor], test: dict[str, torch.Tensor], same_text: int) -> dict:
    """KL / top-1 over all requests, and KL over the first `same_text` requests (the text QuantizedFP8Cache is
    scored on)."""
    from .divergence import divergence_metrics

    ids = _request_order(reference)
    ref = torch.cat([reference[rid] for rid in ids])
    got = torch.cat([test[rid] for rid in ids])
    metrics = divergence_metrics(ref, got)
    out = {
        "kl_mean": metrics["kl_mean"],
        "kl_p99": metrics["kl_p99"],
        "top1_agreement": metrics["top1_agreement"],
        "positions": metrics["positions"],
    }
    if same_text:
        subset = divergence_metrics(
            torch.cat([reference[r] for r in ids[:same_text]]), torch.cat([test[r] for r in ids[:same_text]])
        )
        out["kl_mean_same_text"] = subset["kl_mean"]
        out["top1_same_text"] = subset["top1_agreement"]
    return out


def quantized_cache_kl(
    model, prompts, tokens: dict[str, list[int]], count: int, paged_reference: dict[str, torch.Tensor]
) -> dict:
    """Our QuantizedFP8Cache on the same text: teacher-forced on prompt + reference tokens of the first `count`
    requests (hf_kvcache.evaluation.divergence), token scales without rotation (the paged quantizer) and the
    cache's default (Hadamard key rotation). Each is scored against DynamicCache (same protocol, one request at a
    time) and against the model-dtype paged run (the reference of the paged formats: same positions, and the same
    batching noise); DynamicCache against the paged run gives that noise alone."""
    from transformers import DynamicCache

    from ..caches.quantized import QuantizedFP8Cache
    from .divergence import cache_logprobs, divergence_metrics

    factories = {
        "QuantizedFP8Cache(key_rotation='none')": lambda: QuantizedFP8Cache(
            model, key_rotation="none", attention="dequantize"
        ),
        "QuantizedFP8Cache() [hadamard]": lambda: QuantizedFP8Cache(model, attention="dequantize"),
    }
    dynamic, paged, tests = [], [], {name: [] for name in factories}
    for i, rid in enumerate(_request_order(tokens)[:count]):
        generated = tokens[rid]
        ids = torch.tensor(prompts[i] + generated)
        prompt_len = len(prompts[i])
        rows = len(generated)  # row g predicts generated token g, as in the paged runs
        dynamic.append(cache_logprobs(model, ids, DynamicCache(config=model.config), prompt_len)[:rows])
        paged.append(paged_reference[rid][:rows])
        for name, factory in factories.items():
            tests[name].append(cache_logprobs(model, ids, factory(), prompt_len)[:rows])
    dynamic, paged = torch.cat(dynamic), torch.cat(paged)

    def metrics(ref, got):
        m = divergence_metrics(ref, got)
        return {k: m[k] for k in ("kl_mean", "kl_p99", "top1_agreement", "positions")}

    out = {"DynamicCache vs model-dtype pages (batching noise)": metrics(paged, dynamic)}
    for name, rows in tests.items():
        got = torch.cat(rows)
        out[f"{name} vs DynamicCache"] = metrics(dynamic, got)
        out[f"{name} vs model-dtype pages"] = metrics(paged, got)
    return out
