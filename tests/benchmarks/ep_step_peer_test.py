"""ep_step_peer.py without a GPU or torch: its config table, the experts each rank keeps, the split sizes it reads
from the host counts, its flag checks, and how it assembles a config's rows (the ranks' timings and losses made up):
the efficiency against the ep1 rows, the first loss against the ranks' mean alone, a failed baseline, the budget and
a world of one; its rows' and header's fields against step_bench --ep 2's (two host processes, moe_tiny), and
report.py's EP table and goals over both files."""

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
import ep_step_peer  # noqa: E402
import pytorch_peer  # noqa: E402
import report  # noqa: E402


def test_configs_are_the_configs_with_experts():
    assert ep_step_peer.CONFIGS == ("moe",)
    c = pytorch_peer.CONFIGS["moe"]
    assert (c["hidden"], c["experts"], c["topk"], c["moe_every"], c["tokens"]) == (2048, 8, 2, 1, 8192)
    assert ep_step_peer.check_config("moe", 2) is None and ep_step_peer.check_config("moe", 8) is None
    assert ep_step_peer.check_config("medium", 2).startswith("config 'medium' has no experts")
    assert ep_step_peer.check_config("moe", 3) == "config 'moe': its 8 experts do not divide by the 3 ranks"


def test_each_rank_keeps_its_share_of_the_experts():
    assert ep_step_peer.local_experts(0, 2, 8) == (0, 4) and ep_step_peer.local_experts(1, 2, 8) == (4, 8)
    assert ep_step_peer.local_experts(3, 4, 8) == (6, 8) and ep_step_peer.local_experts(0, 1, 8) == (0, 8)


def test_split_sizes_from_the_host_counts():
    # counts[p][e]: rank p's rows for expert e (2 ranks, 4 experts: rank 0 owns experts 0 and 1).
    counts = [[5, 1, 0, 2], [3, 3, 4, 0]]
    assert ep_step_peer.split_sizes(counts, 0, 2) == ([6, 2], [6, 6])  # sends 6 home, 2 to rank 1; receives 6 + 6
    assert ep_step_peer.split_sizes(counts, 1, 2) == ([6, 4], [2, 4])
    # Every row sent is received: the sizes of a world agree.
    sends = [ep_step_peer.split_sizes(counts, r, 2)[0] for r in range(2)]
    recvs = [ep_step_peer.split_sizes(counts, r, 2)[1] for r in range(2)]
    assert all(sends[p][q] == recvs[q][p] for p in range(2) for q in range(2))
    assert ep_step_peer.split_sizes([[0] * 8] * 4, 2, 4) == ([0] * 4, [0] * 4)  # a world with no rows


def test_rows_and_names():
    assert ep_step_peer.rows_of(2) == ["pytorch_eager_ep1", "pytorch_compile_ep1", "pytorch_eager_ep2",
                                       "pytorch_compile_ep2"]
    assert ep_step_peer.rows_of(1) == ["pytorch_eager_ep1", "pytorch_compile_ep1"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--configs", "medium"], "config 'medium' has no experts"),
        (["--configs", "moe,moe"], "a config is listed twice"),
        (["--systems", "graph_epN"], "unknown system 'graph_epN'"),
        (["--steps", "0"], "--steps and --warmup must be >= 1"),
        (["--timeout-s", "0"], "--timeout-s must be positive"),
    ],
)
def test_flags_are_checked_before_torch(flags, message):
    with pytest.raises(SystemExit, match=message):
        ep_step_peer.main(flags)


def test_flags_keep_the_baselines_first():
    args = ep_step_peer.parse_flags(["--systems", "eager_epN,eager_ep1", "--quick"])
    assert args.systems == ["eager_ep1", "eager_epN"] and (args.steps, args.warmup) == (20, 5)
    assert ep_step_peer.parse_flags([]).systems == list(ep_step_peer.KINDS)
    assert ep_step_peer.parse_flags([]).configs == ["moe"]


def test_bad_launcher_variables_are_refused_before_torch(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    for name in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match="ep_step_peer: launcher variables partly set"):
        ep_step_peer.main([])


def test_multicast_stays_off_before_torch():
    for name, value in ep_step_peer.peer.MULTICAST_ENV.items():
        assert os.environ[name] == value


def raw(samples, first_losses):
    """time_system's numbers of one rank, made up."""
    return {"samples_us": samples, "pipelined_step_us": min(samples), "peak_bytes": 1000,
            "device_used_delta_bytes": 2000, "final_loss": first_losses[-1] - 0.1, "first_losses": list(first_losses),
            "extra": {"wall_s": 2.0}}


