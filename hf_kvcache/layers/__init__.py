"""The per-layer core: `CompressedLayer` (a transformers cache layer built from a policy and a store), what one
forward tells the layers (`ForwardInfo`), and the layer's side of attention from quantized codes.

May import: policies, stores, kernels, common, integration.
"""

from .forward_info import ForwardAnnounced, ForwardInfo
from .layer import CompressedLayer

__all__ = ["CompressedLayer", "ForwardAnnounced", "ForwardInfo"]
