"""tp_step_peer.py without a GPU or torch: its config table against
step_bench's (and tp_peer's and pytorch_peer's), its flag checks, how it
assembles a config's rows (the ranks' timings made up), the rows' fields
against step_bench --tp 2's (two host processes), and report.py's TP table
and goals over both files."""

import copy
import json
import math
import os
import sys

import pytest

HERE = os.path.join(os.environ.get("TEST_SRCDIR", ""), os.environ.get("TEST_WORKSPACE", ""))
sys.path.insert(0, os.path.join(HERE, "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dp_test  # noqa: E402  (step_bench over host processes)
import pytorch_peer  # noqa: E402
import report  # noqa: E402
import tp_peer  # noqa: E402
import tp_step_peer  # noqa: E402

# hidden, ffn, blocks, tokens: benchmarks/step_configs.cc (as tests/benchmarks/model_flops_test.cc)
STEP_CONFIGS = {"small": (512, 2048, 8, 256), "medium": (2048, 8192, 8, 4096), "large": (4096, 16384, 4, 8192)}


def test_configs_are_step_bench_dense_configs():
    assert tp_step_peer.CONFIGS == tuple(STEP_CONFIGS)
    for name, (hidden, ffn, layers, tokens) in STEP_CONFIGS.items():
        c = pytorch_peer.CONFIGS[name]
        assert (c["hidden"], c["ffn"], c["layers"], c["tokens"], c["experts"]) == (hidden, ffn, layers, tokens, 0)
        assert c["heads"] > 0 and pytorch_peer.mlp_only(c)["heads"] == 0  # the tp rows: the MLP-only trunk
        assert tp_peer.CONFIGS[name] == (hidden, ffn, tokens)  # the layer-level peer's shapes
        for world in (1, 2, 4, 8):
            assert tp_step_peer.check_config(name, world) is None
    assert "no tensor-parallel PyTorch peer" in tp_step_peer.check_config("moe", 2)
    assert tp_step_peer.check_config("small", 3) == "config 'small': tokens 256 does not divide by 3 ranks"


def test_shards_cover_each_dimension_once():
    for total, world in ((8192, 2), (2048, 4), (256, 8), (512, 1)):
        ranges = [tp_step_peer.shard(total, r, world) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--configs", "moe"], "no tensor-parallel PyTorch peer"),
        (["--configs", "small,huge"], "unknown config 'huge'"),
        (["--systems", "pytorch_compile"], "unknown system 'pytorch_compile'"),
        (["--steps", "0"], "--steps and --warmup must be >= 1"),
        (["--timeout-s", "0"], "--timeout-s must be positive"),
    ],
)
def test_flags_are_checked_before_torch(flags, message):
    with pytest.raises(SystemExit, match=message.replace("(", "\\(")):
        tp_step_peer.main(flags)


def test_multicast_stays_off_before_torch():
    assert tp_step_peer.peer.MULTICAST_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                               "NVSHMEM_DISABLE_NVLS": "1"}
    for name, value in tp_step_peer.peer.MULTICAST_ENV.items():
        assert os.environ[name] == value


def raw(samples, first_losses, pipelined=None, peak=1000):
    """time_system's numbers of one rank, made up."""
    return {"samples_us": samples, "pipelined_step_us": pipelined or min(samples), "peak_bytes": peak,
            "device_used_delta_bytes": 2 * peak, "final_loss": first_losses[-1] - 0.1,
            "first_losses": list(first_losses), "extra": {"wall_s": 2.0}}


class FakeGroup:
    """Rank 0 of two, for run_tp_config without a process group."""

    rank, world = 0, 2

    def agree(self, value):
        return value


# Each rank's made-up step times (us) and first losses per row; the graph row's capture refused.
TIMES = {
    "pytorch_eager_tp1": ([[1000, 1100, 1000], [1050, 1000, 1000]], [9.0100, 9.0050]),
    "pytorch_cuda_graph_tp1": ([[900, 900, 950], [900, 920, 900]], [9.0100, 9.0050]),
    "pytorch_tp_sequential": ([[700, 700, 700], [650, 720, 690]], [9.0110, 9.0060]),
    "pytorch_async_tp": ([[600, 640, 600], [610, 600, 600]], [9.0110, 9.0060]),
}
CAPTURE_ERROR = "rank 0: RuntimeError: CUDA error: operation not permitted when stream is capturing"