class FakeGroup:
    """Rank 0 of `world`, without a process group."""

    rank = 0

    def __init__(self, world=2):
        self.world = world

    def agree(self, value):
        return value

    def gather(self, value):
        return [value] * self.world

    def global_mean(self, loss):
        return loss


# Each rank's made-up step times (us) and first losses per row: alone each rank trains its own batch (9.0, 9.2);
# expert parallel, every rank logs the group's mean.
TIMES = {
    "pytorch_eager_ep1": ([[1000, 1000, 1000], [1000, 1050, 1000]], [[9.0, 8.9], [9.2, 9.1]]),
    "pytorch_compile_ep1": ([[800, 800, 800], [800, 800, 820]], [[9.0, 8.9], [9.2, 9.1]]),
    "pytorch_eager_ep2": ([[1250, 1250, 1250], [1250, 1300, 1250]], [[9.1, 9.0], [9.1, 9.0]]),
    "pytorch_compile_ep2": ([[1000, 1000, 1000], [1000, 1000, 1000]], [[9.1004, 9.0], [9.1004, 9.0]]),
}


def run_config(monkeypatch, refused=(), world=2, deadline=math.inf, rows=None):
    """run_ep_config with made-up rows: (the config's JSON, the rows built in order)."""
    built = []
    order = rows or ep_step_peer.rows_of(world)

    def run_everywhere(build, c, steps, warmup, group, loss_of=None, world_one=False):
        assert callable(build) and world_one == (group.world == 1) and (steps, warmup) == (3, 1)
        row = [r for r in order if r not in built][0]
        assert (loss_of is not None) == (world > 1 and row.endswith(f"ep{world}"))
        built.append(row)
        if row in refused:
            return None, f"rank 1: RuntimeError: {row} broke"
        samples, losses = TIMES[row]
        return pytorch_peer.combine_ranks([raw(s, l) for s, l in zip(samples, losses)]), None

    monkeypatch.setattr(ep_step_peer.peer, "run_everywhere", run_everywhere)
    out = ep_step_peer.run_ep_config("moe", order, 3, 1, deadline, FakeGroup(world))
    json.dumps(out)  # what rank 0 writes
    return out, built


def test_rows_efficiency_and_loss_checks(monkeypatch):
    c, built = run_config(monkeypatch)
    assert built == ep_step_peer.rows_of(2)
    assert c["status"] == "ok" and (c["world_size"], c["ep"], c["experts_per_rank"]) == (2, 2, 4)
    assert c["global_tokens"] == 2 * 8192
    rows = {s["system"]: s for s in c["systems"]}
    base, eager = rows["pytorch_eager_ep1"], rows["pytorch_eager_ep2"]
    assert base["step_us"]["median_us"] == 1000 and base["scaling_efficiency"] is None
    assert (base["world_size"], base["ep"], base["experts_per_rank"]) == (1, 1, 8)
    assert (eager["world_size"], eager["ep"], eager["experts_per_rank"]) == (2, 2, 4)
    assert eager["baseline_system"] == "pytorch_eager_ep1" and eager["step_us"]["median_us"] == 1250
    assert eager["scaling_efficiency"] == pytest.approx(0.8)
    assert eager["exposed_comm_us"] == pytest.approx(250) and eager["exposed_comm_fraction"] == pytest.approx(0.2)
    assert eager["global_tokens_per_s"] == pytest.approx(2 * 8192 / 1250e-6)
    assert eager["tflops"] == pytest.approx(pytorch_peer.step_flops(pytorch_peer.CONFIGS["moe"]) / 1250e-6 / 1e12)
    assert eager["rank_first_loss"] == [9.1, 9.1] and eager["rank_median_us"] == [1250, 1250]
    compiled = rows["pytorch_compile_ep2"]
    assert compiled["baseline_system"] == "pytorch_compile_ep1"
    assert compiled["scaling_efficiency"] == pytest.approx(800 / 1000)  # the slowest rank's samples: 800, 800, 820
    check = c["ep_loss_check"]
    assert check["eager"]["baseline_rank_first_losses"] == [9.0, 9.2]
    assert check["eager"]["baseline_mean_first_loss"] == pytest.approx(9.1)
    assert check["eager"]["ep_first_loss"] == 9.1 and check["eager"]["agrees"]
    assert check["compile"]["agrees"]  # 4e-4 off, within EP_LOSS_TOLERANCE
    assert c["loss_check"]["compared"] == ["pytorch_eager_ep2", "pytorch_compile_ep2"]
    assert c["loss_check"]["max_abs_diff"] == pytest.approx(0.0004)
    assert ep_step_peer.failures({"configs": [c]}) == []
    assert "efficiency 0.800" in ep_step_peer.describe("moe", eager)


