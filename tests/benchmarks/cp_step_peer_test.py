"""cp_step_peer.py without a GPU or torch: its config table against step_bench's `long`, its flag checks, how it
assembles a config's rows (the ranks' timings and losses made up), the rows' fields against step_bench --cp 2's
(the tiny GPT over two host processes), and report.py's CP table over both files: the PyTorch rows in their
place, the "ours / PyTorch" column, the efficiency goal still ours."""

import contextlib
import copy
import json
import math
import os
import sys

import pytest

HERE = os.path.join(os.environ.get("TEST_SRCDIR", ""), os.environ.get("TEST_WORKSPACE", ""))
sys.path.insert(0, os.path.join(HERE, "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cp_step_peer  # noqa: E402
import dp_test  # noqa: E402  (step_bench over host processes)
import pytorch_peer  # noqa: E402
import report  # noqa: E402

# benchmarks/step_configs.cc's make_long(): make("long", hidden 2048, heads 16, layers 8, seq_len 16384, sequences 1)
# (ffn 4 x hidden; tests/benchmarks/step_configs_test.cc checks the C++ side).
LONG = {"hidden": 2048, "heads": 16, "layers": 8, "seq_len": 16384, "sequences": 1, "ffn": 8192, "tokens": 16384}


def test_config_is_step_bench_long():
    assert list(cp_step_peer.CONFIGS) == ["long"]
    c = cp_step_peer.CONFIGS["long"]
    assert {k: c[k] for k in LONG} == LONG and c["experts"] == 0
    # medium's shape (step_configs.cc: "medium's shape with one sequence of 16k tokens"), so the same header
    # fields as pytorch_peer's medium but for the sequence and the attention core.
    header, medium = cp_step_peer.config_header("long"), pytorch_peer.config_header("medium")
    assert set(header) == set(medium)
    differ = {k for k in header if header[k] != medium[k]}
    assert differ == {"name", "tokens", "seq_len", "sequences", "attention_core_flops_per_step", "flops_per_step"}
    assert header["flops_per_step"] == pytorch_peer.step_flops(c)
    wide = cp_step_peer.wide_config(c, 2)
    assert (wide["seq_len"], wide["tokens"], wide["sequences"]) == (32768, 32768, 1)
    # N times the sequence: N^2 times the attention core, N times the GEMMs.
    assert pytorch_peer.attention_core_flops(wide) == 4 * pytorch_peer.attention_core_flops(c)
    for world in (1, 2, 4, 8):
        assert cp_step_peer.check_config("long", world) is None
    assert "no context-parallel PyTorch peer" in cp_step_peer.check_config("medium", 2)


def test_a_sequence_that_does_not_cut_into_head_tail_chunks(monkeypatch):
    # As step_bench --cp: the N L tokens cut into 2 N chunks, at every N.
    monkeypatch.setitem(cp_step_peer.CONFIGS, "odd", pytorch_peer.gpt(hidden=64, heads=2, layers=1, seq_len=15,
                                                                      sequences=1))
    assert cp_step_peer.check_config("odd", 3) == ("config 'odd': its sequence of 45 tokens at 3 ranks does not cut "
                                                   "into 2 x 3 head-tail chunks")
    assert "15 tokens at 1 ranks" in cp_step_peer.check_config("odd", 1)
    monkeypatch.setitem(cp_step_peer.CONFIGS, "odd", pytorch_peer.gpt(hidden=64, heads=2, layers=1, seq_len=6,
                                                                      sequences=1))
    assert cp_step_peer.check_config("odd", 3) is None


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--configs", "medium"], "config 'medium' has no context-parallel PyTorch peer (configs: long)"),
        (["--configs", "long,huge"], "config 'huge' has no context-parallel PyTorch peer"),
        (["--configs", "long,long"], "a config is listed twice"),
        (["--systems", "pytorch_tp_eager"], "unknown system 'pytorch_tp_eager'"),
        (["--steps", "0"], "--steps and --warmup must be >= 1"),
        (["--timeout-s", "0"], "--timeout-s must be positive"),
    ],
)
def test_flags_are_checked_before_torch(flags, message):
    with pytest.raises(SystemExit, match=message.replace("(", "\\(").replace(")", "\\)")):
        cp_step_peer.main(flags)


