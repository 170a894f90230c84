"""Training KVzap's surrogate (kvpress, arXiv 2601.07891): per layer, a predictor of the log KVzip score of each KV
head from the attention input hidden states, fitted on context windows of a corpus.

For each window: prefill it into a `KVzipCache` while `capture_attention_inputs` records every layer's attention
inputs, run `KVzipCache.score_context` (KVzip's reconstruction forwards) for the targets, and pair each context
token's hidden state [d] with its scores [Hkv]. Targets are `log(max(score, floor))`: KVzip scores are attention
probabilities, spread over orders of magnitude, and what matters is their ranking; the floor (`DEFAULT_FLOOR`) keeps
the odd score that underflows to 0 from dominating a least-squares fit. The first `sinks` tokens (always kept by
KVzip's placement, and scored far above the rest) are left out of training and evaluation; windows are single rows,
so there is no padding.

Fits: "linear" by closed-form ridge regression on the centred normal equations, accumulated in float64 over the
windows so memory stays at O(d^2) per layer; "mlp" (d -> width -> Hkv, SiLU) with Adam on standardised inputs and
targets (the standardisation is folded into the weights afterwards). The windows are split by window into training
and held-out ones; the report gives, per layer and averaged over layers, on the held-out windows: R^2 of the
log-scores, Pearson and Spearman correlation per window and head, and the top-20% overlap (the share of KVzip's top
20% tokens per head that the surrogate's top 20% also picks: what a 20% budget would keep in common).

The evaluation positions of the KVzip benchmarks (pydoc tokens from 20000, 2048 + 256 tokens: eval/specs/kvzip.yaml)
are never trained on by default (`skip_tokens`).
"""

from __future__ import annotations

import math
import random
import time

import torch

from ..caches.kvzip import KVzipCache
from ..common.validation import require_choice, require_int
from ..integration.attention_inputs import capture_attention_inputs
from ..integration.cache_argument import cache_kwargs
from ..scorers.kvzap_surrogate import KINDS, Surrogate
from ..sharing.corpus import OFFLINE_CORPUS, load_tokens

DEFAULT_FLOOR = 1e-6  # scores below are clamped before the log
DEFAULT_SKIP = (20000, 22400)  # the KVzip benchmarks' pydoc tokens (eval/specs/kvzip.yaml), never trained on
TOP_SHARE = 0.2


