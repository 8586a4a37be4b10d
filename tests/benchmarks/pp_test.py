"""step_bench --pp without a GPU: the tiny GPT's pipeline rows from two host processes launched with torchrun's
variables (two stages against each rank training the whole model alone on the same microbatches), eager against
graphed losses, the pipeline's first loss against one rank's, the theoretical bubble (P-1)/(M+P-1), and the flags
and configs it refuses. Interleaved stages (--virtual-stages 2) need 4 layers, which no host config has: tiny is
refused by name here, and pipeline_step_runner_test runs V = 2 on a 4-layer tiny."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dp_test  # noqa: E402  (step_bench over host processes)

BINARY = dp_test.BINARY
PP_FLAGS = dp_test.HOST_FLAGS + ["--pp", "2", "--microbatches", "4"]
RANK_1_OF_2 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
ROWS = ["stepgraph_eager_pp1", "stepgraph_graph_pp1", "stepgraph_eager_pp2", "stepgraph_graph_pp2"]


def test_two_host_processes_write_the_pipeline_rows(tmp_path):
    codes, logs = dp_test.run_world(tmp_path, 2, PP_FLAGS)
    assert codes == [0, 0], logs
    assert not (tmp_path / "rank1.json").exists(), "only rank 0 writes the JSON"
    data = json.loads((tmp_path / "rank0.json").read_text())
    pp = data["pipeline_parallel"]
    assert pp["world_size"] == 2 and pp["virtual_stages"] == 1 and pp["microbatches"] == 4
    assert pp["schedule"] == "1F1B" and pp["launcher"] == "torchrun" and "host" in pp["communicator"]
    assert pp["multicast_env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                   "NVSHMEM_DISABLE_NVLS": "1"}
    assert "measured_bubble_fraction" in pp["formulas"] and "one sequence" in pp["global_batch"]

    (c,) = data["configs"]
    assert c["status"] == "ok" and c["pp"] == 2 and c["microbatches"] == 4
    assert c["tokens"] == 4 * 32 and c["global_batch"].startswith("4 microbatches of one sequence of 32 tokens")
    assert c["theoretical_bubble_fraction"] == pytest.approx((2 - 1) / (4 + 2 - 1))
    rows = {s["system"]: s for s in c["systems"]}
    assert list(rows) == ROWS

    # Eager and graphed losses agree, every rank logs the same loss, and the pipeline's is one rank's.
    check = c["loss_check"]
    assert check["compared"] == ["stepgraph_eager_pp2", "stepgraph_graph_pp2"]
    assert check["identical"] and check["ranks_agree"], check
    assert check["stepgraph_eager_pp2"] == check["stepgraph_graph_pp2"] == check["stepgraph_eager_pp1"]
    assert c["pp_loss_check"]["eager"]["identical"] and c["pp_loss_check"]["graph"]["identical"]

    for mode in ("eager", "graph"):
        alone, pipe = rows[f"stepgraph_{mode}_pp1"], rows[f"stepgraph_{mode}_pp2"]
        assert alone["pp"] == 1 and alone["measured_bubble_fraction"] is None
        assert pipe["pp"] == 2 and pipe["baseline_system"] == alone["system"] and len(pipe["rank_median_us"]) == 2
        measured = 1 - alone["step_us"]["median_us"] / (2 * pipe["step_us"]["median_us"])
        assert pipe["measured_bubble_fraction"] == pytest.approx(measured)
        assert pipe["theoretical_bubble_fraction"] == pytest.approx(1 / 5)
        assert pipe["bubble_ratio"] == pytest.approx(measured * 5)
    graph, eager = rows["stepgraph_graph_pp2"], rows["stepgraph_eager_pp2"]
    assert graph["graph_speedup_vs_eager"] == pytest.approx(eager["step_us"]["median_us"] /
                                                            graph["step_us"]["median_us"])
    # Each rank plans its own stage: its pool against its own lower bound.
    assert len(graph["rank_pool_bytes"]) == 2 and all(r >= 1.0 for r in graph["rank_pool_ratio"])
    assert "bubble" in logs[0] and "bubble" not in logs[1]  # rank 0 prints
    assert "step_bench --pp: tiny pp2 graph" in logs[0]  # progress lines


def test_world_of_one_runs_the_baseline_rows(tmp_path):
    out = tmp_path / "pp1.json"
    done = subprocess.run([BINARY, *dp_test.HOST_FLAGS, "--pp", "1", "--microbatches", "2", "--out", str(out)],
                          env=dp_test.clean_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "NOTE: world size 1: the pp1 rows alone" in done.stdout
    (c,) = json.loads(out.read_text())["configs"]
    assert [s["system"] for s in c["systems"]] == ROWS[:2] and c["loss_check"]["identical"]


@pytest.mark.parametrize(
    "flags, env, message",
    [
        (["--pp", "2"], {}, "--pp 2 needs 2 ranks"),
        (["--pp", "2", "--dp", "2"], {}, "--pp together with --dp, --tp or --cp is not benchmarked yet"),
        (["--pp", "2", "--tp", "2"], {}, "--pp together with --dp, --tp or --cp is not benchmarked yet"),
        (["--pp", "2", "--cp", "2"], {}, "--pp together with --dp, --tp or --cp is not benchmarked yet"),
        (["--pp", "-1"], {}, "--pp must be the number of ranks"),
        (["--virtual-stages", "2"], {}, "--virtual-stages and --microbatches are the pipeline's: they need --pp P"),
        (["--microbatches", "4"], {}, "--virtual-stages and --microbatches are the pipeline's: they need --pp P"),
        (["--pp", "2", "--virtual-stages", "2"], RANK_1_OF_2,
         "config tiny has 2 layers, which do not divide by --pp x --virtual-stages = 4"),
        (["--pp", "2", "--virtual-stages", "0"], RANK_1_OF_2, "--virtual-stages must be >= 1"),
        (["--pp", "2", "--microbatches", "0"], RANK_1_OF_2, "--microbatches must be >= 1"),
        (["--pp", "2", "--dropout", "0.1"], RANK_1_OF_2, "--pp: --fp8, --dropout, --skip-nonfinite"),
        (["--pp", "2", "--skip-nonfinite"], RANK_1_OF_2, "--pp: --fp8, --dropout, --skip-nonfinite"),
    ],
)
def test_step_bench_refuses_pp_flags_it_cannot_run(flags, env, message):
    done = subprocess.run([BINARY, *dp_test.HOST_FLAGS, *flags], env=dp_test.clean_env(**env), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


def test_step_bench_pp_refuses_an_moe_config_before_any_rank_starts():
    env = dp_test.clean_env(**RANK_1_OF_2)
    done = subprocess.run([BINARY, "--device", "cuda", "--configs", "large,moe", "--pp", "2"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--pp 2: config moe is not a dense GPT" in done.stderr and "leave it out of --configs" in done.stderr