@pytest.fixture()
def peer_config(monkeypatch):
    def run_everywhere(build, c, steps, warmup, group, loss_of=None, world_one=False):
        assert callable(build) and not world_one
        row = built_rows.pop(0)
        if row not in TIMES:
            return None, CAPTURE_ERROR
        samples, losses = TIMES[row]
        return pytorch_peer.combine_ranks([raw(s, losses) for s in samples]), None

    built_rows = list(tp_step_peer.ROWS)
    monkeypatch.setattr(tp_step_peer.peer, "run_everywhere", run_everywhere)
    out = tp_step_peer.run_tp_config("small", list(tp_step_peer.ROWS), 3, 1, math.inf, FakeGroup(), None)
    assert built_rows == []
    return out


def test_rows_strong_scaling_and_loss_checks(peer_config):
    c = peer_config
    assert c["status"] == "ok" and c["world_size"] == 2 and c["tensor_parallel_rows"]
    rows = {s["system"]: s for s in c["systems"]}
    assert list(rows) == ["pytorch_eager_tp1", "pytorch_cuda_graph_tp1", "pytorch_tp_sequential", "pytorch_async_tp"]
    assert c["unavailable"] == {"pytorch_async_tp_cuda_graph": f"capture failed: {CAPTURE_ERROR}"}
    base, seq, fused = rows["pytorch_eager_tp1"], rows["pytorch_tp_sequential"], rows["pytorch_async_tp"]
    assert base["step_us"]["median_us"] == 1050  # per sample the slowest rank: 1050, 1100, 1000
    assert fused["step_us"] == {"median_us": 610, "min_us": 600, "max_us": 640}
    assert fused["rank_median_us"] == [600, 600] and fused["world_size"] == 2 and base["world_size"] == 1
    assert fused["baseline_system"] == "pytorch_eager_tp1" and base["baseline_system"] is None
    assert fused["speedup_vs_tp1"] == pytest.approx(1050 / 610)
    assert fused["strong_scaling_efficiency"] == pytest.approx(1050 / 610 / 2)
    assert seq["speedup_vs_tp1"] == pytest.approx(1050 / 700)
    assert c["heads"] == 0 and c["trunk"] == pytorch_peer.TP_TRUNK  # the MLP-only trunk, as step_bench --tp
    flops = pytorch_peer.step_flops(pytorch_peer.mlp_only(pytorch_peer.CONFIGS["small"]))
    assert fused["tflops"] == pytest.approx(flops / 610e-6 / 1e12 / 2)  # per GPU
    assert base["tflops"] == pytest.approx(flops / 1050e-6 / 1e12)
    assert fused["tokens_per_s"] == pytest.approx(256 / 610e-6)  # the config's tokens: strong scaling
    check = c["loss_check"]
    assert check["compared"] == ["pytorch_tp_sequential", "pytorch_async_tp"] and check["identical"]
    assert check["max_abs_diff"] == 0 and check["steps"] == 2
    assert c["tp_loss_check"]["pytorch_async_tp"]["agrees"]
    assert c["tp_loss_check"]["pytorch_async_tp"]["abs_diff"] == pytest.approx(0.001)


def test_a_first_loss_off_the_one_gpu_step_disagrees():
    def row(losses):
        return {"first_losses": losses}

    check, tp_check = tp_step_peer.loss_checks({"pytorch_eager_tp1": row([9.0]), "pytorch_tp_sequential": row([9.0]),
                                                "pytorch_async_tp": row([9.2])})
    assert not check["identical"] and check["max_abs_diff"] == pytest.approx(0.2)
    assert tp_check["pytorch_tp_sequential"]["agrees"] and not tp_check["pytorch_async_tp"]["agrees"]


def test_budget_and_missing_async_tp(monkeypatch):
    monkeypatch.setattr(tp_step_peer.peer, "run_everywhere", lambda *a, **k: pytest.fail("nothing may run"))
    out = tp_step_peer.run_tp_config("small", ["pytorch_eager_tp1"], 3, 1, 0.0, FakeGroup(), None)
    assert out["systems"][0]["status"] == "not_run" and out["status"] == "failed"
    out = tp_step_peer.run_tp_config("small", ["pytorch_async_tp"], 3, 1, math.inf, FakeGroup(), "ImportError: x")
    assert out["systems"][0] == {"system": "pytorch_async_tp", "status": "failed",
                                 "reason": "async TP unavailable: ImportError: x"}
    three = FakeGroup()
    three.world = 3
    assert tp_step_peer.run_tp_config("small", ["pytorch_async_tp"], 3, 1, math.inf, three, None)["status"] == "not_run"