def test_bad_launcher_variables_are_refused_before_torch(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    for name in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match="cp_step_peer: launcher variables partly set"):
        cp_step_peer.main([])


def test_multicast_stays_off_before_torch():
    assert cp_step_peer.peer.MULTICAST_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                               "NVSHMEM_DISABLE_NVLS": "1"}
    for name, value in cp_step_peer.peer.MULTICAST_ENV.items():
        assert os.environ[name] == value


def raw(samples, first_losses, peak=1000):
    """time_system's numbers of one rank, made up."""
    return {"samples_us": samples, "pipelined_step_us": min(samples), "peak_bytes": peak,
            "device_used_delta_bytes": 2 * peak, "final_loss": first_losses[-1] - 0.1,
            "first_losses": list(first_losses), "extra": {"wall_s": 2.0}}


class FakeGroup:
    """Rank 0 of `world`, for run_cp_config without a process group."""

    rank = 0

    def __init__(self, world=2):
        self.world = world

    def agree(self, value):
        return value


# Each rank's made-up step times (us) and first losses per row; the eager CP step captured is refused.
TIMES = {
    "pytorch_eager_cp1": ([[1000, 1100, 1000], [1050, 1000, 1000]], [9.0100, 9.0050]),
    "pytorch_cuda_graph_cp1": ([[900, 900, 950], [900, 920, 900]], [9.0100, 9.0050]),
    "pytorch_cp_eager": ([[1300, 1300, 1300], [1310, 1300, 1300]], [9.0210, 9.0160]),
    "pytorch_cp_compile": ([[1200, 1200, 1200], [1200, 1250, 1200]], [9.0210, 9.0160]),
    "pytorch_cp_compile_graph": ([[1100, 1150, 1100], [1100, 1100, 1100]], [9.0210, 9.0160]),
}
CAPTURE_ERROR = ("rank 0: CaptureFailed: capture failed: RuntimeError: CUDA error: operation not permitted when "
                 "stream is capturing")
ONE_GPU_LOSS = 9.0205


def made_up(row):
    if row not in TIMES:
        return None, CAPTURE_ERROR
    samples, losses = TIMES[row]
    return pytorch_peer.combine_ranks([raw(s, losses) for s in samples]), None


@pytest.fixture()
def peer_run(monkeypatch, capsys):
    """run_cp_config over every row with TIMES' numbers: (the config's JSON, what rank 0 printed)."""
    built = []

    def run_everywhere(build, c, steps, warmup, group, loss_of=None, world_one=False):
        assert callable(build) and not world_one and c is cp_step_peer.CONFIGS["long"]
        row = ["pytorch_eager_cp1", "pytorch_cuda_graph_cp1"][len(built)]
        built.append(row)
        return made_up(row)

    def run_cp_row(row, c, steps, warmup, group, device, mesh):
        assert c is cp_step_peer.CONFIGS["long"] and (steps, warmup) == (3, 1)
        built.append(row)
        return made_up(row)

    def one_gpu_first_loss(wide):
        assert built == ["pytorch_eager_cp1", "pytorch_cuda_graph_cp1"]  # before the first CP row
        assert wide["seq_len"] == 32768
        return ONE_GPU_LOSS

    monkeypatch.setattr(cp_step_peer.peer, "run_everywhere", run_everywhere)
    monkeypatch.setattr(cp_step_peer, "run_cp_row", run_cp_row)
    monkeypatch.setattr(cp_step_peer, "one_gpu_first_loss", one_gpu_first_loss)
    out = cp_step_peer.run_cp_config("long", list(cp_step_peer.ROWS), 3, 1, math.inf, FakeGroup())
    assert built == list(cp_step_peer.ROWS)
    return out, capsys.readouterr().out


@pytest.fixture()
def peer_config(peer_run):
    return peer_run[0]