class LinearFit:
    """Ridge regression of targets [n, k] on features [n, d] from accumulated centred normal equations (float64)."""

    def __init__(self, features: int, targets: int, device=None):
        kw = {"dtype": torch.float64, "device": device}
        self.n = 0
        self.sx, self.sy = torch.zeros(features, **kw), torch.zeros(targets, **kw)
        self.xx, self.xy = torch.zeros(features, features, **kw), torch.zeros(features, targets, **kw)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.to(torch.float64), y.to(torch.float64)
        self.n += x.shape[0]
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.xx += x.T @ x
        self.xy += x.T @ y

    def solve(self, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight [k, d], bias [k]) float32; `ridge` is relative to the mean feature variance (scale-free)."""
        mx, my = self.sx / self.n, self.sy / self.n
        cxx = self.xx / self.n - torch.outer(mx, mx)
        cxy = self.xy / self.n - torch.outer(mx, my)
        lam = ridge * cxx.diagonal().mean().clamp_min(1e-12)
        eye = torch.eye(cxx.shape[0], dtype=cxx.dtype, device=cxx.device)
        weight = torch.linalg.solve(cxx + lam * eye, cxy)  # [d, k]
        bias = my - mx @ weight
        return weight.T.float().contiguous(), bias.float()


def fit_mlp(x: torch.Tensor, y: torch.Tensor, width: int, epochs: int, lr: float, seed: int) -> dict:
    """An MLP d -> width -> k (SiLU) fitted to `y` [n, k] from `x` [n, d] by Adam on standardised data; the parts of
    a "mlp" surrogate layer, the standardisation folded in."""
    generator = torch.Generator().manual_seed(seed)
    mx, sx = x.mean(0), x.std(0).clamp_min(1e-6)
    my, sy = y.mean(0), y.std(0).clamp_min(1e-6)
    xs, ys = (x - mx) / sx, (y - my) / sy
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], width), torch.nn.SiLU(), torch.nn.Linear(width, y.shape[1]))
    net.to(x.device)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=1e-4)
    batch = 512
    steps = epochs * math.ceil(x.shape[0] / batch)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(x.shape[0], generator=generator).to(x.device)
            for start in range(0, x.shape[0], batch):
                index = order[start : start + batch]
                loss = torch.nn.functional.mse_loss(net(xs[index]), ys[index])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
    fc1, fc2 = net[0], net[2]
    with torch.no_grad():
        w1 = fc1.weight / sx
        return {
            "fc1.weight": w1,
            "fc1.bias": fc1.bias - w1 @ mx,
            "fc2.weight": fc2.weight * sy[:, None],
            "fc2.bias": fc2.bias * sy + my,
        }


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort(0).argsort(0).to(torch.float64)


def _pearson(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a - a.mean(0), b - b.mean(0)
    return (a * b).sum(0) / (a.norm(dim=0) * b.norm(dim=0)).clamp_min(1e-12)


class FitMetrics:
    """Held-out metrics of one layer, accumulated window by window (see the module docstring)."""

    def __init__(self):
        self.sse = self.sy = self.syy = self.n = 0.0
        self.pearson, self.spearman, self.overlap = [], [], []
        self.sse_h = self.sy_h = self.syy_h = None

    def add(self, predicted: torch.Tensor, true: torch.Tensor) -> None:
        """`predicted`, `true`: [n, Hkv] log-scores of one window."""
        p, t = predicted.to(torch.float64).cpu(), true.to(torch.float64).cpu()
        sse, sy, syy = ((p - t) ** 2).sum(0), t.sum(0), (t * t).sum(0)
        if self.sse_h is None:
            self.sse_h, self.sy_h, self.syy_h = sse, sy, syy
        else:
            self.sse_h, self.sy_h, self.syy_h = self.sse_h + sse, self.sy_h + sy, self.syy_h + syy
        self.n += t.shape[0]
        self.pearson += _pearson(p, t).tolist()
        self.spearman += _pearson(_ranks(p), _ranks(t)).tolist()
        k = max(1, math.ceil(TOP_SHARE * t.shape[0]))
        top_p, top_t = p.topk(k, 0).indices, t.topk(k, 0).indices
        for h in range(t.shape[1]):
            common = torch.isin(top_p[:, h], top_t[:, h]).sum().item()
            self.overlap.append(common / k)

    def result(self) -> dict:
        sst = self.syy_h - self.sy_h**2 / self.n
        r2 = 1 - self.sse_h / sst.clamp_min(1e-12)  # per head, over the held-out tokens
        return {
            "r2": float(r2.mean()),
            "pearson": sum(self.pearson) / len(self.pearson),
            "spearman": sum(self.spearman) / len(self.spearman),
            "top20_overlap": sum(self.overlap) / len(self.overlap),
        }


def summarize(per_layer: dict[int, dict]) -> dict:
    """Overall figures: each metric's mean over the layers, and its lowest and highest layer value."""
    metrics = next(iter(per_layer.values())).keys()
    overall = {}
    for name in metrics:
        values = [row[name] for row in per_layer.values()]
        overall[name] = sum(values) / len(values)
        overall[f"{name}_range"] = [min(values), max(values)]
    return overall


def context_windows(total: int, length: int, skip: tuple[int, int] | None) -> list[int]:
    """Starts of the consecutive windows of `length` tokens in `total` tokens that do not touch `skip` [a, b)."""
    starts = range(0, total - length + 1, length)
    return [s for s in starts if skip is None or s + length <= skip[0] or s >= skip[1]]


def _check(contexts, context_len, kind, held_out, skip_tokens, floor, sinks) -> None:
    require_int("contexts", contexts, 2)
    require_int("context_len", context_len, 2)
    require_choice("kind", kind, KINDS)
    if isinstance(held_out, bool) or not isinstance(held_out, (int, float)) or not 0 < held_out < 1:
        raise ValueError(f"`held_out` must be a fraction in (0, 1) of the windows, got {held_out!r}.")
    if skip_tokens is not None and (len(skip_tokens) != 2 or not 0 <= skip_tokens[0] <= skip_tokens[1]):
        raise ValueError(f"`skip_tokens` must be None or (start, end) with 0 <= start <= end, got {skip_tokens!r}.")
    if not isinstance(floor, (int, float)) or not floor > 0:
        raise ValueError(f"`floor` must be a positive number, got {floor!r}.")
    require_int("sinks", sinks, 0)
    if sinks >= context_len - 1:
        raise ValueError(f"`context_len` ({context_len}) must leave tokens after the {sinks} sinks.")


