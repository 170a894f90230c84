"""The `hf-kvcache` evaluation subcommands: help for each, clear errors before any model is loaded."""

from __future__ import annotations

import pytest

from hf_kvcache.cli import build_parser, main
from hf_kvcache.cli.eval_commands import parse_cache

COMMANDS = ["demo", "caches", "memory", "ppl", "divergence", "retrieval", "speed", "sweep"]


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in COMMANDS + ["lm-eval"]:
        assert name in out


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_help(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert len(capsys.readouterr().out) > 150


def test_parse_cache():
    assert parse_cache("dynamic") == ("dynamic", "dynamic", {})
    assert parse_cache("sink:sinks=4,budget=0.25") == ("sink:sinks=4,budget=0.25", "sink", {"sinks": 4, "budget": 0.25})
    assert parse_cache("sliding:window=25%")[2] == {"window": "25%"}
    assert parse_cache('h2o:{"budget": 64}')[2] == {"budget": 64}
    with pytest.raises(ValueError, match="expected key=value"):
        parse_cache("sink:4")


def fail_loading(monkeypatch):
    import hf_kvcache.sharing.models

    def boom(*a, **k):
        raise AssertionError("no model may be loaded")

    monkeypatch.setattr(hf_kvcache.sharing.models, "load_model", boom)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ppl", "--cache", "sinc"], "--cache sinc: unknown cache 'sinc'; valid names are hf_kvcache caches"),
        (["divergence", "--cache", "sink:sinks=4,budget=1.5"], "--cache sink.budget: a budget fraction must be in"),
        (["divergence", "--cache", "sliding:window=0"], "--cache sliding.window: a budget is a number of tokens"),
        (["speed", "--cache", "sink:sinks=9,budget=8"], "`sinks` (9) must be smaller than `budget` (8)"),
        (["ppl", "--model", "./no/such/model"], "--model './no/such/model': no such model directory"),
        (["ppl", "--text", "/no/such/file.txt"], "--text '/no/such/file.txt': not 'pydoc'"),
        (["sweep", "/no/such/spec.yaml"], "spec: file '/no/such/spec.yaml' does not exist"),
        (["retrieval", "--kinds", "needle"], "--kinds: unknown probe 'needle'"),
        (["memory", "--precisions", "int5"], "Unknown precision 'int5'"),
        (["memory", "--shapes", "gpt-9"], "Unknown model shape 'gpt-9'"),
    ],
)
def test_errors_are_clear_and_early(monkeypatch, capsys, argv, message):
    fail_loading(monkeypatch)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hf-kvcache {argv[0]}: error:") and message in err


def test_bad_number_arguments(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["ppl", "--tokens", "-5"])
    assert exit_.value.code == 2
    assert "expected a positive integer" in capsys.readouterr().err


def test_memory_tables(capsys):
    assert main(["memory", "--contexts", "8192,131072"]) == 0
    out = capsys.readouterr().out
    assert "128.0 KiB" in out and "64.0 KiB" in out and "34.0 KiB" in out  # Llama-3-8B fp16 / fp8 / int4-g64
    assert "Max concurrent requests of llama-3-8b" in out


def test_memory_of_a_checkpoint_directory(capsys, tmp_path):
    """--shapes takes a checkpoint directory (or a Hub id: the same function, `shape_from_pretrained`): its
    config.json, counted layer by layer (the tiny Gemma 3's sliding layers hold their window of 8), its parameter
    count from the model built on the meta device."""
    import model_zoo

    from hf_kvcache.evaluation import memory

    model = model_zoo.build("gemma3")
    model.config.save_pretrained(tmp_path)
    assert (
        main(["memory", "--shapes", str(tmp_path), "--contexts", "64", "--precisions", "fp16", "--budgets", "16"]) == 0
    )
    out = capsys.readouterr().out
    held = memory.kv_cache_bytes(model.config, "fp16", 64)
    assert held < memory.kv_cache_bytes(
        memory.KVShape(
            "every layer",
            model.config.num_hidden_layers,
            memory.kv_head_count(model.config),
            memory.attention_head_dim(model.config),
        ),
        "fp16",
        64,
    )
    assert f"  {memory.format_bytes(held)}" in out
    params_b = sum(p.numel() for p in model.parameters()) / 1e9
    assert f"after {params_b:g}B weights" in out and f"Max concurrent requests of {tmp_path}" in out


def test_caches_lists_registered_names(capsys):
    from hf_kvcache import CACHE_IMPLEMENTATIONS

    assert main(["caches"]) == 0
    out = capsys.readouterr().out
    for name in [*CACHE_IMPLEMENTATIONS, "dynamic", "quantized"]:
        assert f"  {name} " in out


def test_sweep_dry_run(capsys, monkeypatch, tmp_path):
    fail_loading(monkeypatch)
    from pathlib import Path

    spec = Path(__file__).resolve().parents[1] / "eval" / "specs" / "smoke.yaml"
    assert main(["sweep", str(spec), "--out", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("smoke: ") and "0 already done" in out


def test_demo_runs_every_cache_family_on_a_tiny_model():
    """The demo's sweep end to end (the README's main command runs it on SmolLM2): the full cache agrees with
    itself, evicting caches hold less than the full cache, quantized ones keep every token in fewer bytes."""
    from types import SimpleNamespace

    from conftest import build_model, random_ids

    from hf_kvcache.evaluation.demo import format_table, run_demo
    from hf_kvcache.stores.quantization import backend_available

    model = build_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)  # head_dim 32
    prompt = random_ids(1, 256, seed=1)  # longer than kivi's full-precision residual (128)
    if not (backend_available("quanto") or backend_available("hqq")):
        pytest.skip("kivi needs optimum-quanto or hqq")
    rows = run_demo(model, SimpleNamespace(pad_token_id=0), prompt, new_tokens=6)
    assert rows[0].cache.startswith("full") and rows[0].generated_agreement == rows[0].top1_agreement == 1.0
    families = {r.cache.split()[0] for r in rows}
    assert {"sink", "sliding", "h2o", "composite", "fp8", "kivi"} <= families
    for r in rows[1:]:
        assert 0 < r.bytes_held < rows[0].bytes_held, r
        assert 0.0 <= r.top1_agreement <= 1.0 and r.decode_tokens_per_s > 0
    assert [r.budget for r in rows if r.cache.startswith("sink")] == ["32", "64", "128"]
    assert "composite fp8 128" in format_table(rows)
