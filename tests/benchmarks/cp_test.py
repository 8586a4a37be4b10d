"""step_bench --cp without a GPU: the tiny GPT's context-parallel rows from two host processes launched with
torchrun's variables (sequences twice as long over the two ranks against each rank training the config alone),
eager against graphed losses, the JSON's cp, seq_len and efficiency, and the flag checks."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dp_test  # noqa: E402  (step_bench over host processes)
import report  # noqa: E402

BINARY = dp_test.BINARY
HOST_FLAGS = dp_test.HOST_FLAGS
RANK_1_OF_2 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


def test_two_host_processes_write_the_context_parallel_rows(tmp_path):
    codes, logs = dp_test.run_world(tmp_path, 2, HOST_FLAGS + ["--cp", "2", "--profile"])
    assert codes == [0, 0], logs
    assert not (tmp_path / "rank1.json").exists(), "only rank 0 writes the JSON"
    data = json.loads((tmp_path / "rank0.json").read_text())
    cp = data["context_parallel"]
    assert cp["world_size"] == 2 and cp["launcher"] == "torchrun" and "efficiency" in cp["formulas"]
    assert cp["multicast_env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                   "NVSHMEM_DISABLE_NVLS": "1"}
    (c,) = data["configs"]
    assert c["status"] == "ok" and c["cp"] == 2 and c["seq_len"] == 32 and c["cp_seq_len"] == 64
    assert c["loss_check"]["identical"], c["loss_check"]
    assert c["loss_check"]["compared"] == ["stepgraph_eager_cp2", "stepgraph_graph_cp2"]
    rows = {s["system"]: s for s in c["systems"]}
    assert list(rows) == ["stepgraph_eager_cp1", "stepgraph_graph_cp1", "stepgraph_eager_cp2", "stepgraph_graph_cp2"]
    for name in ("stepgraph_eager_cp1", "stepgraph_graph_cp1"):
        assert rows[name]["cp"] == 1 and rows[name]["seq_len"] == 32 and rows[name]["efficiency"] is None
        assert rows[name]["step_time_ratio"] is None
    for name in ("stepgraph_eager_cp2", "stepgraph_graph_cp2"):
        s, base = rows[name], rows[name.replace("_cp2", "_cp1")]
        assert s["cp"] == 2 and s["seq_len"] == 64 and s["tokens"] == 2 * base["tokens"]
        assert s["baseline_system"] == base["system"]
        # Per-GPU TFLOP/s over the baseline's (the attention at each row's length), and the step time ratio.
        assert s["efficiency"] == pytest.approx(s["tflops"] / base["tflops"])
        assert s["step_time_ratio"] == pytest.approx(base["step_us"]["median_us"] / s["step_us"]["median_us"])
        assert s["efficiency"] > s["step_time_ratio"]  # the longer sequence does more work per token
        assert len(s["rank_median_us"]) == 2
    assert rows["stepgraph_graph_cp1"]["profile_exposed_comm_us"] == 0  # alone: no collective
    assert 0 < rows["stepgraph_graph_cp2"]["profile_exposed_comm_fraction"] < 1
    assert "efficiency" in logs[0] and "efficiency" not in logs[1]  # rank 0 prints

    # report.py makes the CP table in CP_SYSTEM_ORDER and judges the graphed cp2 row's efficiency.
    configs, warnings = report.merge(data)
    assert not warnings and report.cp_world(configs[0]) == 2
    assert [row[1] for row in report.table_rows(configs)] == list(rows)
    ((verdict, name, goal, detail),) = report.goals(configs)
    assert name == "tiny" and "graphed CP=2 efficiency >= 0.9" in goal
    efficiency = rows["stepgraph_graph_cp2"]["efficiency"]
    ratio = rows["stepgraph_graph_cp2"]["step_time_ratio"]
    assert verdict == ("PASS" if efficiency >= 0.9 else "FAIL")
    assert detail == f"{efficiency:.3f} (step time ratio {ratio:.3f})"


def test_world_of_one_runs_the_baseline_rows():
    done = subprocess.run([BINARY, *HOST_FLAGS, "--cp", "1"], env=dp_test.clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "NOTE: world size 1: the cp1 rows alone" in done.stdout


@pytest.mark.parametrize(
    "flags, env, message",
    [
        (["--cp", "2"], {}, "--cp 2 needs 2 ranks"),
        (["--cp", "2", "--tp", "2"], {}, "--cp together with --tp or --dp is not benchmarked yet"),
        (["--cp", "2", "--dp", "2"], {}, "--cp together with --tp or --dp is not benchmarked yet"),
        (["--cp", "-1"], {}, "--cp must be the number of ranks"),
        (["--cp", "2", "--step-scoped-gradients"], RANK_1_OF_2, "--step-scoped-gradients is not supported with --cp"),
        (["--cp", "2", "--dropout", "0.1"], RANK_1_OF_2, "--dropout is not supported with --cp"),
    ],
)
def test_step_bench_refuses_cp_flags_it_cannot_run(flags, env, message):
    done = subprocess.run([BINARY, *HOST_FLAGS, *flags], env=dp_test.clean_env(**env), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert message in done.stderr


def test_step_bench_cp_refuses_an_moe_config_before_any_rank_starts():
    env = dp_test.clean_env(**RANK_1_OF_2)
    done = subprocess.run([BINARY, "--device", "cuda", "--configs", "long,moe", "--cp", "2"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--cp 2: config moe is not a dense GPT" in done.stderr and "leave it out of --configs" in done.stderr
