"""tp_step_peer.py without a GPU or torch: its config table against
step_bench's (and tp_peer's and pytorch_peer's), which GPT configs split over
N ranks, its flag checks, how it assembles a config's rows (the ranks'
timings made up), the rows' fields against step_bench --tp 2's (the tiny GPT
over two host processes), and report.py's TP table and goals over both
files."""

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
        assert c["heads"] > 0 and c["sequences"] * c["seq_len"] == tokens  # the GPT itself, attention included
        assert tp_peer.CONFIGS[name] == (hidden, ffn, tokens)  # the layer-level peer's shapes
    for name in ("medium", "large"):  # step_bench --tp 2's configs (step_configs_test)
        for world in (1, 2):
            assert tp_step_peer.check_config(name, world) is None
    assert "no tensor-parallel PyTorch peer" in tp_step_peer.check_config("moe", 2)
    # As step_bench --tp: each rank's rows are whole sequences.
    assert tp_step_peer.check_config("small", 2) == "config 'small': sequences 1 does not divide by 2 ranks"
    assert tp_step_peer.check_config("medium", 4) == "config 'medium': sequences 2 does not divide by 4 ranks"
    assert tp_step_peer.check_config("small", 1) is None


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
    "pytorch_tp_eager": ([[800, 800, 800], [800, 810, 800]], [9.0110, 9.0060]),
    "pytorch_tp_compile": ([[700, 700, 700], [650, 720, 690]], [9.0110, 9.0060]),
    "pytorch_async_tp_compile": ([[600, 640, 600], [610, 600, 600]], [9.0110, 9.0060]),
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
    out = tp_step_peer.run_tp_config("medium", list(tp_step_peer.ROWS), 3, 1, math.inf, FakeGroup(), None)
    assert built_rows == []
    return out


def test_rows_strong_scaling_and_loss_checks(peer_config):
    c = peer_config
    assert c["status"] == "ok" and c["world_size"] == 2 and c["tp"] == 2 and c["tensor_parallel_rows"]
    rows = {s["system"]: s for s in c["systems"]}
    assert list(rows) == ["pytorch_eager_tp1", "pytorch_cuda_graph_tp1", "pytorch_tp_eager", "pytorch_tp_compile",
                          "pytorch_async_tp_compile"]
    assert c["unavailable"] == {"pytorch_async_tp_compile_graph": f"capture failed: {CAPTURE_ERROR}"}
    base, compiled, fused = rows["pytorch_eager_tp1"], rows["pytorch_tp_compile"], rows["pytorch_async_tp_compile"]
    assert base["step_us"]["median_us"] == 1050  # per sample the slowest rank: 1050, 1100, 1000
    assert fused["step_us"] == {"median_us": 610, "min_us": 600, "max_us": 640}
    assert fused["rank_median_us"] == [600, 600] and fused["world_size"] == 2 and base["world_size"] == 1
    assert fused["baseline_system"] == "pytorch_eager_tp1" and base["baseline_system"] is None
    assert fused["speedup_vs_tp1"] == pytest.approx(1050 / 610)
    assert fused["strong_scaling_efficiency"] == pytest.approx(1050 / 610 / 2)
    assert compiled["speedup_vs_tp1"] == pytest.approx(1050 / 700)
    # The GPT itself, attention included, as step_bench --tp.
    assert (c["heads"], c["kv_heads"], c["head_dim"]) == (16, 16, 128) and "trunk" not in c
    flops = pytorch_peer.step_flops(pytorch_peer.CONFIGS["medium"])
    assert c["attention_core_flops_per_step"] > 0 and c["flops_per_step"] == flops
    assert fused["tflops"] == pytest.approx(flops / 610e-6 / 1e12 / 2)  # per GPU
    assert base["tflops"] == pytest.approx(flops / 1050e-6 / 1e12)
    assert fused["tokens_per_s"] == pytest.approx(4096 / 610e-6)  # the config's tokens: strong scaling
    check = c["loss_check"]
    assert check["compared"] == ["pytorch_tp_eager", "pytorch_tp_compile", "pytorch_async_tp_compile"]
    assert check["identical"] and check["max_abs_diff"] == 0 and check["steps"] == 2
    assert c["tp_loss_check"]["pytorch_async_tp_compile"]["agrees"]
    assert c["tp_loss_check"]["pytorch_async_tp_compile"]["abs_diff"] == pytest.approx(0.001)


