"""pp_step_peer.py without a GPU or torch: its config table against pytorch_peer's, the layer split of P stages x
V virtual stages (Megatron's layout), the theoretical and measured bubbles, its flag checks, and how it assembles a
config's rows (the ranks' timings, peaks and losses made up): the bubbles against the pp1 baselines, the first losses
against one GPU's, a refused or accepted whole-step capture, the budget and a world of one rank."""

import json
import math
import os
import sys

import pytest

HERE = os.path.join(os.environ.get("TEST_SRCDIR", ""), os.environ.get("TEST_WORKSPACE", ""))
sys.path.insert(0, os.path.join(HERE, "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dp_test  # noqa: E402  (step_bench over host processes)
import pp_step_peer  # noqa: E402
import pytorch_peer  # noqa: E402

# hidden, heads, layers, seq_len: benchmarks/step_configs.cc (as tests/benchmarks/tp_step_peer_test.py)
STEP_CONFIGS = {"small": (512, 8, 8, 256), "medium": (2048, 16, 8, 2048), "large": (4096, 32, 4, 4096)}


def test_configs_are_step_bench_dense_configs():
    assert pp_step_peer.CONFIGS == tuple(STEP_CONFIGS)
    for name, (hidden, heads, layers, seq_len) in STEP_CONFIGS.items():
        c = pytorch_peer.CONFIGS[name]
        assert (c["hidden"], c["heads"], c["layers"], c["seq_len"], c["experts"]) == (hidden, heads, layers, seq_len, 0)
    assert "no pipeline-parallel PyTorch peer" in pp_step_peer.check_config("moe", 2, 1, 8)


def test_header_is_the_global_batch_of_microbatches_of_one_sequence():
    header, one_gpu = pp_step_peer.config_header("medium", 8), pytorch_peer.config_header("medium")
    assert set(one_gpu) <= set(header)
    assert (header["tokens"], header["sequences"], header["seq_len"]) == (8 * 2048, 8, 2048)
    assert (header["microbatches"], header["microbatch_sequences"], header["microbatch_tokens"]) == (8, 1, 2048)
    assert header["global_batch"].startswith("8 microbatches of one sequence of 2048 tokens each: 16384 tokens")
    batch = pp_step_peer.batch_config(pytorch_peer.CONFIGS["medium"], 8)
    assert header["flops_per_step"] == pytorch_peer.step_flops(batch)
    # Eight sequences of 2048 against pytorch_peer's two: four times the GEMMs and the attention core.
    assert header["flops_per_step"] == pytest.approx(4 * one_gpu["flops_per_step"])
    assert header["attention_core_flops_per_step"] == pytest.approx(4 * one_gpu["attention_core_flops_per_step"])
    differ = {k for k in one_gpu if header[k] != one_gpu[k]}
    assert differ == {"tokens", "sequences", "attention_core_flops_per_step", "flops_per_step"}
    mb = pp_step_peer.microbatch_config(pytorch_peer.CONFIGS["large"])
    assert (mb["sequences"], mb["tokens"], mb["seq_len"]) == (1, 4096, 4096)


def test_megatron_layout_of_chunks():
    assert pp_step_peer.rank_chunks(0, 2, 1) == [0] and pp_step_peer.rank_chunks(1, 2, 1) == [1]
    assert pp_step_peer.rank_chunks(0, 2, 2) == [0, 2] and pp_step_peer.rank_chunks(1, 2, 2) == [1, 3]
    assert pp_step_peer.rank_chunks(3, 4, 2) == [3, 7]
    assert pp_step_peer.stage_split(8, 2, 1) == [
        [{"chunk": 0, "blocks": [0, 4], "embedding": True, "head": False}],
        [{"chunk": 1, "blocks": [4, 8], "embedding": False, "head": True}],
    ]
    assert pp_step_peer.stage_split(8, 2, 2) == [
        [{"chunk": 0, "blocks": [0, 2], "embedding": True, "head": False},
         {"chunk": 2, "blocks": [4, 6], "embedding": False, "head": False}],
        [{"chunk": 1, "blocks": [2, 4], "embedding": False, "head": False},
         {"chunk": 3, "blocks": [6, 8], "embedding": False, "head": True}],
    ]


@pytest.mark.parametrize("layers, pp, virtual", [(8, 2, 1), (8, 2, 2), (8, 4, 2), (4, 2, 2), (8, 8, 1), (12, 2, 3)])
def test_chunks_cover_every_block_once(layers, pp, virtual):
    split = pp_step_peer.stage_split(layers, pp, virtual)
    chunks = sorted((c for rank in split for c in rank), key=lambda c: c["chunk"])
    assert [c["chunk"] for c in chunks] == list(range(pp * virtual))
    assert chunks[0]["blocks"][0] == 0 and chunks[-1]["blocks"][1] == layers
    assert all(a["blocks"][1] == b["blocks"][0] for a, b in zip(chunks, chunks[1:]))
    assert {c["blocks"][1] - c["blocks"][0] for c in chunks} == {layers // (pp * virtual)}
    assert [c["chunk"] for c in chunks if c["embedding"]] == [0]
    assert [c["chunk"] for c in chunks if c["head"]] == [pp * virtual - 1]
    for r, rank in enumerate(split):  # chunk c of rank r is model chunk c P + r
        assert [c["chunk"] for c in rank] == [v * pp + r for v in range(virtual)]


def test_configs_that_do_not_pipeline_say_why():
    for name in ("medium", "large"):
        for virtual in (1, 2):
            assert pp_step_peer.check_config(name, 2, virtual, 8) is None
    assert pp_step_peer.check_config("large", 2, 4, 8) == (
        "config 'large': its 4 layers do not split evenly into 2 stages x 4 virtual stages (8 model chunks); pass a "
        "--virtual-stages whose product with the stages divides 4")
    assert pp_step_peer.check_config("medium", 3, 1, 8).startswith("config 'medium': its 8 layers do not split")
    assert pp_step_peer.check_config("medium", 4, 1, 2) == (
        "--microbatches 2 is fewer than the 4 pipeline stages (1F1B needs at least one microbatch per stage)")
    assert pp_step_peer.check_config("medium", 2, 2, 7) == (
        "--microbatches 7 does not divide by the 2 pipeline stages, as the interleaved schedule needs with "
        "--virtual-stages > 1")
    assert pp_step_peer.check_config("medium", 2, 1, 7) is None  # 1F1B takes any M >= P


def test_bubbles():
    assert pp_step_peer.theoretical_bubble(2, 1, 8) == pytest.approx(1 / 9)
    assert pp_step_peer.theoretical_bubble(2, 2, 8) == pytest.approx(1 / 17)
    assert pp_step_peer.theoretical_bubble(4, 1, 8) == pytest.approx(3 / 11)
    assert pp_step_peer.theoretical_bubble(1, 1, 8) == 0
    # Two GPUs: the whole model's 1000 us on one GPU, 600 us pipelined: 200 of the 1200 GPU-us idle.
    assert pp_step_peer.measured_bubble(1000, 600, 2) == pytest.approx(1 / 6)
    assert pp_step_peer.measured_bubble(1000, 500, 2) == pytest.approx(0)
    assert pp_step_peer.schedule_name(1) == "Schedule1F1B"
    assert pp_step_peer.schedule_name(2) == "ScheduleInterleaved1F1B"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--configs", "moe"], "config 'moe' has no pipeline-parallel PyTorch peer"),
        (["--configs", "medium,huge"], "config 'huge' has no pipeline-parallel PyTorch peer"),
        (["--configs", "medium,medium"], "a config is listed twice"),
        (["--systems", "pytorch_tp_eager"], "unknown system 'pytorch_tp_eager'"),
        (["--microbatches", "0"], "--microbatches must be >= 1, got 0"),
        (["--virtual-stages", "0"], "--virtual-stages must be >= 1, got 0"),
        (["--steps", "0"], "--steps and --warmup must be >= 1"),
        (["--timeout-s", "0"], "--timeout-s must be positive"),
    ],
)
def test_flags_are_checked_before_torch(flags, message):
    with pytest.raises(SystemExit, match=message.replace("(", "\\(")):
        pp_step_peer.main(flags)


def test_flags_keep_the_rows_in_their_order():
    args = pp_step_peer.parse_flags(["--systems", "pytorch_pp_1f1b_graph,pytorch_pp1", "--configs", "large",
                                     "--virtual-stages", "2", "--microbatches", "4", "--quick"])
    assert args.systems == ["pytorch_pp1", "pytorch_pp_1f1b_graph"]  # the baseline first
    assert (args.configs, args.virtual_stages, args.microbatches, args.steps, args.warmup) == (["large"], 2, 4, 20, 5)
    defaults = pp_step_peer.parse_flags([])
    assert defaults.systems == list(pp_step_peer.ROWS) and defaults.configs == ["medium", "large"]
    assert (defaults.virtual_stages, defaults.microbatches) == (1, 8)


def test_bad_launcher_variables_are_refused_before_torch(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    for name in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match="pp_step_peer: launcher variables partly set"):
        pp_step_peer.main([])


def test_multicast_stays_off_before_torch():
    assert pp_step_peer.peer.MULTICAST_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                               "NVSHMEM_DISABLE_NVLS": "1"}
    for name, value in pp_step_peer.peer.MULTICAST_ENV.items():
        assert os.environ[name] == value


