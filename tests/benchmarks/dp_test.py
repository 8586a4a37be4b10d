"""step_bench --dp and pytorch_peer.py --ddp without a GPU: step_bench's
data-parallel rows from two host processes launched with torchrun's
variables, its flag checks, and pytorch_peer's data-parallel arithmetic and
fields (no torch needed) against step_bench's rows; report.py merges both."""

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.join(os.environ.get("TEST_SRCDIR", ""), os.environ.get("TEST_WORKSPACE", ""))
sys.path.insert(0, os.path.join(HERE, "benchmarks"))

import pytorch_peer  # noqa: E402
import report  # noqa: E402

BINARY = os.path.join(HERE, "benchmarks", "step_bench")
HOST_FLAGS = ["--device", "host", "--configs", "tiny", "--steps", "2", "--warmup", "2"]
# Fields only StepGraph has (README: "JSON"); every other field of a data-parallel row is in both files.
STEPGRAPH_ONLY = {
    "speedup_vs_stepgraph_eager",
    "persistent_bytes",
    "persistent_breakdown_bytes",
    "pool_peak_by_op_bytes",
    "transient_peak_bytes",
    "pool_bytes",
    "pool_lower_bound_bytes",
    "pool_ratio",
    "capture_ms",
}
LAUNCHER_VARIABLES = [
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
    "SLURM_NTASKS", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "STEPGRAPH_RENDEZVOUS_PORT",
]


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(extra)
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank, world, port):
    return clean_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def run_world(tmp_path, world, flags):
    """step_bench as `world` host processes with torchrun's variables; each rank's --out is its own file."""
    port = free_port()
    procs = []
    for rank in range(world):
        out = tmp_path / f"rank{rank}.json"
        procs.append(subprocess.Popen([BINARY, *flags, "--out", str(out)], env=torchrun_env(rank, world, port),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    return [p.returncode for p in procs], logs


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp2")
    codes, logs = run_world(tmp, 2, HOST_FLAGS + ["--dp", "2"])
    assert codes == [0, 0], logs
    assert not (tmp / "rank1.json").exists(), "only rank 0 writes the JSON"
    return json.loads((tmp / "rank0.json").read_text()), logs


def test_two_host_processes_write_the_data_parallel_rows(two_ranks):
    data, logs = two_ranks
    assert data["benchmark"] == "training_step" and data["source"] == "stepgraph"
    dp = data["data_parallel"]
    assert dp["world_size"] == 2 and dp["launcher"] == "torchrun" and dp["dp_mode"] == "allreduce"
    assert dp["multicast_env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                   "NVSHMEM_DISABLE_NVLS": "1"}
    (c,) = data["configs"]
    assert c["status"] == "ok" and c["world_size"] == 2 and c["global_tokens"] == 2 * c["tokens"]
    rows = {s["system"]: s for s in c["systems"]}
    assert list(rows) == ["stepgraph_eager_dp1", "stepgraph_graph_dp1", "stepgraph_eager_dp2", "stepgraph_graph_dp2"]
    for name in ("stepgraph_eager_dp2", "stepgraph_graph_dp2"):
        s, base = rows[name], rows[name.replace("_dp2", "_dp1")]
        assert s["baseline_system"] == base["system"]
        assert s["scaling_efficiency"] == pytest.approx(base["step_us"]["median_us"] / s["step_us"]["median_us"])
        assert s["exposed_comm_fraction"] == pytest.approx(1 - s["scaling_efficiency"])
        assert s["global_tokens_per_s"] == pytest.approx(2 * s["tokens_per_s"])
        assert len(s["rank_median_us"]) == 2
    assert c["dp_loss_check"]["eager"]["agrees"] and c["dp_loss_check"]["graph"]["agrees"]
    assert c["loss_check"]["identical"]
    assert "efficiency" in logs[0] and "efficiency" not in logs[1]  # rank 0 prints


def test_zero1_and_world_of_one(tmp_path):
    codes, logs = run_world(tmp_path, 2, HOST_FLAGS + ["--dp", "2", "--dp-mode", "zero1"])
    assert codes == [0, 0], logs
    data = json.loads((tmp_path / "rank0.json").read_text())
    assert data["configs"][0]["dp_mode"] == "zero1" and data["configs"][0]["dp_loss_check"]["graph"]["agrees"]

    out = tmp_path / "dp1.json"
    done = subprocess.run([BINARY, *HOST_FLAGS, "--dp", "1", "--out", str(out)], env=clean_env(),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["data_parallel"]["world_size"] == 1 and "baseline" in data["data_parallel"]["note"]
    assert [s["system"] for s in data["configs"][0]["systems"]] == ["stepgraph_eager_dp1", "stepgraph_graph_dp1"]
    assert "NOTE: world size 1" in done.stdout


def test_two_host_processes_write_the_tensor_parallel_rows(tmp_path):
    """step_bench --tp 2: the tiny GPT (attention and MLP) sharded over two host processes against each training it
    alone; --profile gives the graphed rows their exposed communication."""
    codes, logs = run_world(tmp_path, 2, HOST_FLAGS + ["--tp", "2", "--overlap", "overlap", "--profile"])
    assert codes == [0, 0], logs
    data = json.loads((tmp_path / "rank0.json").read_text())
    tp = data["tensor_parallel"]
    assert tp["world_size"] == 2 and tp["launcher"] == "torchrun" and "ring_exchange" in tp["overlap"]
    assert "heads" in tp["sharding"] and "trunk" not in tp
    (c,) = data["configs"]
    assert c["status"] == "ok" and c["loss_check"]["identical"]
    assert (c["heads"], c["kv_heads"], c["tp"]) == (2, 2, 2) and c["attention_core_flops_per_step"] > 0
    graphed = {s["system"]: s for s in c["systems"] if "graph" in s["system"]}
    assert graphed["stepgraph_graph_tp1"]["profile_exposed_comm_us"] == 0  # alone: no collective
    share = graphed["stepgraph_graph_tp2"]["profile_exposed_comm_fraction"]
    assert 0 < share < 1 and "profiled exposed comm" in logs[0]
    rows = {s["system"]: s for s in c["systems"]}
    assert list(rows) == ["stepgraph_eager_tp1", "stepgraph_graph_tp1", "stepgraph_eager_tp2", "stepgraph_graph_tp2"]
    for name in ("stepgraph_eager_tp2", "stepgraph_graph_tp2"):
        s, base = rows[name], rows[name.replace("_tp2", "_tp1")]
        assert s["baseline_system"] == base["system"]
        assert s["speedup_vs_tp1"] == pytest.approx(base["step_us"]["median_us"] / s["step_us"]["median_us"])
        assert s["strong_scaling_efficiency"] == pytest.approx(s["speedup_vs_tp1"] / 2)
        assert s["persistent_bytes"] < base["persistent_bytes"], "each rank holds half the model"
    assert "speedup" in logs[0] and "speedup" not in logs[1]  # rank 0 prints


def test_step_bench_tp_refuses_a_config_whose_sequences_do_not_split():
    """small has one sequence: its TP ranks cannot each hold whole sequences; said before any rank starts (or
    looks for a GPU)."""
    env = clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    done = subprocess.run([BINARY, "--device", "cuda", "--configs", "medium,small", "--tp", "2"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--tp 2: config small has 1 sequence(s) of 256 tokens" in done.stderr
    assert "leave small out of --configs" in done.stderr


@pytest.mark.parametrize(
    "flags, env, message",
    [
        (["--tp", "2"], {}, "--tp 2 needs 2 ranks"),
        (["--tp", "2", "--dp", "2"], {}, "--tp and --dp together"),
        (["--dp", "2"], {}, "--dp 2 needs 2 ranks"),
        (["--dp", "1", "--dp-mode", "ddp"], {}, "--dp-mode: ddp not in {allreduce,zero1}"),
        (["--dp", "-1"], {}, "--dp must be the number of ranks"),
        ([], {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
         "--dp was not given: pass --dp 2"),
        (["--dp", "4"], {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
         "--dp 4 needs 4 ranks"),
    ],
)
def test_step_bench_refuses_dp_flags_that_do_not_match_the_launch(flags, env, message):
    done = subprocess.run([BINARY, *HOST_FLAGS, *flags], env=clean_env(**env), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert message in done.stderr


def raw(samples, pipelined, first_loss, peak=1000):
    """time_system's numbers of one rank, made up."""
    return {"samples_us": samples, "pipelined_step_us": pipelined, "peak_bytes": peak,
            "device_used_delta_bytes": 2 * peak,
            "final_loss": first_loss - 1, "first_losses": [first_loss, first_loss - 0.5], "extra": {"wall_s": 3.0}}


def peer_config(world=2):
    """pytorch_peer's data-parallel config from made-up rank numbers (the arithmetic of run_dp_config)."""
    c = pytorch_peer.CONFIGS["small"]
    base = pytorch_peer.combine_ranks([raw([200, 200, 200], 190, 6.0), raw([200, 210, 190], 195, 5.0, peak=3000)])
    ddp = pytorch_peer.combine_ranks([raw([250, 240, 260], 200, 5.5), raw([245, 250, 250], 205, 5.5)])
    rows = [
        pytorch_peer.dp_row("pytorch_eager_dp1", c, 1, None, base),
        pytorch_peer.dp_row("pytorch_ddp_eager_dp2", c, world, "ddp", ddp, base, "pytorch_eager_dp1"),
    ]
    out = pytorch_peer.config_header("small")
    out.update(status="ok", reason=None, world_size=world, global_tokens=world * c["tokens"], dp_mode="ddp",
               systems=rows, dp_loss_check={"eager": pytorch_peer.dp_loss_check(base, ddp)})
    return out


def test_peer_scaling_arithmetic():
    c = peer_config()
    base, ddp = c["systems"]
    assert base["step_us"]["median_us"] == 200  # per sample the slowest rank: 200, 210, 200
    assert base["peak_bytes"] == 3000 and base["rank_median_us"] == [200, 200]
    assert ddp["step_us"]["median_us"] == 250  # 250, 250, 260
    assert ddp["pipelined_step_us"] == 205
    assert ddp["scaling_efficiency"] == pytest.approx(0.8)
    assert ddp["exposed_comm_us"] == pytest.approx(50)
    assert ddp["exposed_comm_fraction"] == pytest.approx(0.2)
    assert ddp["pipelined_scaling_efficiency"] == pytest.approx(195 / 205)
    assert ddp["tokens_per_s"] == pytest.approx(256 / 250e-6)
    assert ddp["global_tokens_per_s"] == pytest.approx(2 * 256 / 250e-6)
    assert base["scaling_efficiency"] is None and base["baseline_system"] is None
    assert c["dp_loss_check"]["eager"]["agrees"]  # 5.5 is the mean of 6 and 5
    bad = pytorch_peer.dp_loss_check(pytorch_peer.combine_ranks([raw([1], 1, 6.0), raw([1], 1, 5.0)]),
                                     pytorch_peer.combine_ranks([raw([1], 1, 5.6), raw([1], 1, 5.6)]))
    assert not bad["agrees"]
    with pytest.raises(RuntimeError, match="different numbers of steps"):
        pytorch_peer.combine_ranks([raw([1, 2], 1, 1.0), raw([1], 1, 1.0)])
    assert pytorch_peer.dp_name("cuda_graph", 8, True) == "pytorch_ddp_cuda_graph_dp8"
    assert pytorch_peer.dp_name("eager", 1, False) == "pytorch_eager_dp1"


def test_peer_rows_have_step_bench_fields(two_ranks):
    data, _ = two_ranks
    ours = {s["system"]: set(s) for s in data["configs"][0]["systems"]}
    theirs = {s["system"]: set(s) for s in peer_config()["systems"]}
    for mine, peer in (("stepgraph_eager_dp1", "pytorch_eager_dp1"), ("stepgraph_eager_dp2", "pytorch_ddp_eager_dp2"),
                       ("stepgraph_graph_dp2", "pytorch_ddp_eager_dp2")):
        missing = ours[mine] - STEPGRAPH_ONLY - theirs[peer]
        assert not missing, f"{peer} lacks {sorted(missing)} of {mine}"
    assert set(peer_config()) >= {"world_size", "global_tokens", "dp_mode", "dp_loss_check"}
    assert set(data["configs"][0]) >= {"world_size", "global_tokens", "dp_mode", "dp_loss_check"}


def test_report_puts_both_side_by_side(two_ranks):
    data, _ = two_ranks
    ours = json.loads(json.dumps(data))
    header = pytorch_peer.config_header("small")
    ours["configs"][0].update({k: header[k] for k in report.SHAPE_KEYS if k in header})  # tp: TP files only
    ours["configs"][0]["name"] = "small"
    theirs = {"benchmark": "training_step", "source": "pytorch", "device": "test", "configs": [peer_config()]}
    configs, warnings = report.merge(ours, theirs)
    assert warnings == []
    rows = {(r[0], r[1]) for r in report.table_rows(configs)}
    expected = {("small", "stepgraph_graph_dp2"), ("small", "pytorch_ddp_eager_dp2"), ("small", "pytorch_eager_dp1")}
    assert expected <= rows


def test_peer_ddp_flags_are_checked_before_torch():
    with pytest.raises(SystemExit, match="unknown system \\(with --ddp\\) 'compile'"):
        pytorch_peer.main(["--ddp", "--systems", "compile"])
    with pytest.raises(SystemExit, match="--timeout-s must be positive"):
        pytorch_peer.main(["--ddp", "--timeout-s", "0"])
    assert pytorch_peer.DDP_SYSTEMS == ("eager", "cuda_graph")
    assert pytorch_peer.MULTICAST_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                          "NVSHMEM_DISABLE_NVLS": "1"}
    for name, value in pytorch_peer.MULTICAST_ENV.items():
        assert os.environ[name] == value  # set on import, before torch