def test_progress_after_every_row(monkeypatch):
    seen = []
    monkeypatch.setattr(ep_step_peer.peer, "run_everywhere", lambda *a, **k: (None, "rank 0: RuntimeError: x"))
    ep_step_peer.run_ep_config("moe", ep_step_peer.rows_of(2), 3, 1, math.inf, FakeGroup(2),
                               progress=lambda c: seen.append([s["system"] for s in c["systems"]]))
    rows = ep_step_peer.rows_of(2)
    assert seen == [rows[:i + 1] for i in range(len(rows))]


def test_a_first_loss_off_the_ranks_mean_disagrees():
    base = {"rank_first_loss": [9.0, 9.2]}
    assert not ep_step_peer.ep_loss_check(base, {"first_losses": [9.2]})["agrees"]
    assert ep_step_peer.ep_loss_check(base, {"first_losses": [9.1005]})["agrees"]


def test_a_failed_baseline_leaves_no_efficiency(monkeypatch):
    c, _ = run_config(monkeypatch, refused=("pytorch_eager_ep1",))
    rows = {s["system"]: s for s in c["systems"]}
    assert rows["pytorch_eager_ep1"]["status"] == "failed"
    eager = rows["pytorch_eager_ep2"]
    assert eager["scaling_efficiency"] is None and eager["reason"] == "no scaling: pytorch_eager_ep1 did not run"
    assert "eager" not in c["ep_loss_check"] and "compile" in c["ep_loss_check"]
    assert ep_step_peer.failures({"configs": [c]}) == ["moe/pytorch_eager_ep1"]


def test_world_of_one_runs_the_ep1_rows_alone(monkeypatch):
    c, built = run_config(monkeypatch, world=1)
    assert built == ["pytorch_eager_ep1", "pytorch_compile_ep1"]
    assert c["experts_per_rank"] == 8 and c["ep_loss_check"] == {}
    assert c["loss_check"]["compared"] == ["pytorch_eager_ep1", "pytorch_compile_ep1"]


def test_budget_spent_runs_nothing(monkeypatch):
    c, built = run_config(monkeypatch, deadline=0.0)
    assert built == [] and all(s["status"] == "not_run" for s in c["systems"])
    assert c["status"] == "failed" and c["reason"] == "no row ran"


def test_a_config_whose_experts_do_not_split_runs_nothing(monkeypatch):
    monkeypatch.setattr(ep_step_peer.peer, "run_everywhere", lambda *a, **k: pytest.fail("nothing may run"))
    out = ep_step_peer.run_ep_config("moe", ep_step_peer.rows_of(3), 3, 1, math.inf, FakeGroup(3))
    assert out["status"] == "not_run" and "do not divide by the 3 ranks" in out["reason"]
    assert ep_step_peer.failures({"configs": [out]}) == [f"moe: {out['reason']}"]


@pytest.fixture(scope="module")
def step_bench_ep2(tmp_path_factory):
    """step_bench --ep 2 over two host processes (moe_tiny): its JSON."""
    tmp = tmp_path_factory.mktemp("ep2")
    flags = ["--device", "host", "--configs", "moe_tiny", "--steps", "2", "--warmup", "2", "--ep", "2"]
    codes, logs = dp_test.run_world(tmp, 2, flags)
    assert codes == [0, 0], logs
    return json.loads((tmp / "rank0.json").read_text())


PAIRS = (("stepgraph_eager_ep1", "pytorch_eager_ep1"), ("stepgraph_eager_ep2", "pytorch_eager_ep2"),
         ("stepgraph_graph_ep2", "pytorch_compile_ep2"))


def test_peer_rows_have_step_bench_ep_fields(step_bench_ep2, monkeypatch):
    stepgraph = step_bench_ep2["configs"][0]
    peer, _ = run_config(monkeypatch)
    ours = {s["system"]: set(s) for s in stepgraph["systems"]}
    theirs = {s["system"]: set(s) for s in peer["systems"]}
    for a, b in PAIRS:
        missing = ours[a] - dp_test.STEPGRAPH_ONLY - theirs[b]
        assert not missing, f"{b} lacks {sorted(missing)} of {a}"
    assert set(stepgraph) <= set(peer), sorted(set(stepgraph) - set(peer))
    assert set(stepgraph["ep_loss_check"]["graph"]) <= set(peer["ep_loss_check"]["compile"])