def raw(samples, first_losses, peak=1000):
    """time_system's numbers of one rank, made up."""
    return {"samples_us": samples, "pipelined_step_us": min(samples), "peak_bytes": peak,
            "device_used_delta_bytes": 2 * peak, "final_loss": first_losses[-1] - 0.1,
            "first_losses": list(first_losses), "extra": {"wall_s": 2.0}}


class FakeGroup:
    """Rank 0 of `world`, for run_pp_config without a process group; gather gives every rank this rank's value."""

    rank = 0

    def __init__(self, world=2):
        self.world = world

    def agree(self, value):
        return value

    def gather(self, value):
        return [value] * self.world


class FakeDraw:
    reference_loss = 9.0100


ONE_GPU_LOSS = FakeDraw.reference_loss
# Each rank's made-up step times (us) and first losses per row.
TIMES = {
    "pytorch_pp1": ([[2000, 2100, 2000], [2050, 2000, 2000]], [9.0100, 9.0050]),
    "pytorch_pp1_compile": ([[1800, 1800, 1850], [1800, 1820, 1800]], [9.0110, 9.0060]),
    "pytorch_pp_1f1b_eager": ([[1200, 1250, 1200], [1210, 1200, 1200]], [9.0100, 9.0050]),
    "pytorch_pp_1f1b_compile": ([[1000, 1000, 1000], [1000, 1100, 1000]], [9.0111, 9.0061]),
    "pytorch_pp_1f1b_graph": ([[1100, 1100, 1100], [1100, 1100, 1100]], [9.0100, 9.0050]),
}
CAPTURE_ERROR = ("rank 0: CaptureFailed: capture failed: RuntimeError: CUDA error: operation not permitted when "
                 "stream is capturing; rank 1: CaptureFailed: capture failed: RuntimeError: CUDA error: operation "
                 "not permitted when stream is capturing")


