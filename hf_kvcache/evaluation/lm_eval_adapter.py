"""lm-evaluation-harness adapter: the model `hf-kvcache`, lm-eval's `HFLM` with every request run through a chosen
(compressed) cache.

    hf-kvcache lm-eval --model_args pretrained=smollm2 cache=sink 'cache_config={"sinks": 4, "budget": 256}' \\
        --tasks kvcache_passkey --limit 20
    # or from Python: lm_eval.simple_evaluate(model="hf-kvcache", model_args={...}, tasks=[...])

(`hf-kvcache lm-eval` runs lm-eval's own command line with this module imported and the local tasks of
`hf_kvcache/evaluation/tasks/` on the include path; lm-eval 0.4 has no plugin entry point for models.)

How a request runs (batch size 1, per request):
- log-likelihood (context, continuation): the context except its last `decode_tail` tokens is prefilled into a
  fresh cache (one forward, or chunks of `prefill_chunk`), which compresses it; the last context tokens and then the
  continuation are fed one token per forward (chunks of `cont_chunk` if set), so every scored token is predicted
  through the compressed cache, as in decoding. Requests sharing a context reuse its prefilled cache (deep copies).
  With the full cache ("dynamic") the log-likelihoods equal lm-eval's `hf` model's (tested).
- generation: the context except its last `decode_tail` tokens is prefilled, then `model.generate` continues from
  the cache (the remaining context tokens in one forward, then greedy or sampled decoding).
- rolling log-likelihood (perplexity tasks): lm-eval's windows, each scored as above: the StreamingLLM protocol.

Why `decode_tail`: a prefill attends to the whole context before anything is evicted, so a token predicted by the
prefill forward itself never sees the compression. With `decode_tail >= 1` the first continuation token is
predicted through the compressed cache too.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils_hf import stop_sequences_criteria
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "The lm-eval adapter needs lm-evaluation-harness: pip install 'hf-kvcache[eval]' (or pip install lm_eval)."
    ) from err

from tqdm.auto import tqdm

from ..integration.cache_argument import cache_kwargs
from .cache_spec import check_cache, make_cache

TASKS_DIR = Path(__file__).with_name("tasks")

__all__ = ["HFKVCacheLM", "TASKS_DIR"]


def _parse_config(cache_config: Any) -> dict:
    if cache_config is None or cache_config == "":
        return {}
    if isinstance(cache_config, dict):
        return dict(cache_config)
    if isinstance(cache_config, str):
        try:
            value = json.loads(cache_config)
        except json.JSONDecodeError as not_json:
            # "sinks:4;budget:256" (commas separate lm-eval's own model_args)
            value = {}
            for part in filter(None, cache_config.replace(";", " ").split()):
                if ":" not in part:
                    raise ValueError(
                        f"`cache_config` must be JSON or 'key:value;key:value', got {cache_config!r}."
                    ) from not_json
                k, v = part.split(":", 1)
                value[k] = json.loads(v) if v.replace(".", "", 1).lstrip("-").isdigit() else v
        if not isinstance(value, dict):
            raise ValueError(f"`cache_config` must be a JSON object, got {cache_config!r}.")
        return value
    raise ValueError(f"`cache_config` must be a dict or a JSON string, got {type(cache_config).__name__}.")


@register_model("hf-kvcache")
class HFKVCacheLM(HFLM):
    """`HFLM` whose requests run through a cache built by `hf_kvcache.evaluation.cache_spec.make_cache`.

    Extra arguments: `cache` (a cache name, default "dynamic"), `cache_config` (dict, JSON string, or
    "key:value;key:value"; budget fractions resolve against each request's context length), `prefill_chunk`,
    `decode_tail` (default 1), `cont_chunk` (default 1). `pretrained="smollm2"` loads the offline model."""

    def __init__(
        self,
        pretrained="smollm2",
        cache: str = "dynamic",
        cache_config: Any = None,
        prefill_chunk: int | None = None,
        decode_tail: int = 1,
        cont_chunk: int = 1,
        **kwargs,
    ):
        self.cache_name = cache
        self.cache_config = _parse_config(cache_config)
        check_cache(cache, self.cache_config, context_len=1024, where="cache_config")  # before loading anything
        if decode_tail < 1 or cont_chunk < 1 or (prefill_chunk is not None and prefill_chunk < 1):
            raise ValueError("`decode_tail` and `cont_chunk` must be >= 1 and `prefill_chunk` None or >= 1.")
        self.prefill_chunk, self.decode_tail, self.cont_chunk = prefill_chunk, decode_tail, cont_chunk
        if isinstance(pretrained, str):
            from ..sharing.models import offline_path

            pretrained = offline_path(pretrained)  # ("smollm2", "gemma3": the offline models)
        if kwargs.get("device") is None or (kwargs.get("device") == "cuda" and not torch.cuda.is_available()):
            kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        if kwargs.get("batch_size", 1) not in (1, "1"):
            raise ValueError("hf-kvcache runs one request at a time (batch_size=1): each request has its own cache.")
        kwargs["batch_size"] = 1
        super().__init__(pretrained=pretrained, **kwargs)
        if self.backend != "causal":
            raise ValueError("hf-kvcache supports decoder-only (causal) models.")

    # -- the cache ---------------------------------------------------------------------------------------------------
    def new_cache(self, context_len: int, total_len: int):
        return make_cache(self.model, self.cache_name, self.cache_config, context_len=context_len, total_len=total_len)

    def _forward(self, ids: list[int] | torch.Tensor, cache, keep: int = 1) -> torch.Tensor:
        x = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(1, -1)
        with torch.no_grad():
            return self.model(input_ids=x, **cache_kwargs(cache), use_cache=True, logits_to_keep=keep).logits[0]

    def _prefill(self, ids: list[int], cache) -> None:
        step = len(ids) if not self.prefill_chunk else self.prefill_chunk
        for start in range(0, len(ids), step):
            self._forward(ids[start : start + step], cache)

    def _feed(self, ids: list[int], cache) -> torch.Tensor:
        """Feed `ids` `cont_chunk` at a time; log-probs [len(ids), V] of the token after each."""
        rows = []
        for start in range(0, len(ids), self.cont_chunk):
            part = ids[start : start + self.cont_chunk]
            logits = self._forward(part, cache, keep=len(part))
            rows.append(F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype))
        return torch.cat(rows)

    # -- log-likelihood ------------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """Same inputs and outputs as `HFLM._loglikelihood_tokens`: [(sum of log-probs, is greedy)] per request."""
        prepared = []
        for i, (request_str, context_enc, continuation_enc) in enumerate(requests):
            assert len(context_enc) > 0 and len(continuation_enc) > 0
            # left-truncate as HFLM does: the model sees (context + continuation)[-(max_length + 1):][:-1]
            whole = (context_enc + continuation_enc)[-(self.max_length + 1) :]
            ctx = tuple(whole[: len(whole) - len(continuation_enc)])
            prepared.append((ctx, tuple(continuation_enc), request_str, i))
        groups: dict[tuple, list] = {}
        for item in sorted(prepared, key=lambda r: (-len(r[0]), r[0])):
            groups.setdefault(item[0], []).append(item)
        results: list = [None] * len(requests)
        bar = tqdm(
            total=len(requests), disable=disable_tqdm or self.rank != 0, desc=f"loglikelihood through {self.cache_name}"
        )
        for ctx, items in groups.items():
            longest = max(len(c) for _, c, _, _ in items)
            cache = self.new_cache(context_len=len(ctx), total_len=len(ctx) + longest)
            tail = min(self.decode_tail, len(ctx))
            self._prefill(list(ctx[: len(ctx) - tail]), cache)
            first = None
            for t in ctx[len(ctx) - tail :]:
                first = self._feed([t], cache)[-1]
            for j, (_, cont, request_str, index) in enumerate(items):
                rows = [first]
                if len(cont) > 1:
                    c = cache if j == len(items) - 1 else copy.deepcopy(cache)
                    rows.append(self._feed(list(cont[:-1]), c))
                    logp = torch.cat([first[None], rows[1]])
                else:
                    logp = first[None]
                target = torch.tensor(cont, device=logp.device)
                ll = float(logp.gather(-1, target[:, None]).sum())
                greedy = bool((logp.argmax(-1) == target).all())
                results[index] = (ll, greedy)
                if request_str is not None:
                    self.cache_hook.add_partial("loglikelihood", request_str, (ll, greedy))
                bar.update(1)
        bar.close()
        return results

    # -- generation ----------------------------------------------------------------------------------------------------
    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        """Per row: prefill the context (minus `decode_tail` tokens) into a fresh cache, then `generate` from it.
        Returns [batch, context width + new tokens] like HFLM (the context part as given, left padding kept)."""
        generation_kwargs["temperature"] = generation_kwargs.get("temperature", 0.0)
        do_sample = generation_kwargs.get("do_sample")
        if generation_kwargs.get("temperature") == 0.0 and do_sample is None:
            generation_kwargs["do_sample"] = do_sample = False
        if do_sample is False and generation_kwargs.get("temperature") == 0.0:
            generation_kwargs.pop("temperature", None)
        mask = generation_kwargs.pop("attention_mask", None)
        width = context.shape[1]
        max_new = max_length - width
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        outputs = []
        for b in range(context.shape[0]):
            row = context[b] if mask is None else context[b][mask[b].bool()]
            row = row[None]
            cache = self.new_cache(context_len=row.shape[1], total_len=row.shape[1] + max_new)
            tail = min(self.decode_tail, row.shape[1])
            with torch.no_grad():
                self._prefill(row[0, : row.shape[1] - tail].tolist(), cache)
                out = self.model.generate(
                    input_ids=row,
                    attention_mask=torch.ones_like(row),
                    **cache_kwargs(cache),
                    max_new_tokens=max_new,
                    pad_token_id=pad,
                    use_cache=True,
                    stopping_criteria=stop_sequences_criteria(self.tokenizer, stop, row.shape[1], 1),
                    **generation_kwargs,
                )
            outputs.append(out[0, row.shape[1] :])
        longest = max(o.shape[0] for o in outputs)
        new = torch.full((len(outputs), longest), pad, dtype=context.dtype, device=context.device)
        for b, o in enumerate(outputs):
            new[b, : o.shape[0]] = o
        return torch.cat([context, new], dim=1)

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info.update(
            kvcache=self.cache_name,
            kvcache_config=self.cache_config,
            decode_tail=self.decode_tail,
            prefill_chunk=self.prefill_chunk,
            cont_chunk=self.cont_chunk,
        )
        return info
