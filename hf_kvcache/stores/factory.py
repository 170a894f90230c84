"""A codec from its spec: the factory above the codec classes (quantization: the base types; fp8, integer: the
codecs), so the base module never imports the codecs built on it."""

from __future__ import annotations

from .fp8 import FP8Codec
from .integer import IntegerCodec
from .quantization import Codec, FullCodec, QuantSpec


def make_codec(spec: QuantSpec) -> Codec:
    if spec.format == "none":
        return FullCodec(spec)
    if spec.is_fp8:
        return FP8Codec(spec)
    return IntegerCodec(spec)