def made_up(row, refused=()):
    if row in refused:
        return None, CAPTURE_ERROR if row == pp_step_peer.PP_GRAPH else f"rank 1: RuntimeError: {row} broke"
    samples, losses = TIMES[row]
    return pytorch_peer.combine_ranks([raw(s, losses) for s in samples]), None


def run_config(monkeypatch, rows=None, refused=(), world=2, virtual=1, name="medium", deadline=math.inf, draws=None):
    """run_pp_config with made-up rows: (the config's JSON, the rows built, in order)."""
    built = []
    draws = [] if draws is None else draws

    def run_everywhere(build, c, steps, warmup, group, loss_of=None, world_one=False):
        assert callable(build) and world_one == (group.world == 1) and (steps, warmup) == (3, 1)
        assert c["tokens"] == 8 * c["seq_len"] and c["sequences"] == 8  # the global batch's FLOPs and tokens
        row = [r for r in (rows or pp_step_peer.ROWS) if r not in built and
               (group.world > 1 or not pp_step_peer.ROWS[r][0])][0]
        built.append(row)
        return made_up(row, refused)

    def draw_model(c, microbatches):
        draws.append((c, microbatches))
        return FakeDraw()

    monkeypatch.setattr(pp_step_peer.peer, "run_everywhere", run_everywhere)
    monkeypatch.setattr(pp_step_peer, "draw_model", draw_model)
    monkeypatch.setattr(pp_step_peer, "memory_mark", lambda: 100)
    monkeypatch.setattr(pp_step_peer, "row_memory",
                        lambda mark: {"peak_bytes": 1234, "device_used_delta_bytes": 5000 - mark})
    out = pp_step_peer.run_pp_config(name, list(rows or pp_step_peer.ROWS), 3, 1, deadline, FakeGroup(world), virtual,
                                     8)
    json.dumps(out)  # what rank 0 writes
    return out, built