def window_data(model, window: torch.Tensor, sinks: int, floor: float, **kvzip) -> dict[int, tuple]:
    """{layer index: (hidden [n - sinks, d] float32, log-scores [n - sinks, Hkv] float32)} of one window [1, n]."""
    captured: dict[int, torch.Tensor] = {}
    cache = KVzipCache(model, budget=1.0, sinks=sinks, **kvzip)
    with torch.no_grad():
        with capture_attention_inputs(model, lambda index, hidden: captured.__setitem__(index, hidden.detach())):
            model(input_ids=window, use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
        scores = cache.score_context(model)
    out = {}
    for index, score in zip(cache.scoring_layer_indices, scores):
        hidden = captured[index][0, sinks:].to(torch.float32)
        out[index] = (hidden, score[0, :, sinks:].clamp_min(floor).log().T.contiguous())
    return out


def train_kvzap(
    model,
    tokenizer,
    out_dir,
    *,
    source: str = OFFLINE_CORPUS,
    ids: torch.Tensor | None = None,
    contexts: int = 10,
    context_len: int = 2048,
    kind: str = "linear",
    held_out: float = 0.2,
    skip_tokens: tuple[int, int] | None = DEFAULT_SKIP,
    seed: int = 0,
    floor: float = DEFAULT_FLOOR,
    sinks: int = 4,
    ridge: float = 1e-3,
    width: int = 64,
    epochs: int = 20,
    lr: float = 1e-3,
    request_ids: dict | None = None,
    model_name: str | None = None,
    text_kwargs: dict | None = None,
    progress: bool = True,
) -> dict:
    """Fit a KVzap surrogate of `kind` for `model` on `contexts` windows of `context_len` tokens of `source` (a text
    source of `load_tokens`, with `text_kwargs`; or the token ids `ids` [1, n] themselves), `held_out` of them kept
    for evaluation; save it to `out_dir` (config.json then holds this report) and return the report: the model, the
    training settings and the fit (per layer and overall, on the held-out windows). `request_ids` / `tokenizer`
    build KVzip's reconstruction request (hf_kvcache.caches.kvzip)."""
    _check(contexts, context_len, kind, held_out, skip_tokens, floor, sinks)
    started, given_ids = time.perf_counter(), ids is not None
    if ids is None:
        ids = load_tokens(tokenizer, source, **(text_kwargs or {}))
    ids = ids.reshape(1, -1).to(model.device)
    starts = context_windows(ids.shape[1], context_len, None if skip_tokens is None else tuple(skip_tokens))
    if len(starts) < contexts:
        raise ValueError(
            f"`contexts`: {contexts} windows of {context_len} tokens asked for, but the text has {ids.shape[1]} "
            f"tokens: {len(starts)} windows outside `skip_tokens` {skip_tokens}."
        )
    random.Random(seed).shuffle(starts)
    held = max(1, round(held_out * contexts))
    train_starts, held_starts = sorted(starts[: contexts - held]), sorted(starts[contexts - held : contexts])
    kvzip = {"tokenizer": tokenizer, "request_ids": request_ids, "chunk_size": context_len}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=contexts, desc="KVzip scores of windows", unit="window")
    fits, stored, layers = {}, {}, None
    for start in train_starts:
        data = window_data(model, ids[:, start : start + context_len], sinks, floor, **kvzip)
        layers = sorted(data)
        for index, (hidden, target) in data.items():
            if kind == "linear":
                fits.setdefault(index, LinearFit(hidden.shape[1], target.shape[1], hidden.device)).add(hidden, target)
            else:
                stored.setdefault(index, []).append((hidden, target))
        if bar is not None:
            bar.update()
    weights = {}
    for index in layers:
        if kind == "linear":
            weight, bias = fits[index].solve(ridge)
            weights[index] = {"weight": weight, "bias": bias}
        else:
            x = torch.cat([h for h, _ in stored[index]])
            y = torch.cat([t for _, t in stored[index]])
            weights[index] = fit_mlp(x, y, width, epochs, lr, seed + index)
    stored.clear()
    surrogate = Surrogate(kind, weights)
    metrics = {index: FitMetrics() for index in layers}
    for start in held_starts:
        data = window_data(model, ids[:, start : start + context_len], sinks, floor, **kvzip)
        for index, (hidden, target) in data.items():
            metrics[index].add(surrogate.predict(index, hidden[None])[0].T, target)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    per_layer = {str(index): m.result() for index, m in metrics.items()}
    report = {
        "model": model_name or getattr(model.config, "name_or_path", None) or type(model).__name__,
        "num_layers": model.config.get_text_config().num_hidden_layers,
        "training": {
            "source": "ids" if given_ids else source,
            "context_len": context_len,
            "contexts": contexts,
            "train_windows": train_starts,
            "held_out_windows": held_starts,
            "skip_tokens": None if skip_tokens is None else list(skip_tokens),
            "seed": seed,
            "target": f"log(max(KVzip score, {floor}))",
            "sinks_left_out": sinks,
            "chunk_size": context_len,
            **({"ridge": ridge} if kind == "linear" else {"width": width, "epochs": epochs, "lr": lr}),
            "seconds": round(time.perf_counter() - started, 1),
        },
        "fit": {"held_out": {"overall": summarize(per_layer), "per_layer": per_layer}},
    }
    surrogate.info = report
    surrogate.save(out_dir)
    return {**surrogate.config()}


__all__ = ["DEFAULT_FLOOR", "DEFAULT_SKIP", "FitMetrics", "LinearFit", "fit_mlp", "train_kvzap"]