def test_a_config_that_does_not_split_runs_nothing(monkeypatch):
    monkeypatch.setattr(tp_step_peer.peer, "run_everywhere", lambda *a, **k: pytest.fail("nothing may run"))
    out = tp_step_peer.run_tp_config("small", list(tp_step_peer.ROWS), 3, 1, math.inf, FakeGroup(), None)
    assert out["status"] == "not_run" and out["reason"] == "config 'small': sequences 1 does not divide by 2 ranks"
    assert out["systems"] == []


def test_a_first_loss_off_the_one_gpu_step_disagrees():
    def row(losses):
        return {"first_losses": losses}

    check, tp_check = tp_step_peer.loss_checks({"pytorch_eager_tp1": row([9.0]), "pytorch_tp_eager": row([9.0]),
                                                "pytorch_async_tp_compile": row([9.2])})
    assert not check["identical"] and check["max_abs_diff"] == pytest.approx(0.2)
    assert tp_check["pytorch_tp_eager"]["agrees"] and not tp_check["pytorch_async_tp_compile"]["agrees"]


def test_budget_and_missing_async_tp(monkeypatch):
    monkeypatch.setattr(tp_step_peer.peer, "run_everywhere", lambda *a, **k: pytest.fail("nothing may run"))
    out = tp_step_peer.run_tp_config("medium", ["pytorch_eager_tp1"], 3, 1, 0.0, FakeGroup(), None)
    assert out["systems"][0]["status"] == "not_run" and out["status"] == "failed"
    for row in ("pytorch_async_tp_compile", "pytorch_async_tp_compile_graph"):
        out = tp_step_peer.run_tp_config("medium", [row], 3, 1, math.inf, FakeGroup(), "ImportError: x")
        why = "async TP unavailable: ImportError: x"
        assert out["systems"][0] == {"system": row, "status": "failed", "reason": why}
    three = FakeGroup()
    three.world = 3
    out = tp_step_peer.run_tp_config("medium", ["pytorch_tp_eager"], 3, 1, math.inf, three, None)
    assert out["status"] == "not_run"


@pytest.fixture(scope="module")
def step_bench_tp2(tmp_path_factory):
    """step_bench --tp 2 --profile over two host processes (the tiny GPT), its config renamed to "medium" with
    medium's shape."""
    tmp = tmp_path_factory.mktemp("tp2")
    codes, logs = dp_test.run_world(tmp, 2, dp_test.HOST_FLAGS + ["--tp", "2", "--overlap", "bulk", "--profile"])
    assert codes == [0, 0], logs
    data = json.loads((tmp / "rank0.json").read_text())
    c = data["configs"][0]
    assert (c["heads"], c["tp"]) == (2, 2)  # the tiny GPT's attention, sharded
    header = pytorch_peer.config_header("medium")
    c.update({k: header[k] for k in report.SHAPE_KEYS if k in header})
    c["name"] = "medium"
    return data


# Our rows and the peer's with the same job.
PAIRS = (("stepgraph_eager_tp1", "pytorch_eager_tp1"), ("stepgraph_graph_tp1", "pytorch_cuda_graph_tp1"),
         ("stepgraph_eager_tp2", "pytorch_tp_eager"), ("stepgraph_graph_tp2", "pytorch_async_tp_compile"))
PROFILE_ONLY = {"profile", "profile_exposed_comm_us", "profile_exposed_comm_fraction"}  # step_bench --profile's


def test_peer_rows_have_step_bench_tp_fields(step_bench_tp2, peer_config):
    ours = {s["system"]: set(s) for s in step_bench_tp2["configs"][0]["systems"]}
    theirs = {s["system"]: set(s) for s in peer_config["systems"]}
    for mine, peer in PAIRS:
        missing = ours[mine] - dp_test.STEPGRAPH_ONLY - PROFILE_ONLY - theirs[peer]
        assert not missing, f"{peer} lacks {sorted(missing)} of {mine}"
    header = set(step_bench_tp2["configs"][0]) - {"overlap"}  # our overlap mode; theirs is the row
    assert header <= set(peer_config), sorted(header - set(peer_config))
    for key in report.SHAPE_KEYS:  # what report.py compares between the files
        assert step_bench_tp2["configs"][0][key] == peer_config[key], key
    assert "sharding" in step_bench_tp2["tensor_parallel"] and "trunk" not in step_bench_tp2["tensor_parallel"]