def test_rows_bubbles_and_loss_checks(monkeypatch):
    c, built = run_config(monkeypatch)
    assert built == list(pp_step_peer.ROWS)
    assert c["status"] == "ok" and (c["world_size"], c["pp"], c["virtual_stages"]) == (2, 2, 1)
    assert c["schedule"] == "Schedule1F1B" and c["theoretical_bubble_fraction"] == pytest.approx(1 / 9)
    assert c["stages"] == pp_step_peer.stage_split(8, 2, 1) and c["blocks_per_chunk"] == 4
    rows = {s["system"]: s for s in c["systems"]}
    assert list(rows) == list(pp_step_peer.ROWS)
    base, eager, compiled = rows["pytorch_pp1"], rows["pytorch_pp_1f1b_eager"], rows["pytorch_pp_1f1b_compile"]
    assert base["step_us"]["median_us"] == 2050  # per sample the slowest rank: 2050, 2100, 2000
    assert (base["pp"], base["world_size"], base["schedule"], base["theoretical_bubble_fraction"]) == (1, 1, None, 0)
    assert base["measured_bubble_fraction"] is None and base["baseline_system"] is None and base["bubble_ratio"] is None
    assert eager["step_us"] == {"median_us": 1210, "min_us": 1200, "max_us": 1250}
    assert (eager["pp"], eager["world_size"], eager["virtual_stages"], eager["microbatches"]) == (2, 2, 1, 8)
    assert eager["schedule"] == "Schedule1F1B" and eager["theoretical_bubble_fraction"] == pytest.approx(1 / 9)
    assert eager["baseline_system"] == "pytorch_pp1" and eager["speedup_vs_pp1"] == pytest.approx(2050 / 1210)
    measured = 1 - 2050 / (2 * 1210)
    assert eager["measured_bubble_fraction"] == pytest.approx(measured)
    assert eager["bubble_ratio"] == pytest.approx(measured * 9)
    assert eager["pipelined_measured_bubble_fraction"] == pytest.approx(1 - 2000 / (2 * 1200))  # the minima here
    # The compiled pipeline against the compiled whole model: 1820 / (2 x 1000).
    assert compiled["baseline_system"] == "pytorch_pp1_compile"
    assert compiled["measured_bubble_fraction"] == pytest.approx(1 - 1820 / 2000)
    assert eager["rank_peak_bytes"] == [1234, 1234] and eager["peak_bytes"] == 1000
    assert eager["rank_device_used_delta_bytes"] == [4900, 4900]
    assert eager["rank_median_us"] == [1200, 1200] and eager["rank_first_loss"] == [9.0100, 9.0100]
    flops = pytorch_peer.step_flops(pp_step_peer.batch_config(pytorch_peer.CONFIGS["medium"], 8))
    assert c["flops_per_step"] == flops
    assert eager["tflops"] == pytest.approx(flops / 1210e-6 / 1e12 / 2)  # per GPU
    assert base["tflops"] == pytest.approx(flops / 2050e-6 / 1e12)
    assert eager["tokens_per_s"] == pytest.approx(8 * 2048 / 1210e-6)  # the global batch
    assert eager["tokens_per_s_per_gpu"] == pytest.approx(eager["tokens_per_s"] / 2)
    assert c["graph_capture"]["captured"] is True and c["graph_capture"]["error"] is None
    graph = rows["pytorch_pp_1f1b_graph"]
    assert graph["baseline_system"] == "pytorch_pp1" and graph["graph_speedup_vs_eager"] == pytest.approx(1210 / 1100)
    assert "graph_speedup_vs_eager" not in eager
    assert c["one_gpu_first_loss"] == ONE_GPU_LOSS
    check = c["pp_loss_check"]
    assert set(check) == set(pp_step_peer.ROWS) and all(d["agrees"] for d in check.values())
    assert check["pytorch_pp_1f1b_eager"]["rel_diff"] == 0 and eager["loss_rel_diff"] == 0
    assert compiled["loss_rel_diff"] == pytest.approx(0.0011 / ONE_GPU_LOSS)
    same = c["loss_check"]
    assert same["compared"] == list(pp_step_peer.PP_ROWS) and not same["identical"]
    assert same["max_abs_diff"] == pytest.approx(0.0011)
    assert pp_step_peer.failures({"configs": [c]}) == []