@pytest.fixture(scope="module")
def step_bench_tp2(tmp_path_factory):
    """step_bench --tp 2 over two host processes (tiny), its config renamed to "small" with small's shape."""
    tmp = tmp_path_factory.mktemp("tp2")
    codes, logs = dp_test.run_world(tmp, 2, dp_test.HOST_FLAGS + ["--tp", "2", "--overlap", "bulk"])
    assert codes == [0, 0], logs
    data = json.loads((tmp / "rank0.json").read_text())
    data["configs"][0].update({k: pytorch_peer.config_header("small", trunk=True)[k] for k in report.SHAPE_KEYS})
    data["configs"][0]["name"] = "small"
    return data


def test_peer_rows_have_step_bench_tp_fields(step_bench_tp2, peer_config):
    ours = {s["system"]: set(s) for s in step_bench_tp2["configs"][0]["systems"]}
    theirs = {s["system"]: set(s) for s in peer_config["systems"]}
    for mine, peer in (("stepgraph_eager_tp1", "pytorch_eager_tp1"), ("stepgraph_graph_tp1", "pytorch_cuda_graph_tp1"),
                       ("stepgraph_eager_tp2", "pytorch_tp_sequential"), ("stepgraph_graph_tp2", "pytorch_async_tp")):
        missing = ours[mine] - dp_test.STEPGRAPH_ONLY - {"profile"} - theirs[peer]
        assert not missing, f"{peer} lacks {sorted(missing)} of {mine}"
    header = set(step_bench_tp2["configs"][0]) - {"overlap"}  # our overlap mode; theirs is the row
    assert header <= set(peer_config), sorted(header - set(peer_config))
    assert step_bench_tp2["configs"][0]["heads"] == 0 and step_bench_tp2["configs"][0]["trunk"] == peer_config["trunk"]
    assert "trunk" in step_bench_tp2["tensor_parallel"]


def test_report_makes_the_tp_table_and_goals(step_bench_tp2, peer_config, tmp_path):
    theirs = {"benchmark": "training_step", "source": "pytorch", "device": "test", "torch_version": "test",
              "configs": [peer_config]}
    configs, warnings = report.merge(copy.deepcopy(step_bench_tp2), theirs)
    assert warnings == []
    rows = [r for r in report.table_rows(configs)]
    names = [r[1] for r in rows]
    assert names[0] == "pytorch"  # the note of the capture PyTorch refused
    assert "pytorch_async_tp_cuda_graph: capture failed" in rows[0][2]
    assert names[1:] == ["stepgraph_eager_tp1", "stepgraph_graph_tp1", "pytorch_eager_tp1", "pytorch_cuda_graph_tp1",
                         "stepgraph_eager_tp2", "stepgraph_graph_tp2", "pytorch_tp_sequential", "pytorch_async_tp"]
    systems = configs[0]["systems"]
    ours_eager = systems["stepgraph_eager_tp2"]["step_us"]["median_us"]
    assert rows[-1][4] == f"{ours_eager / 610:.2f}x"  # the speedup column: against our eager TP=2 row
    goals = {goal: (verdict, detail) for verdict, _, goal, detail in report.goals(configs)}
    assert set(goals) == {"graphed TP=2 step time <= 1.0x pytorch_async_tp",
                          "graphed TP=2 step time <= 1.0x pytorch_async_tp_cuda_graph"}
    ratio = systems["stepgraph_graph_tp2"]["step_us"]["median_us"] / 610
    assert goals["graphed TP=2 step time <= 1.0x pytorch_async_tp"] == ("PASS" if ratio <= 1 else "FAIL",
                                                                          f"{ratio:.2f}x")
    verdict, detail = goals["graphed TP=2 step time <= 1.0x pytorch_async_tp_cuda_graph"]
    assert verdict == "NOT MEASURED" and "capture failed" in detail
    a, b, md = tmp_path / "ours.json", tmp_path / "theirs.json", tmp_path / "tp.md"
    a.write_text(json.dumps(step_bench_tp2))
    b.write_text(json.dumps(theirs))
    assert report.main([str(a), str(b), "--markdown", str(md)]) == 0
    assert "| small | pytorch_async_tp |" in md.read_text()