def test_header_has_step_bench_ep_fields(step_bench_ep2, monkeypatch):
    monkeypatch.setattr(ep_step_peer.peer, "result_header", lambda *a: {"benchmark": "training_step"})
    monkeypatch.setattr(ep_step_peer.peer, "comm_nccl_version", lambda: "test")
    result = ep_step_peer.result_json(ep_step_peer.parse_flags([]), 0, 2, 2, "torchrun")
    peer, ours = result["expert_parallel"], step_bench_ep2["expert_parallel"]
    # Ours names its communicator and the transport of its captured exchange; the peer, PyTorch's exchange.
    own = {"communicator", "exchange_transport", "exchange_transport_reason"}
    assert set(ours) - own <= set(peer), sorted(set(ours) - own - set(peer))
    assert set(ours["formulas"]) <= set(peer["formulas"])
    assert peer["world_size"] == 2 and peer["note"] == "" and ".tolist()" in peer["exchange"]
    assert result["configs"] == []


def moe_named(step_bench_ep2):
    """step_bench --ep 2's JSON with its moe_tiny config renamed moe, with moe's shape (what report.py compares)."""
    data = copy.deepcopy(step_bench_ep2)
    c = data["configs"][0]
    assert c["expert_parallel_rows"] and c["ep"] == 2
    header = pytorch_peer.config_header("moe")
    c.update({k: header[k] for k in report.SHAPE_KEYS if k in header})
    c["name"] = "moe"
    return data


def test_report_makes_the_ep_table_and_goals(step_bench_ep2, monkeypatch, tmp_path):
    peer, _ = run_config(monkeypatch)
    assert peer["expert_parallel_rows"]
    theirs = {"benchmark": "training_step", "source": "pytorch", "device": "test", "torch_version": "test",
              "configs": [peer]}
    ours = moe_named(step_bench_ep2)
    configs, warnings = report.merge(copy.deepcopy(ours), theirs)
    assert warnings == [] and report.ep_world(configs[0]) == 2
    rows = report.table_rows(configs)
    assert [r[1] for r in rows] == ["stepgraph_eager_ep1", "stepgraph_graph_ep1", "pytorch_eager_ep1",
                                    "pytorch_compile_ep1", "stepgraph_eager_ep2", "stepgraph_graph_ep2",
                                    "pytorch_eager_ep2", "pytorch_compile_ep2"]
    systems = configs[0]["systems"]
    graph = systems["stepgraph_graph_ep2"]
    by_name = {r[1]: r for r in rows}
    # The speedup column divides by our eager EP=2 row.
    eager_us = systems["stepgraph_eager_ep2"]["step_us"]["median_us"]
    assert by_name["pytorch_eager_ep2"][4] == f"{eager_us / 1250:.2f}x"
    (v1, n1, g1, d1), (v2, n2, g2, d2) = report.goals(configs)
    assert n1 == n2 == "moe" and g1.startswith("graphed EP=2 efficiency >= 0.9")
    assert v1 == ("PASS" if graph["scaling_efficiency"] >= 0.9 else "FAIL")
    assert d1.startswith(f"{graph['scaling_efficiency']:.3f} (exposed communication")
    # Against the fastest PyTorch EP row: the compiled one's made-up 1000 us.
    value = 1000 / graph["step_us"]["median_us"]
    assert g2 == "graphed EP=2 step >= 1.3x faster than the fastest PyTorch EP=2 row"
    assert v2 == ("PASS" if value >= 1.3 else "FAIL") and d2.startswith(f"{value:.2f}x pytorch_compile_ep2")
    a, b, md = tmp_path / "ours.json", tmp_path / "theirs.json", tmp_path / "ep.md"
    a.write_text(json.dumps(ours))
    b.write_text(json.dumps(theirs))
    assert report.main([str(a), str(b), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "| moe | pytorch_eager_ep2 | 1.250 [1.250-1.300] |" in text and "graphed EP=2 step >= 1.3x" in text


def test_report_ep_goals_without_the_peer(step_bench_ep2):
    configs, _ = report.merge(moe_named(step_bench_ep2))
    (_, _, _, _), (verdict, _, goal, detail) = report.goals(configs)
    assert verdict == "NOT MEASURED" and "every PyTorch EP row" in detail
    assert report.mfu_lines(configs) == []  # no single-GPU MFU line for a parallel table