def test_a_refused_capture_is_a_failed_row_and_a_result(monkeypatch):
    c, built = run_config(monkeypatch, refused=(pp_step_peer.PP_GRAPH,))
    assert built == list(pp_step_peer.ROWS)
    graph = c["systems"][-1]
    assert graph == {"system": "pytorch_pp_1f1b_graph", "status": "failed", "reason": CAPTURE_ERROR}
    assert c["graph_capture"]["captured"] is False and c["graph_capture"]["error"] == CAPTURE_ERROR
    assert "refused" in c["graph_capture"]["what"]
    assert c["status"] == "ok" and pp_step_peer.failures({"configs": [c]}) == []
    assert "pytorch_pp_1f1b_graph" not in c["pp_loss_check"]


def test_a_failure_before_or_after_the_capture_is_not_called_a_refusal():
    summary = pp_step_peer.capture_summary("pytorch_pp_1f1b_graph", None, "rank 1: RuntimeError: out of memory")
    assert summary["captured"] is None and "before the capture" in summary["what"]
    replay = "rank 0: ReplayFailed: the pipelined step was captured, but its first replay's loss is nan"
    summary = pp_step_peer.capture_summary("pytorch_pp_1f1b_graph", None, replay)
    assert summary["captured"] is True and summary["error"] == replay and "no finite loss" in summary["what"]


def test_a_failed_baseline_counts_and_leaves_no_bubble(monkeypatch):
    c, _ = run_config(monkeypatch, refused=("pytorch_pp1", "pytorch_pp_1f1b_compile"))
    rows = {s["system"]: s for s in c["systems"]}
    assert rows["pytorch_pp1"]["status"] == "failed"
    eager = rows["pytorch_pp_1f1b_eager"]
    assert eager["measured_bubble_fraction"] is None and eager["baseline_system"] is None
    assert eager["reason"] == "no bubble measured: pytorch_pp1 did not run"
    # A pipeline PyTorch cannot compile is a result; a baseline that fails is not.
    assert pp_step_peer.failures({"configs": [c]}) == ["medium/pytorch_pp1"]


def test_interleaved_rows(monkeypatch):
    c, _ = run_config(monkeypatch, virtual=2, rows=["pytorch_pp1", "pytorch_pp_1f1b_eager"])
    eager = c["systems"][1]
    assert c["schedule"] == eager["schedule"] == "ScheduleInterleaved1F1B"
    assert eager["virtual_stages"] == 2 and eager["theoretical_bubble_fraction"] == pytest.approx(1 / 17)
    assert c["systems"][0]["virtual_stages"] == 1
    assert c["stages"] == pp_step_peer.stage_split(8, 2, 2)


def test_world_of_one_runs_the_pp1_rows_alone(monkeypatch):
    c, built = run_config(monkeypatch, world=1)
    assert built == ["pytorch_pp1", "pytorch_pp1_compile"]
    assert [s["system"] for s in c["systems"]] == built and c["graph_capture"] is None


def test_budget_spent_runs_and_draws_nothing(monkeypatch):
    draws = []
    c, built = run_config(monkeypatch, deadline=0.0, draws=draws)
    assert built == [] and draws == []
    assert all(s["status"] == "not_run" for s in c["systems"]) and len(c["systems"]) == len(pp_step_peer.ROWS)
    assert c["status"] == "failed" and c["reason"] == "no row ran"


def test_the_model_is_drawn_once_per_config(monkeypatch):
    draws = []
    run_config(monkeypatch, draws=draws)
    assert len(draws) == 1 and draws[0] == (pytorch_peer.CONFIGS["medium"], 8)


def test_a_config_that_does_not_split_runs_nothing(monkeypatch):
    monkeypatch.setattr(pp_step_peer.peer, "run_everywhere", lambda *a, **k: pytest.fail("nothing may run"))
    monkeypatch.setattr(pp_step_peer, "draw_model", lambda *a: pytest.fail("nothing may be drawn"))
    out = pp_step_peer.run_pp_config("large", list(pp_step_peer.ROWS), 3, 1, math.inf, FakeGroup(), 4, 8)
    assert out["status"] == "not_run" and "4 layers do not split evenly" in out["reason"] and out["systems"] == []
    assert pp_step_peer.failures({"configs": [out]}) == [f"large: {out['reason']}"]


