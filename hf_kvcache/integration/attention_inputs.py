"""The decoder's self-attention modules and their input hidden states.

KVzap (hf_kvcache.scorers.kvzap_surrogate) predicts a token's KVzip score from the hidden states a layer's attention
module receives, so training (hf_kvcache.evaluation.kvzap_training) and the runtime scorer both need those inputs.
transformers gives no public way to reach them; this module relies on its modeling convention (a contract): each
decoder layer's self-attention is a module named `self_attn` (or a class named `...Attention`) with an int
`layer_idx`, whose forward takes the (normalised) `hidden_states` [B, q, d] as its first argument.

    with capture_attention_inputs(model, lambda layer_idx, hidden: seen.append((layer_idx, hidden))):
        model(ids)
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .contracts import contract, parameters, require

ATTENTION_INPUTS = "decoder self-attention modules (self_attn, layer_idx, hidden_states)"


@contract(
    ATTENTION_INPUTS,
    "a decoder layer's self-attention is a module `self_attn` (class ...Attention) with an int `layer_idx`, whose "
    "forward takes `hidden_states` [B, q, d] first",
    "KVzap (the surrogate's training and its scorer read the attention inputs)",
)
def _check_attention_inputs() -> str | None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

    if parameters(LlamaAttention.forward)[1:2] != ["hidden_states"]:
        return f"LlamaAttention.forward takes {parameters(LlamaAttention.forward)}, not hidden_states first"
    config = LlamaConfig(hidden_size=8, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1)
    layer = LlamaDecoderLayer(config, 0)
    attention = getattr(layer, "self_attn", None)
    if not isinstance(attention, LlamaAttention) or getattr(attention, "layer_idx", None) != 0:
        return "LlamaDecoderLayer has no `self_attn` LlamaAttention with `layer_idx`"
    return None


def _is_self_attention(name: str, module: nn.Module) -> bool:
    cls = type(module).__name__
    if "Cross" in cls or name.rsplit(".", 1)[-1] in ("cross_attn", "encoder_attn"):
        return False
    return name.rsplit(".", 1)[-1] == "self_attn" or (cls.endswith("Attention") and hasattr(module, "layer_idx"))


def attention_modules(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, module) of each decoder self-attention module of `model`, in layer order: the index is the
    module's `layer_idx` where it has one, else its rank among the modules found. A module nested in another one
    found (an attention's inner attention) is not listed. Raises ValueError when `model` has none."""
    require(ATTENTION_INPUTS)
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not _is_self_attention(name, module):
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((name, module))
    if not found:
        raise ValueError(
            f"`model`: {type(model).__name__} has no decoder self-attention modules (`self_attn` / ...Attention with "
            "`layer_idx`) to read the attention inputs of."
        )
    indexed = []
    for rank, (_, module) in enumerate(found):
        index = getattr(module, "layer_idx", None)
        indexed.append((index if isinstance(index, int) and not isinstance(index, bool) else rank, module))
    return sorted(indexed, key=lambda item: item[0])


class AttentionInputCapture:
    """The hooks `capture_attention_inputs` registered; `.remove()` (or leaving the `with` block) removes them."""

    def __init__(self, handles: list):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __enter__(self) -> AttentionInputCapture:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def capture_attention_inputs(model: nn.Module, sink: Callable) -> AttentionInputCapture:
    """Call `sink(layer_idx, hidden_states)` with each self-attention module's input hidden states [B, q, d] (the
    tensor itself, not a copy: copy it if you keep it past the forward) before the module runs, for every forward
    until the returned handle's `.remove()`. A forward pre-hook per module, nothing else: cheap enough for decode."""
    if not callable(sink):
        raise ValueError(f"`sink` must be callable (layer_idx, hidden_states), got {type(sink).__name__}.")
    handles = []
    for index, module in attention_modules(model):

        def hook(_module, args, kwargs, index=index):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            sink(index, hidden)

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return AttentionInputCapture(handles)


__all__ = ["ATTENTION_INPUTS", "AttentionInputCapture", "attention_modules", "capture_attention_inputs"]
