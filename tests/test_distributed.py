"""Our caches under transformers' own tensor parallelism, and layers whose keys live on another device.

Tensor parallelism: the test saves a tiny random Llama (8 query heads, 4 KV heads, head_dim 16, 2 layers), starts
`python -m torch.distributed.run --nproc-per-node 2` on loopback (free port chosen at run time, gloo on CPU) with
tests/distributed_worker.py, which loads it with `DistributedConfig(tp_plan="auto")` (the model's own
`base_model_tp_plan`: q/k/v colwise, o rowwise, so each rank computes 4 query heads and 2 KV heads) and runs every
case through greedy `generate`, and compares each rank's report with the same cases run here in one process:
- the generated tokens of both ranks equal the single-process run, and the per-step logits agree to float32
  reassociation noise (the row-wise all-reduce sums in another order: ~5e-6 measured);
- each layer of each rank's cache holds only the rank's KV heads: `layer.heads` and dim 1 of every per-row tensor of
  its store is KV/world; its policy's tensors have the rank's heads or 1 (state shared by all heads);
- `cache.nbytes()` per rank is 1/world of the single-process cache, up to what is not per head (slot positions of
  head-shared policies, the shared key rotation matrix, scalar scales): within 10% of the single-process bytes.
Budgets of 12 tokens for a 24-token prompt (eviction happens before the first decode step) and of 64 (nothing is
evicted). A few cases also run on Qwen3 (sharded like Llama) and Phi-3 (its plan gathers the fused qkv output, so
attention and the cache are replicated: every rank holds all heads). Cases that differ for a reason outside hf_kvcache
are strict xfails naming it (see docs/distributed.md); each case also checks the TP rank and head offset the cache
read from the model. Also: examples/tensor_parallel.py under torchrun, and every
cache on a model dispatched by accelerate with a device_map (a disk-offloaded layer).

Layers on other devices (`device_map` splits): only the CPU exists here, so the meta device stands in for "another
device": one forward announced on the CPU, layer 0 receiving CPU keys and layer 1 meta keys; each layer must
allocate its cache on the device of its keys. Every family runs on meta, since updates no longer read values on the
host (and random eviction's keys are a hash, not a generator's draws).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import distributed_worker as worker
import pytest
import torch
from conftest import build_config, build_model
from transformers import AutoModelForCausalLM

from hf_kvcache import build_cache, cache_kwargs
from hf_kvcache.sharing.calibration import calibrate

WORLD = 2
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 16
EVICT, KEEP = 12, 64  # budgets: below the 24-token prompt, above prompt + new tokens
LOGIT_TOLERANCE = 1e-4  # float32 reassociation of the all-reduce measured at <= 5.2e-6
NON_HEAD_SHARE = 0.10  # bytes not per head, as a share of the single-process cache (measured <= 7.1%)
TIMEOUT = 300
HERE = os.path.dirname(os.path.abspath(__file__))

CASES = [
    {"id": "dynamic", "cache": "dynamic"},  # transformers' own cache: the baseline of what TP gives every cache
    {"id": "sink", "cache": "sink", "config": {"sinks": 2, "budget": EVICT}},
    {"id": "sink_keep", "cache": "sink", "config": {"sinks": 2, "budget": KEEP}},
    {"id": "sink_padded", "cache": "sink", "config": {"sinks": 2, "budget": EVICT}, "padded": True},
    {"id": "sink_original", "cache": "sink", "config": {"sinks": 2, "budget": EVICT, "position_mode": "original"}},
    {"id": "sliding", "cache": "sliding", "config": {"window": EVICT}},
    {"id": "sliding_keep", "cache": "sliding", "config": {"window": KEEP}},
    {"id": "h2o", "cache": "h2o", "config": {"budget": EVICT}},
    {"id": "h2o_keep", "cache": "h2o", "config": {"budget": KEEP}},
    {"id": "h2o_mean", "cache": "h2o", "config": {"budget": EVICT, "aggregation": "mean"}},
    {"id": "h2o_max", "cache": "h2o", "config": {"budget": EVICT, "aggregation": "max"}},
    {"id": "h2o_compact", "cache": "h2o", "config": {"budget": EVICT, "position_mode": "compact"}},
    {"id": "h2o_padded", "cache": "h2o", "config": {"budget": EVICT}, "padded": True},
    {"id": "composite", "cache": "composite", "config": {"preset": "sinks_heavy_recent", "budget": EVICT}},
    {"id": "composite_keep", "cache": "composite", "config": {"preset": "sinks_heavy_recent", "budget": KEEP}},
    {
        "id": "composite_original_sinks",
        "cache": "composite",
        "config": {"preset": "sinks_heavy_recent", "budget": EVICT, "sink_positions": "original"},
    },
    {
        "id": "composite_sinks_windows",
        "cache": "composite",
        "config": {
            "regions": [
                {"role": "sinks", "tokens": 2},
                {"role": "window", "start": 0, "end": 4},
                {"role": "window", "start": 4, "end": 10, "keys": "fp8_e4m3", "values": "fp8_e4m3"},
            ]
        },
    },
    {"id": "random_eviction", "cache": "random_eviction", "config": {"budget": EVICT}},
    {"id": "random_eviction_keep", "cache": "random_eviction", "config": {"budget": KEEP}},
    {"id": "fp8", "cache": "fp8", "config": {}},
    {"id": "fp8_head", "cache": "fp8", "config": {"granularity": "head"}},
    {"id": "fp8_tensor", "cache": "fp8", "config": {"granularity": "tensor"}},
    {"id": "fp8_calibrated", "cache": "fp8", "config": {"granularity": "head", "scales": "CALIBRATED"}},
    {
        "id": "fp8_calibrated_smoothing",
        "cache": "fp8",
        "config": {"granularity": "head", "key_smoothing": True, "scales": "CALIBRATED_SMOOTHING"},
    },
    {"id": "fp8_smoothing_residual", "cache": "fp8", "config": {"key_smoothing": True, "residual": 8}},
    {"id": "kivi", "cache": "kivi", "config": {"bits": 4, "group_size": 8, "residual": 8}},
    {"id": "kivi_hqq", "cache": "kivi", "config": {"bits": 4, "group_size": 8, "residual": 8, "backend": "hqq"}},
]
for case in CASES:
    case["model"] = "llama"
# Other architectures: Qwen3 (q/k norms, replicated) shards like Llama; Phi-3's plan gathers its fused qkv_proj
# output ("colwise_gather_output"), so every rank computes every head and its cache holds all of them.
OTHER_ARCHS = {"qwen3": KV_HEADS // WORLD, "phi3": KV_HEADS}
LOCAL_HEADS = {"llama": KV_HEADS // WORLD, **OTHER_ARCHS}
for arch in OTHER_ARCHS:
    CASES += [
        {"id": f"{arch}-dynamic", "model": arch, "cache": "dynamic"},
        {"id": f"{arch}-sink", "model": arch, "cache": "sink", "config": {"sinks": 2, "budget": EVICT}},
        {"id": f"{arch}-h2o", "model": arch, "cache": "h2o", "config": {"budget": EVICT}},
        {"id": f"{arch}-fp8", "model": arch, "cache": "fp8", "config": {}},
        {"id": f"{arch}-kivi", "model": arch, "cache": "kivi", "config": {"bits": 4, "group_size": 8, "residual": 8}},
    ]
CASE_IDS = [case["id"] for case in CASES]
MODEL_OF = {case["id"]: case["model"] for case in CASES}

# Cases that differ from the single-process run for a reason outside hf_kvcache (see docs/distributed.md). Fixed
# library bugs found by this test, now passing: composite sinks placed per KV head (SinkMemory.reposition), random
# eviction keyed by the global KV head, FP8 "tensor" warm-up scale reduced over the TP group, calibrated per-head FP8
# scales and key means sliced to the rank's heads.
HQQ_GLOBAL_STOP = (
    "not an hf_kvcache bug: hqq's zero-point optimizer (hqq/core/optimize.py) stops on the mean error over all the "
    "groups quantized together, so a rank (2 heads) stops at another iteration than one process (4 heads); tokens "
    "still agree, logits differ by ~5e-2."
)
XFAIL = {  # test kind -> {case id: reason}
    "tokens": {},
    "logits": {"kivi_hqq": HQQ_GLOBAL_STOP},
    "heads": {},
    "nbytes": {},
}


def cases_for(kind: str):
    return [
        pytest.param(cid, marks=pytest.mark.xfail(strict=True, reason=XFAIL[kind][cid])) if cid in XFAIL[kind] else cid
        for cid in CASE_IDS
    ]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, *args: str) -> str:
    """Run `script` on WORLD processes on loopback (a free port chosen now); its stdout, or fail with stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo on loopback
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        f"--nproc-per-node={WORLD}",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "--max-restarts",
        "0",
        script,
        *args,
    ]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"torchrun did not finish in {TIMEOUT} s; stderr tail:\n{(error.stderr or '')[-3000:]}")
    if done.returncode != 0:
        pytest.fail(f"torchrun exited with {done.returncode}; stderr tail:\n{done.stderr[-5000:]}")
    return done.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"single": results, "ranks": [report of rank 0, rank 1]} for every case."""
    root = tmp_path_factory.mktemp("tp")
    for arch in LOCAL_HEADS:
        build_model(arch, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM).save_pretrained(
            root / "models" / arch
        )
    model = AutoModelForCausalLM.from_pretrained(root / "models" / "llama", dtype=torch.float32).eval()
    calibration_ids = torch.randint(2, worker.VOCAB, (2, 48), generator=torch.Generator().manual_seed(5))
    scales = {  # calibrated in one process, for all 4 KV heads: each rank keeps its heads' entries
        "CALIBRATED": calibrate(model, input_ids=calibration_ids, window=48),
        "CALIBRATED_SMOOTHING": calibrate(model, input_ids=calibration_ids, window=48, key_smoothing=True),
    }
    cases = [
        {**case, "config": {**case["config"], "scales": scales[case["config"]["scales"]]}}
        if case.get("config", {}).get("scales")
        else case
        for case in CASES
    ]
    (root / "cases.json").write_text(json.dumps(cases))
    (root / "out").mkdir()
    torchrun(
        os.path.join(HERE, "distributed_worker.py"), str(root / "models"), str(root / "cases.json"), str(root / "out")
    )
    single = {}
    for arch in LOCAL_HEADS:
        reference = AutoModelForCausalLM.from_pretrained(root / "models" / arch, dtype=torch.float32).eval()
        single.update(worker.run_cases(reference, [case for case in cases if case["model"] == arch]))
    ranks = [json.loads((root / "out" / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {"single": single, "ranks": ranks}


def results(runs, cid: str) -> tuple[dict, list[dict]]:
    single = runs["single"][cid]
    assert "error" not in single, f"single-process run of {cid} failed: {single.get('traceback')}"
    ranks = [report["cases"][cid] for report in runs["ranks"]]
    for rank, result in enumerate(ranks):
        assert "error" not in result, f"rank {rank}, case {cid}: {result['error']}\n{result.get('traceback')}"
    return single, ranks


def test_transformers_sharded_the_models(runs):
    for rank, report in enumerate(runs["ranks"]):
        assert report["rank"] == rank and report["world"] == WORLD
        assert set(report["models"]) == set(LOCAL_HEADS)
        for arch, facts in report["models"].items():
            assert facts["tp_size"] == WORLD and facts["key_projection_is_dtensor"], arch
        assert report["models"]["llama"]["key_projection_local_rows"] == KV_HEADS // WORLD * HEAD_DIM
        assert report["models"]["qwen3"]["key_projection_local_rows"] == KV_HEADS // WORLD * HEAD_DIM
        # Phi-3: the fused q|k|v rows are split evenly, then gathered again before attention
        assert report["models"]["phi3"]["key_projection_local_rows"] == (HEADS + 2 * KV_HEADS) * HEAD_DIM // WORLD


@pytest.mark.parametrize("cid", cases_for("tokens"))
def test_tokens_equal_single_process(runs, cid):
    single, ranks = results(runs, cid)
    for rank, result in enumerate(ranks):
        assert result["tokens"] == single["tokens"], f"rank {rank} generated other tokens than one process"


@pytest.mark.parametrize("cid", cases_for("logits"))
def test_logits_match_single_process(runs, cid):
    single, ranks = results(runs, cid)
    expected = torch.tensor(single["logits"])
    for rank, result in enumerate(ranks):
        got = torch.tensor(result["logits"])
        assert got.shape == expected.shape
        diff = (got - expected).abs().max().item()
        assert diff <= LOGIT_TOLERANCE, f"rank {rank}: logits differ from one process by {diff:.3g}"


@pytest.mark.parametrize("cid", cases_for("heads"))
def test_each_rank_holds_only_its_heads(runs, cid):
    single, ranks = results(runs, cid)
    local = LOCAL_HEADS[MODEL_OF[cid]]
    assert single["heads"] == [KV_HEADS, KV_HEADS]  # the check below is live: one process holds every head
    assert all(dims == [KV_HEADS] for dims in single["store_heads"])
    for rank, result in enumerate(ranks):
        assert result["heads"] == [local, local], f"rank {rank}"
        assert all(dims == [local] for dims in result["store_heads"]), f"rank {rank}: {result['store_heads']}"
        assert all(set(dims) <= {1, local} for dims in result["policy_heads"]), f"rank {rank}: {result['policy_heads']}"


@pytest.mark.parametrize("cid", [cid for cid in CASE_IDS if not cid.endswith("dynamic")])
def test_cache_knows_its_rank_and_head_offset(runs, cid):
    """The cache reads its TP rank from the model (`cache.tensor_parallel`); a rank's first KV head is rank x local
    heads when the plan shards attention, 0 when it replicates it (Phi-3) and in one process."""
    single, ranks = results(runs, cid)
    assert single["tensor_parallel"] == [0, 1] and single["head_offsets"] == [0, 0]
    local = LOCAL_HEADS[MODEL_OF[cid]]
    for rank, result in enumerate(ranks):
        assert result["tensor_parallel"] == [rank, WORLD], f"rank {rank}"
        offset = rank * local if local < KV_HEADS else 0
        assert result["head_offsets"] == [offset, offset], f"rank {rank}"


@pytest.mark.parametrize("cid", cases_for("nbytes"))
def test_bytes_per_rank_are_a_shard(runs, cid):
    single, ranks = results(runs, cid)
    assert ranks[0]["nbytes"] == ranks[1]["nbytes"]
    shards = KV_HEADS // LOCAL_HEADS[MODEL_OF[cid]]  # 1 when the model's plan replicates attention (Phi-3)
    non_head = shards * ranks[0]["nbytes"] - single["nbytes"]  # bytes each rank holds whole, times (shards - 1)
    assert 0 <= non_head <= NON_HEAD_SHARE * single["nbytes"], (
        f"per rank {ranks[0]['nbytes']} B vs one process {single['nbytes']} B "
        f"(ratio {ranks[0]['nbytes'] / single['nbytes']:.4f}, expected ~{1 / shards})"
    )


# -- layers whose keys arrive on another device than the forward's input (device_map splits) ----------------------
DEVICE_CASES = [
    ("sink", {"sinks": 2, "budget": EVICT}),
    ("sliding", {"window": EVICT}),
    ("h2o", {"budget": EVICT}),
    ("composite", {"preset": "sinks_heavy_recent", "budget": EVICT}),
    ("random_eviction", {"budget": EVICT}),  # random keys are a hash, no generator: any device
    ("fp8", {"key_rotation": "none"}),  # rotated keys need the bridge (it rotates the queries), not called here
    ("kivi", {"bits": 4, "group_size": 8, "residual": 8}),
]


# Shared by all layers of a cache, not a layer's state: the RoPE inverse frequencies (moved to the keys' device when
# used) and the dequantization workspace (one buffer per device).
SHARED_STATE = ("rotator", "workspace")


def layer_tensor_devices(layer) -> set[str]:
    tensors = list(worker._tensors(layer.policy, skip=SHARED_STATE)) + list(
        worker._tensors(layer.store, skip=SHARED_STATE)
    )
    tensors += [t for t in (layer.slot_valid, layer.slot_pos) if t is not None]
    return {t.device.type for t in tensors}


@pytest.mark.parametrize("name,config", DEVICE_CASES, ids=[name for name, _ in DEVICE_CASES])
def test_layer_allocates_on_the_device_of_its_keys(name, config):
    cache = build_cache(
        name, build_config("llama", num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM), config
    )
    batch, devices = 2, ("cpu", "meta")
    for q in (worker.PROMPT, 1, 1):  # prefill (evicts: 24 > 12), then two decode steps
        cache.begin_forward(q, batch, torch.device("cpu"))
        for layer, device in zip(cache.layers, devices):
            keys = torch.randn(batch, KV_HEADS, q, HEAD_DIM).to(device)
            out_keys, _ = layer.update(keys, torch.randn_like(keys))
            if layer.policy.needs_attention:  # what the attention bridge does for H2O: scores of this forward
                layer.policy.observe(layer.view, torch.rand(batch, HEADS, out_keys.shape[2], device=device))
            assert out_keys.device.type == device
    for layer, device in zip(cache.layers, devices):
        assert layer_tensor_devices(layer) == {device}, f"layer {layer.layer_idx}"
    assert cache.get_seq_length() == worker.PROMPT + 2


def test_example_under_torchrun():
    """examples/tensor_parallel.py (tiny random Llama, 4 KV heads) on 2 ranks with --compare."""
    out = torchrun(
        os.path.join(HERE, "..", "examples", "tensor_parallel.py"),
        "--cache",
        "sink:budget=12",
        "--cache",
        "h2o:budget=0.5",
        "--new-tokens",
        "6",
        "--compare",
    )
    for rank in range(WORLD):
        assert out.count(f"[rank {rank}/{WORLD}]") == 2
    lines = [line for line in out.splitlines() if line.startswith("[rank")]
    assert all("KV heads per layer [2, 2]" in line for line in lines), out
    comparisons = [line for line in out.splitlines() if "one process:" in line]
    assert len(comparisons) == 2 and all("KV heads [4, 4]" in c and "tokens equal" in c for c in comparisons), out


# -- a model dispatched by accelerate with a device_map --------------------------------------------------------------
@pytest.mark.parametrize(
    "name,config",
    [
        ("sink", {"sinks": 2, "budget": EVICT}),
        ("sliding", {"window": EVICT}),
        ("h2o", {"budget": EVICT}),
        ("composite", {"preset": "sinks_heavy_recent", "budget": EVICT}),
        ("random_eviction", {"budget": EVICT}),
        ("fp8", {}),
        ("kivi", {"bits": 4, "group_size": 8, "residual": 8}),
    ],
    ids=["sink", "sliding", "h2o", "composite", "random_eviction", "fp8", "kivi"],
)
def test_device_map_with_offloaded_layer(tmp_path, name, config):
    """`device_map` with layer 1 offloaded to disk: accelerate's hooks move its weights in and its inputs around;
    the only real device is the CPU, so both layers still compute there (not a split over devices). Our forward
    hooks and attention bridge must work under accelerate's hooks: same tokens as the plain model."""
    pytest.importorskip("accelerate")
    model = build_model("llama", num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    model.save_pretrained(tmp_path / "model")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    dispatched = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", dtype=torch.float32, device_map=device_map, offload_folder=str(tmp_path / "offload")
    ).eval()
    assert dispatched.hf_device_map["model.layers.1"] == "disk"
    ids, mask = worker.prompt(padded=True)
    outputs = []
    for m in (model, dispatched):
        cache = build_cache(name, m, config)
        outputs.append(
            m.generate(
                input_ids=ids,
                attention_mask=mask,
                **cache_kwargs(cache),
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=worker.PAD,
            )
        )
        assert cache.get_seq_length() == worker.PROMPT + 5  # the last token is generated, not cached
    assert torch.equal(outputs[0], outputs[1])