def test_a_draw_that_fails_fails_the_config(monkeypatch):
    def draw_model(c, microbatches):
        raise MemoryError("CUDA out of memory")

    monkeypatch.setattr(pp_step_peer.peer, "run_everywhere", lambda *a, **k: pytest.fail("nothing may run"))
    monkeypatch.setattr(pp_step_peer, "draw_model", draw_model)
    out = pp_step_peer.run_pp_config("medium", list(pp_step_peer.ROWS), 3, 1, math.inf, FakeGroup(), 1, 8)
    assert out["status"] == "failed" and out["systems"] == []
    assert out["reason"] == ("drawing the model failed: rank 0: MemoryError: CUDA out of memory; rank 1: "
                             "MemoryError: CUDA out of memory")


def test_a_first_loss_off_one_gpu_disagrees():
    rows = {"pytorch_pp1": {"first_losses": [9.0]}, "pytorch_pp_1f1b_eager": {"first_losses": [9.1]}}
    _, check = pp_step_peer.loss_checks(rows, 9.0)
    assert check["pytorch_pp1"]["agrees"] and not check["pytorch_pp_1f1b_eager"]["agrees"]
    assert rows["pytorch_pp_1f1b_eager"]["loss_rel_diff"] == pytest.approx(0.1 / 9.0)
    _, none = pp_step_peer.loss_checks(rows, None)
    assert none == {}


@pytest.fixture(scope="module")
def step_bench_pp2(tmp_path_factory):
    """step_bench --pp 2 --microbatches 4 over two host processes (the tiny GPT): its JSON."""
    tmp = tmp_path_factory.mktemp("pp2")
    codes, logs = dp_test.run_world(tmp, 2, dp_test.HOST_FLAGS + ["--pp", "2", "--microbatches", "4"])
    assert codes == [0, 0], logs
    return json.loads((tmp / "rank0.json").read_text())


# Our rows and the peer's with the same job; the fields only StepGraph's rows have (its pools, persistent bytes and
# capture, per rank).
PAIRS = (("stepgraph_eager_pp1", "pytorch_pp1"), ("stepgraph_eager_pp2", "pytorch_pp_1f1b_eager"),
         ("stepgraph_graph_pp2", "pytorch_pp_1f1b_graph"))
STEPGRAPH_PP_ONLY = {"rank_persistent_bytes", "rank_pool_bytes", "rank_pool_lower_bound_bytes", "rank_pool_ratio",
                     "rank_capture_plus_instantiate_ms", "rank_capture_wall_ms"}


def test_peer_rows_have_step_bench_pp_fields(step_bench_pp2, monkeypatch):
    stepgraph = step_bench_pp2["configs"][0]
    peer, _ = run_config(monkeypatch)
    stepgraph_rows = {s["system"]: set(s) for s in stepgraph["systems"]}
    peer_rows = {s["system"]: set(s) for s in peer["systems"]}
    for ours, theirs in PAIRS:
        missing = stepgraph_rows[ours] - dp_test.STEPGRAPH_ONLY - STEPGRAPH_PP_ONLY - peer_rows[theirs]
        assert not missing, f"{theirs} lacks {sorted(missing)} of {ours}"
    assert set(stepgraph) <= set(peer), sorted(set(stepgraph) - set(peer))
    assert stepgraph["theoretical_bubble_fraction"] == pytest.approx(pp_step_peer.theoretical_bubble(2, 1, 4))
    assert stepgraph["blocks_per_chunk"] == 1  # tiny's 2 layers over 2 stages


def test_header_has_step_bench_pp_fields(step_bench_pp2, monkeypatch):
    monkeypatch.setattr(pp_step_peer.peer, "result_header", lambda *a: {"benchmark": "training_step"})
    monkeypatch.setattr(pp_step_peer.peer, "comm_nccl_version", lambda: "test")
    args = pp_step_peer.parse_flags(["--virtual-stages", "2", "--microbatches", "4"])
    result = pp_step_peer.result_json(args, 0, 2, 2, "torchrun")
    peer, ours = result["pipeline_parallel"], step_bench_pp2["pipeline_parallel"]
    # Ours names its NCCL or host communicators and its goal; the peer, PyTorch's process groups and NCCL version.
    assert set(ours) - {"communicator", "baseline_communicator", "goal"} <= set(peer), sorted(set(ours) - set(peer))
    assert (peer["world_size"], peer["pp"], peer["virtual_stages"], peer["microbatches"]) == (2, 2, 2, 4)
    assert "ScheduleInterleaved1F1B" in peer["schedule"] and peer["note"] == ""
    assert set(ours["formulas"]) <= set(peer["formulas"]), sorted(set(ours["formulas"]) - set(peer["formulas"]))
    assert result["configs"] == []
