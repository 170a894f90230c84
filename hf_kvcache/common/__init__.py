"""Shared foundations of the per-layer core: what a model's architecture means for its cache (layer types, latent
attention, head sizes), RoPE re-rotation and key rotations, config validation helpers, the static sizes torch.compile
may specialise on, and tensor-parallel facts. Written once, used by policies, stores, layers and caches.

May import: hf_kvcache.integration (and torch / transformers' public API). Nothing else of hf_kvcache.
"""