def test_rows_efficiency_and_loss_checks(peer_run):
    c, printed = peer_run
    assert c["status"] == "ok" and c["world_size"] == 2 and c["cp"] == 2 and c["cp_seq_len"] == 32768
    assert c["context_parallel_rows"] and (c["seq_len"], c["tokens"]) == (16384, 16384)  # the cp1 config's header
    rows = {s["system"]: s for s in c["systems"]}
    assert list(rows) == list(cp_step_peer.ROWS)
    refused = rows["pytorch_cp_cuda_graph"]
    assert refused == {"system": "pytorch_cp_cuda_graph", "status": "failed", "reason": CAPTURE_ERROR}
    base, graph_base = rows["pytorch_eager_cp1"], rows["pytorch_cuda_graph_cp1"]
    for s in (base, graph_base):
        assert (s["cp"], s["world_size"], s["seq_len"], s["tokens"]) == (1, 1, 16384, 16384)
        assert s["baseline_system"] is None and s["efficiency"] is None and s["step_time_ratio"] is None
    assert base["step_us"]["median_us"] == 1050  # per sample the slowest rank: 1050, 1100, 1000
    eager, compiled, fused = rows["pytorch_cp_eager"], rows["pytorch_cp_compile"], rows["pytorch_cp_compile_graph"]
    for s in (eager, compiled, fused):
        assert (s["cp"], s["world_size"], s["seq_len"], s["tokens"], s["sequences"]) == (2, 2, 32768, 32768, 1)
        assert len(s["rank_median_us"]) == 2
    assert eager["step_us"] == {"median_us": 1300, "min_us": 1300, "max_us": 1310}
    # Efficiency: per-GPU TFLOP/s over the baseline's (the 32k sequence's attention counted); the time ratio beside.
    assert eager["baseline_system"] == "pytorch_eager_cp1" and eager["step_time_ratio"] == pytest.approx(1050 / 1300)
    assert eager["efficiency"] == pytest.approx(eager["tflops"] / base["tflops"])
    assert compiled["baseline_system"] == "pytorch_eager_cp1"
    assert compiled["step_time_ratio"] == pytest.approx(1050 / compiled["step_us"]["median_us"])
    assert fused["baseline_system"] == "pytorch_cuda_graph_cp1"
    assert fused["step_time_ratio"] == pytest.approx(920 / 1100)  # per sample the slowest: 900, 920, 950
    assert fused["efficiency"] == pytest.approx(fused["tflops"] / graph_base["tflops"])
    assert fused["efficiency"] > fused["step_time_ratio"]
    # Per GPU: the wide config's tokens and FLOPs over the 2 GPUs; the baseline's its own on one.
    wide = cp_step_peer.wide_config(cp_step_peer.CONFIGS["long"], 2)
    assert fused["tokens_per_s"] == pytest.approx(32768 / 1100e-6 / 2)
    assert fused["tflops"] == pytest.approx(pytorch_peer.step_flops(wide) / 1100e-6 / 1e12 / 2)
    assert fused["mfu"] == pytest.approx(fused["tflops"] / pytorch_peer.PEAK_TFLOPS)
    assert base["tokens_per_s"] == pytest.approx(16384 / 1050e-6)
    assert base["tflops"] == pytest.approx(c["flops_per_step"] / 1050e-6 / 1e12)
    check = c["loss_check"]
    assert check["compared"] == ["pytorch_cp_eager", "pytorch_cp_compile", "pytorch_cp_compile_graph"]
    assert check["identical"] and check["max_abs_diff"] == 0 and check["steps"] == 2
    assert set(c["cp_loss_check"]) == set(check["compared"])
    d = c["cp_loss_check"]["pytorch_cp_compile"]
    assert d["agrees"] and d["one_gpu_first_loss"] == ONE_GPU_LOSS and d["abs_diff"] == pytest.approx(0.0005)
    assert "pytorch_cp_compile: first loss 9.02100 vs one GPU's 9.02050 (|diff| 5.00e-04): agrees" in printed
    assert (f"efficiency {fused['efficiency']:.3f} (step time ratio 0.836) vs pytorch_cuda_graph_cp1"
            in printed)
    # The refused capture is a result, not a failure of the run; an eager row's failure is.
    result = {"configs": [c]}
    assert cp_step_peer.failures(result) == []
    broken = copy.deepcopy(c)
    broken["systems"][2] = {"system": "pytorch_cp_eager", "status": "failed", "reason": "x"}
    assert cp_step_peer.failures({"configs": [broken]}) == ["long/pytorch_cp_eager"]


