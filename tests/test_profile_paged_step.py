"""eval/profile_paged_step.py: where a continuous-batching run's time goes, per page format (issue 49's profile).
A few requests on the offline model: every part is timed, the parts add up to the run, and the timers are removed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import profile_paged_step


@pytest.mark.slow
def test_parts_add_up_and_the_timers_are_removed():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_kvcache.paged import codes_attention
    from hf_kvcache.paged.allocators import ALLOCATORS, _QuantizedPagesMixin

    codes_attention.install()  # (the profile installs it: the attention function it times)
    before = (ALL_ATTENTION_FUNCTIONS["sdpa"], _QuantizedPagesMixin._read, [c.update for c in ALLOCATORS.values()])
    formats = ["model", "fp8_e4m3", "fp8_e4m3:dequantize"]
    result = profile_paged_step.profile(formats, requests=3, budget_tokens=256, threads=1, new_tokens=3)
    after = (ALL_ATTENTION_FUNCTIONS["sdpa"], _QuantizedPagesMixin._read, [c.update for c in ALLOCATORS.values()])
    assert after == before
    model, codes, fp8 = result["runs"]
    assert [run["format"] for run in result["runs"]] == formats
    for run in (model, codes, fp8):
        assert run["generated_tokens"] == 3 * 3
        top = {k: v for k, v in run["seconds"].items() if not k.startswith("of which")}
        assert set(top) == {"attention", "cache update", "rest"}
        assert sum(top.values()) == pytest.approx(run["wall_s"])
        assert run["seconds"]["attention"] > 0 and run["seconds"]["cache update"] > 0
        assert run["mean_mask_elements_per_forward"] >= run["mean_queries_per_forward"]
    assert "of which: gather + dequantize" not in model["seconds"]  # model-dtype pages: transformers' own read
    # attention from the codes: nothing gathered, the same keys read as the gather path's
    assert "of which: gather + dequantize" not in codes["seconds"]
    assert codes["mean_keys_per_forward"] == pytest.approx(fp8["mean_keys_per_forward"])
    inner = fp8["seconds"]["of which: gather + dequantize"] + fp8["seconds"]["of which: quantize + write"]
    assert 0 < inner <= fp8["seconds"]["cache update"]