def test_report_makes_the_tp_table_and_goals(step_bench_tp2, peer_config, tmp_path):
    theirs = {"benchmark": "training_step", "source": "pytorch", "device": "test", "torch_version": "test",
              "configs": [peer_config]}
    configs, warnings = report.merge(copy.deepcopy(step_bench_tp2), theirs)
    assert warnings == []
    rows = [r for r in report.table_rows(configs)]
    names = [r[1] for r in rows]
    assert names[0] == "pytorch"  # the note of the capture PyTorch refused
    assert "pytorch_async_tp_compile_graph: capture failed" in rows[0][2]
    assert names[1:] == ["stepgraph_eager_tp1", "stepgraph_graph_tp1", "pytorch_eager_tp1", "pytorch_cuda_graph_tp1",
                         "stepgraph_eager_tp2", "stepgraph_graph_tp2", "pytorch_tp_eager", "pytorch_tp_compile",
                         "pytorch_async_tp_compile"]
    systems = configs[0]["systems"]
    ours_eager = systems["stepgraph_eager_tp2"]["step_us"]["median_us"]
    assert rows[-1][4] == f"{ours_eager / 610:.2f}x"  # the speedup column: against our eager TP=2 row
    goals = {goal: (verdict, detail) for verdict, _, goal, detail in report.goals(configs)}
    time_goal = "graphed TP=2 step time <= 0.9x the fastest PyTorch TP row"
    comm_goal = "graphed TP=2 exposed communication <= 10% of the step"
    assert set(goals) == {time_goal, comm_goal}
    ours = systems["stepgraph_graph_tp2"]
    ratio = ours["step_us"]["median_us"] / 610  # the fastest: pytorch_async_tp_compile
    assert goals[time_goal] == ("PASS" if ratio <= 0.9 else "FAIL", f"{ratio:.2f}x pytorch_async_tp_compile")
    share = ours["profile_exposed_comm_fraction"]
    assert 0 < share < 1 and goals[comm_goal][0] == ("PASS" if share <= 0.1 else "FAIL")
    assert goals[comm_goal][1].startswith(f"{share:.1%}")
    a, b, md = tmp_path / "ours.json", tmp_path / "theirs.json", tmp_path / "tp.md"
    a.write_text(json.dumps(step_bench_tp2))
    b.write_text(json.dumps(theirs))
    assert report.main([str(a), str(b), "--markdown", str(md)]) == 0
    assert "| medium | pytorch_async_tp_compile |" in md.read_text()


def test_report_tp_goals_not_measured_say_why(step_bench_tp2, peer_config):
    unprofiled = copy.deepcopy(step_bench_tp2)
    for s in unprofiled["configs"][0]["systems"]:
        for key in PROFILE_ONLY:
            s.pop(key, None)
    peer = copy.deepcopy(peer_config)
    peer["systems"] = [s for s in peer["systems"] if s["system"] not in report.TORCH_TP_SYSTEMS]
    theirs = {"benchmark": "training_step", "source": "pytorch", "configs": [peer]}
    configs, _ = report.merge(unprofiled, theirs)
    goals = {goal: (verdict, detail) for verdict, _, goal, detail in report.goals(configs)}
    verdict, detail = goals["graphed TP=2 step time <= 0.9x the fastest PyTorch TP row"]
    assert verdict == "NOT MEASURED" and "every PyTorch TP row" in detail and "capture failed" in detail
    verdict, detail = goals["graphed TP=2 exposed communication <= 10% of the step"]
    assert verdict == "NOT MEASURED" and "--profile" in detail


def test_report_warns_when_the_files_shard_differently(step_bench_tp2, peer_config):
    theirs = {"benchmark": "training_step", "source": "pytorch", "configs": [dict(peer_config, heads=0)]}
    _, warnings = report.merge(copy.deepcopy(step_bench_tp2), theirs)
    assert warnings == ["medium: heads differs between the files (16 vs 0)"]