def test_a_first_loss_off_the_one_gpu_loss_disagrees():
    def row(losses):
        return {"first_losses": losses}

    check, cp_check = cp_step_peer.loss_checks({"pytorch_eager_cp1": row([9.0]), "pytorch_cp_eager": row([9.0]),
                                                "pytorch_cp_compile": row([9.2])}, 9.0)
    assert check["compared"] == ["pytorch_cp_eager", "pytorch_cp_compile"]
    assert not check["identical"] and check["max_abs_diff"] == pytest.approx(0.2)
    assert cp_check["pytorch_cp_eager"]["agrees"] and not cp_check["pytorch_cp_compile"]["agrees"]
    assert "pytorch_eager_cp1" not in cp_check  # the baseline trains another sequence
    _, unchecked = cp_step_peer.loss_checks({"pytorch_cp_eager": row([9.0])}, None)
    assert unchecked == {}


def test_world_of_one_runs_the_baselines_alone(monkeypatch):
    ran = []

    def run_everywhere(build, c, steps, warmup, group, loss_of=None, world_one=False):
        assert world_one
        ran.append(len(ran))
        return made_up(["pytorch_eager_cp1", "pytorch_cuda_graph_cp1"][ran[-1]])

    monkeypatch.setattr(cp_step_peer.peer, "run_everywhere", run_everywhere)
    monkeypatch.setattr(cp_step_peer, "run_cp_row", lambda *a: pytest.fail("no CP row at world size 1"))
    out = cp_step_peer.run_cp_config("long", list(cp_step_peer.ROWS), 3, 1, math.inf, FakeGroup(1))
    assert [s["system"] for s in out["systems"]] == ["pytorch_eager_cp1", "pytorch_cuda_graph_cp1"]
    assert out["status"] == "ok" and out["cp"] == 1 and out["cp_loss_check"] == {}


def test_budget_spent_runs_nothing(monkeypatch):
    monkeypatch.setattr(cp_step_peer.peer, "run_everywhere", lambda *a, **k: pytest.fail("nothing may run"))
    monkeypatch.setattr(cp_step_peer, "run_cp_row", lambda *a: pytest.fail("nothing may run"))
    out = cp_step_peer.run_cp_config("long", ["pytorch_eager_cp1", "pytorch_cp_eager"], 3, 1, 0.0, FakeGroup())
    assert [s["status"] for s in out["systems"]] == ["not_run", "not_run"]
    assert out["status"] == "failed" and out["reason"] == "no row ran"
    assert cp_step_peer.failures({"configs": [out]}) == ["long/pytorch_eager_cp1", "long/pytorch_cp_eager"]


def test_a_cp_row_without_its_baseline_has_no_efficiency(monkeypatch):
    monkeypatch.setattr(cp_step_peer, "run_cp_row", lambda row, *a: made_up(row))
    monkeypatch.setattr(cp_step_peer, "one_gpu_first_loss", lambda wide: ONE_GPU_LOSS)
    out = cp_step_peer.run_cp_config("long", ["pytorch_cp_eager"], 3, 1, math.inf, FakeGroup())
    (row,) = out["systems"]
    assert row["efficiency"] is None and row["reason"] == "no efficiency: pytorch_eager_cp1 did not run"


class FakeBatch:
    """CPBatch without torch: its buffers are names."""

    SEQ_DIMS = cp_step_peer.CPBatch.SEQ_DIMS

    def __init__(self, wide):
        assert wide["seq_len"] == 32768

    def buffers(self):
        return ["x", "labels", "cos", "sin"]


class TwoRanks(FakeGroup):
    def __init__(self, rank_1_error=None):
        super().__init__(2)
        self.rank_1_error = rank_1_error

    def gather(self, value):
        return [value, self.rank_1_error]


def fake_context_parallel(events, refuse=False):
    @contextlib.contextmanager
    def context_parallel(mesh, buffers, buffer_seq_dims, no_restore_buffers):
        assert buffer_seq_dims == [1, 1, 0, 0] and no_restore_buffers == set(buffers)  # nothing restored
        if refuse:
            raise ValueError("`seq_dims` must have the same number of elements as `buffers`.")
        events.append("enter")
        yield
        events.append("exit")

    return context_parallel


