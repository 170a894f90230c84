"""What ranks tokens: one `Scorer` dataclass per method (one module each, the contract in base.py), by name in
registry.py. Scorers say what a token is worth; the policies that host them (heavy hitters, the composite's heavy
region) decide what is kept. `kvzap_surrogate`: KVzap's trained per-layer predictors of KVzip scores and their files.
May import: hf_kvcache.common (RoPE, validation, static sizes), hf_kvcache.integration and torch (kvzap_surrogate
also safetensors and huggingface_hub), never the policies, layers or caches that use them.
"""

from .base import Scorer
from .registry import HEAVY_SCORERS, SCORERS, make_scorer

__all__ = ["HEAVY_SCORERS", "SCORERS", "Scorer", "make_scorer"]
