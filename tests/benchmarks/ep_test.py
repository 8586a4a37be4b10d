"""step_bench --ep without a GPU: moe_tiny's expert-parallel rows from two host processes launched with torchrun's
variables (each rank holding 2 of the 4 experts of every block, against each rank training the whole config alone
on its own batch), eager against graphed losses, the group's first loss against the ranks' mean alone, the exchange's
transport named in the header, and the flags and configs it refuses."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dp_test  # noqa: E402  (step_bench over host processes)

BINARY = dp_test.BINARY
EP_FLAGS = ["--device", "host", "--configs", "moe_tiny", "--steps", "2", "--warmup", "2"]
RANK_1_OF_2 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
RANK_1_OF_3 = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3"}
ROWS = ["stepgraph_eager_ep1", "stepgraph_graph_ep1", "stepgraph_eager_ep2", "stepgraph_graph_ep2"]


def test_two_host_processes_write_the_expert_parallel_rows(tmp_path):
    codes, logs = dp_test.run_world(tmp_path, 2, EP_FLAGS + ["--ep", "2"])
    assert codes == [0, 0], logs
    assert not (tmp_path / "rank1.json").exists(), "only rank 0 writes the JSON"
    data = json.loads((tmp_path / "rank0.json").read_text())
    ep = data["expert_parallel"]
    assert ep["world_size"] == 2 and ep["launcher"] == "torchrun" and "host" in ep["communicator"]
    # The transport the exchange's captured transfers take, as the communicator chose it.
    assert ep["exchange_transport"] in ("nccl", "peer_copy") and ep["exchange_transport_reason"]
    assert ep["goal"] == "graphed epN scaling_efficiency >= 0.9"
    assert ep["multicast_env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                   "NVSHMEM_DISABLE_NVLS": "1"}
    assert "scaling_efficiency" in ep["formulas"] and "expert_parallel_step_runner.h" in ep["rows"]

    (c,) = data["configs"]
    assert c["status"] == "ok" and c["name"] == "moe_tiny" and c["ep"] == 2
    assert c["experts"] == 4 and c["experts_per_rank"] == 2 and c["global_tokens"] == 2 * c["tokens"]
    rows = {s["system"]: s for s in c["systems"]}
    assert list(rows) == ROWS

    check = c["loss_check"]
    assert check["compared"] == ["stepgraph_eager_ep2", "stepgraph_graph_ep2"]
    assert check["identical"] and check["ranks_agree"], check
    assert check["stepgraph_eager_ep1"] == check["stepgraph_graph_ep1"]
    for mode in ("eager", "graph"):
        mean = c["ep_loss_check"][mode]
        alone = mean["baseline_rank_first_losses"]
        assert len(alone) == 2 and alone[0] != alone[1], "each rank trains its own batch"
        assert mean["baseline_mean_first_loss"] == pytest.approx(sum(alone) / 2)
        assert mean["agrees"] and mean["ep_first_loss"] == pytest.approx(mean["baseline_mean_first_loss"], rel=1e-4)

        base, parallel = rows[f"stepgraph_{mode}_ep1"], rows[f"stepgraph_{mode}_ep2"]
        assert base["scaling_efficiency"] is None and base["experts_per_rank"] == 4
        assert parallel["baseline_system"] == base["system"] and parallel["experts_per_rank"] == 2
        t1, t2 = base["step_us"]["median_us"], parallel["step_us"]["median_us"]
        assert parallel["scaling_efficiency"] == pytest.approx(t1 / t2)
        assert parallel["exposed_comm_us"] == pytest.approx(t2 - t1)
        assert parallel["exposed_comm_fraction"] == pytest.approx(1 - t1 / t2)
        assert len(parallel["rank_median_us"]) == 2
        # Half the experts a rank: fewer fp32 masters than the whole config.
        assert parallel["persistent_breakdown_bytes"]["masters"] < base["persistent_breakdown_bytes"]["masters"]
    assert rows["stepgraph_graph_ep2"]["pool_ratio"] >= 1.0
    assert "efficiency" in logs[0] and "stepgraph_graph_ep2" not in logs[1]  # rank 0 prints
    assert "step_bench --ep: moe_tiny ep2 graph" in logs[0]  # progress lines


def test_profile_gives_the_graphed_rows_their_exposed_communication(tmp_path):
    codes, logs = dp_test.run_world(tmp_path, 2, EP_FLAGS + ["--ep", "2", "--profile"])
    assert codes == [0, 0], logs
    (c,) = json.loads((tmp_path / "rank0.json").read_text())["configs"]
    rows = {s["system"]: s for s in c["systems"]}
    assert rows["stepgraph_graph_ep1"]["profile_exposed_comm_us"] == 0  # alone: no collective
    assert 0 < rows["stepgraph_graph_ep2"]["profile_exposed_comm_fraction"] < 1
    assert "profile" not in rows["stepgraph_eager_ep2"]
    assert "profiled exposed comm" in logs[0] and "by op" in logs[0]  # the line, then the largest ops


def test_world_of_one_runs_the_baseline_rows(tmp_path):
    out = tmp_path / "ep1.json"
    done = subprocess.run([BINARY, *EP_FLAGS, "--ep", "1", "--out", str(out)], env=dp_test.clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "NOTE: world size 1: the ep1 rows alone" in done.stdout
    data = json.loads(out.read_text())
    assert data["expert_parallel"]["exchange_transport"] is None
    (c,) = data["configs"]
    assert [s["system"] for s in c["systems"]] == ROWS[:2] and c["loss_check"]["identical"]


@pytest.mark.parametrize(
    "flags, env, message",
    [
        (["--ep", "2"], {}, "--ep 2 needs 2 ranks"),
        (["--ep", "2", "--dp", "2"], {}, "--ep together with --dp, --tp, --cp or --pp is not benchmarked yet"),
        (["--ep", "2", "--tp", "2"], {}, "--ep together with --dp, --tp, --cp or --pp is not benchmarked yet"),
        (["--ep", "2", "--cp", "2"], {}, "--ep together with --dp, --tp, --cp or --pp is not benchmarked yet"),
        (["--ep", "2", "--pp", "2"], {}, "--ep together with --dp, --tp, --cp or --pp is not benchmarked yet"),
        (["--ep", "-1"], {}, "--ep must be the number of ranks"),
        (["--ep", "2", "--fp8", "current"], RANK_1_OF_2, "--ep: --fp8 is not supported"),
        (["--ep", "2", "--step-scoped-gradients"], RANK_1_OF_2, "--step-scoped-gradients is not supported with --ep"),
        (["--ep", "3"], RANK_1_OF_3, "config moe_tiny's 4 experts do not divide by --ep 3"),
    ],
)
def test_step_bench_refuses_ep_flags_it_cannot_run(flags, env, message):
    done = subprocess.run([BINARY, *EP_FLAGS, *flags], env=dp_test.clean_env(**env), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


def test_step_bench_ep_refuses_a_dense_config_before_any_rank_starts():
    env = dp_test.clean_env(**RANK_1_OF_2)
    done = subprocess.run([BINARY, "--device", "cuda", "--configs", "moe,medium", "--ep", "2"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--ep 2: config medium has no experts" in done.stderr and "leave it out of --configs" in done.stderr
    done = subprocess.run([BINARY, *dp_test.HOST_FLAGS, "--ep", "2"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "--ep 2: config tiny has no experts" in done.stderr, done.stderr