def test_a_cp_row_runs_inside_context_parallel(monkeypatch):
    events = []

    def run_everywhere(build, c, steps, warmup, group, loss_of=None, world_one=False):
        assert events == ["enter"] and c["seq_len"] == 32768 and loss_of == group.global_mean
        events.append("run")
        return made_up("pytorch_cp_eager")

    group = TwoRanks()
    group.global_mean = lambda loss: loss
    monkeypatch.setattr(cp_step_peer, "CPBatch", FakeBatch)
    monkeypatch.setattr(cp_step_peer, "context_parallel", fake_context_parallel(events), raising=False)
    monkeypatch.setattr(cp_step_peer.peer, "run_everywhere", run_everywhere)
    result, why = cp_step_peer.run_cp_row("pytorch_cp_eager", cp_step_peer.CONFIGS["long"], 3, 1, group, None, "mesh")
    assert why is None and result["first_losses"] == [9.0210, 9.0160]
    assert events == ["enter", "run", "exit"]  # SDPA patched only around the row


@pytest.mark.parametrize("refuse, rank_1_error, why", [
    (True, None, "rank 0: context_parallel: ValueError: `seq_dims` must have the same number of elements"),
    (False, "context_parallel: RuntimeError: y", "rank 1: context_parallel: RuntimeError: y"),
])
def test_a_refused_context_is_the_rows_reason_on_every_rank(monkeypatch, refuse, rank_1_error, why):
    events = []
    monkeypatch.setattr(cp_step_peer, "CPBatch", FakeBatch)
    monkeypatch.setattr(cp_step_peer, "context_parallel", fake_context_parallel(events, refuse), raising=False)
    monkeypatch.setattr(cp_step_peer.peer, "run_everywhere", lambda *a, **k: pytest.fail("no rank may build"))
    result, got = cp_step_peer.run_cp_row("pytorch_cp_eager", cp_step_peer.CONFIGS["long"], 3, 1,
                                          TwoRanks(rank_1_error), None, "mesh")
    assert result is None and got.startswith(why)
    assert events == ([] if refuse else ["enter", "exit"])  # a context entered is left


@pytest.fixture(scope="module")
def step_bench_cp2(tmp_path_factory):
    """step_bench --cp 2 --profile over two host processes (the tiny GPT), its config renamed to "long" with
    long's shape."""
    tmp = tmp_path_factory.mktemp("cp2")
    codes, logs = dp_test.run_world(tmp, 2, dp_test.HOST_FLAGS + ["--cp", "2", "--profile"])
    assert codes == [0, 0], logs
    data = json.loads((tmp / "rank0.json").read_text())
    c = data["configs"][0]
    assert c["context_parallel_rows"] and c["cp"] == 2
    header = cp_step_peer.config_header("long")
    c.update({k: header[k] for k in report.SHAPE_KEYS if k in header})
    c["name"] = "long"
    return data


# Our rows and the peer's with the same job.
PAIRS = (("stepgraph_eager_cp1", "pytorch_eager_cp1"), ("stepgraph_graph_cp1", "pytorch_cuda_graph_cp1"),
         ("stepgraph_eager_cp2", "pytorch_cp_eager"), ("stepgraph_graph_cp2", "pytorch_cp_compile_graph"))
PROFILE_ONLY = {"profile", "profile_exposed_comm_us", "profile_exposed_comm_fraction"}  # step_bench --profile's


def test_peer_rows_have_step_bench_cp_fields(step_bench_cp2, peer_config):
    ours = {s["system"]: set(s) for s in step_bench_cp2["configs"][0]["systems"]}
    theirs = {s["system"]: set(s) for s in peer_config["systems"]}
    for mine, peer in PAIRS:
        missing = ours[mine] - dp_test.STEPGRAPH_ONLY - PROFILE_ONLY - theirs[peer]
        assert not missing, f"{peer} lacks {sorted(missing)} of {mine}"
    header = set(step_bench_cp2["configs"][0])
    assert header <= set(peer_config), sorted(header - set(peer_config))
    for key in report.SHAPE_KEYS:  # what report.py compares between the files
        assert step_bench_cp2["configs"][0].get(key) == peer_config.get(key), key


def test_report_makes_the_cp_table_with_pytorch_rows(step_bench_cp2, peer_config, tmp_path):
    theirs = {"benchmark": "training_step", "source": "pytorch", "device": "test", "torch_version": "test",
              "configs": [peer_config]}
    configs, warnings = report.merge(copy.deepcopy(step_bench_cp2), theirs)
    assert warnings == [] and report.cp_world(configs[0]) == 2
    rows = report.table_rows(configs)
    assert [r[1] for r in rows] == ["stepgraph_eager_cp1", "stepgraph_graph_cp1", "pytorch_eager_cp1",
                                    "pytorch_cuda_graph_cp1", "stepgraph_eager_cp2", "stepgraph_graph_cp2",
                                    "pytorch_cp_eager", "pytorch_cp_compile", "pytorch_cp_cuda_graph",
                                    "pytorch_cp_compile_graph"]
    assert all(len(r) == len(report.HEADER) + 1 for r in rows)
    by_name = {r[1]: r for r in rows}
    systems = configs[0]["systems"]

    def ours(name):
        return systems[name]["step_us"]["median_us"]

    # ours / PyTorch: eager against our eager, compiled or captured against our graphed step, of the same cp.
    assert by_name["pytorch_eager_cp1"][-1] == f"{ours('stepgraph_eager_cp1') / 1050:.2f}x (stepgraph_eager_cp1)"
    assert by_name["pytorch_cuda_graph_cp1"][-1] == f"{ours('stepgraph_graph_cp1') / 920:.2f}x (stepgraph_graph_cp1)"
    assert by_name["pytorch_cp_eager"][-1] == f"{ours('stepgraph_eager_cp2') / 1300:.2f}x (stepgraph_eager_cp2)"
    compiled = systems["pytorch_cp_compile"]["step_us"]["median_us"]
    assert by_name["pytorch_cp_compile"][-1] == f"{ours('stepgraph_graph_cp2') / compiled:.2f}x (stepgraph_graph_cp2)"
    assert by_name["pytorch_cp_compile_graph"][-1] == \
        f"{ours('stepgraph_graph_cp2') / 1100:.2f}x (stepgraph_graph_cp2)"
    assert by_name["pytorch_cp_cuda_graph"][2].startswith("failed: rank 0: CaptureFailed: capture failed")
    assert by_name["pytorch_cp_cuda_graph"][-1] == "-"
    assert {by_name[n][-1] for n in by_name if n.startswith("stepgraph")} == {"-"}
    # The speedup column still divides by our eager CP=2 row.
    assert by_name["pytorch_cp_eager"][4] == f"{ours('stepgraph_eager_cp2') / 1300:.2f}x"
    # The goal is ours alone, as without the peer's file.
    ((verdict, name, goal, detail),) = report.goals(configs)
    efficiency = systems["stepgraph_graph_cp2"]["efficiency"]
    assert name == "long" and goal.startswith("graphed CP=2 efficiency >= 0.9")
    ratio = systems["stepgraph_graph_cp2"]["step_time_ratio"]
    assert verdict == ("PASS" if efficiency >= 0.9 else "FAIL")
    assert detail == f"{efficiency:.3f} (step time ratio {ratio:.3f})"
    a, b, md = tmp_path / "ours.json", tmp_path / "theirs.json", tmp_path / "cp.md"
    a.write_text(json.dumps(step_bench_cp2))
    b.write_text(json.dumps(theirs))
    assert report.main([str(a), str(b), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "| pipelined step ms | ours / PyTorch |" in text
    assert "| long | pytorch_cp_eager | 1.300 [1.300-1.310] |" in text
    assert "long pytorch_cp_compile: 9.0210 9.0160" in text  # the first losses


def test_report_cp_table_without_the_peer_keeps_its_rows(step_bench_cp2):
    configs, _ = report.merge(copy.deepcopy(step_bench_cp2))
    rows = report.table_rows(configs)
    assert [r[1] for r in rows] == ["stepgraph_eager_cp1", "stepgraph_graph_cp1", "stepgraph_eager_cp2",
                                    "stepgraph_graph_cp2"]
    assert {r[-1] for r in rows} == {"-"}


def test_report_notes_a_peer_config_not_run(step_bench_cp2):
    not_run = dict(cp_step_peer.config_header("long"), status="not_run", reason="config 'long': x", systems=[],
                   context_parallel_rows=True, world_size=2)
    theirs = {"benchmark": "training_step", "source": "pytorch", "configs": [not_run]}
    configs, warnings = report.merge(copy.deepcopy(step_bench_cp2), theirs)
    assert warnings == []
    first = report.table_rows(configs)[0]
    assert first[1:3] == ["pytorch", "not_run: config 'long': x"] and len(first) == len(report.HEADER) + 1
    table = report.markdown_table(configs)
    assert table.count("\n") == 2 + len(report.table_rows(configs))
