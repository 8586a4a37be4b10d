"""ep_exchange_bench without a GPU: two host processes launched with torchrun's variables time the captured and eager
exchange of moe_tiny's rows under uniform and skewed routing (no NCCL reference: --reference none), check that
combine(dispatch(x)) is x, and record the transport the captured exchange took, the bytes and the bandwidths; a
captured row per --copy-blocks count; the flags and worlds it refuses."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dp_test  # noqa: E402  (processes with a launcher's variables)

HERE = dp_test.HERE
BINARY = os.path.join(HERE, "benchmarks", "ep_exchange_bench")
HOST_FLAGS = ["--device", "host", "--config", "moe_tiny", "--reference", "none", "--samples", "3", "--warmup", "1",
              "--iters", "2"]
RANK_1_OF_2 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


def run_world(tmp_path, world, flags):
    port = dp_test.free_port()
    procs = []
    for rank in range(world):
        out = tmp_path / f"rank{rank}.json"
        procs.append(subprocess.Popen([BINARY, *flags, "--out", str(out)],
                                      env=dp_test.torchrun_env(rank, world, port), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    return [p.returncode for p in procs], logs


def test_two_host_processes_time_the_exchange(tmp_path):
    codes, logs = run_world(tmp_path, 2, HOST_FLAGS)
    assert codes == [0, 0], logs
    assert not (tmp_path / "rank1.json").exists(), "only rank 0 writes the JSON"
    data = json.loads((tmp_path / "rank0.json").read_text())
    assert data["benchmark"] == "ep_exchange" and data["world_size"] == 2
    assert data["config"] == {"name": "moe_tiny", "hidden": 64, "tokens_per_rank": 64, "topk": 2, "experts": 4,
                              "dtype": "bf16"}
    assert data["rows_per_rank"] == 128 and data["row_bytes"] == 128
    # The captured program's ops say which exchange ran (dispatch and combine over given counts: no all-gather);
    # its transport is recorded as the communicator gave it.
    ops = data["captured_ops"]
    assert "all_gather" not in ops and (ops.get("send_recv", 0) == 2 or "peer_copy" in data["graph_transport"])
    assert data["graph_transport"] in ("padded_nccl", "padded_peer_copy", "peer_copy")
    assert data["communicator_peer_transport"] in ("nccl", "peer_copy") and data["communicator_peer_transport_reason"]
    assert data["multicast_env"]["NCCL_NVLS_ENABLE"] == "0"
    assert "ratio_vs_nccl" in data["goal"]

    rows = {r["routing"]: r for r in data["routings"]}
    assert list(rows) == ["uniform", "skewed"]
    assert rows["uniform"]["splits"] == [32, 32, 32, 32]
    assert rows["uniform"]["rows_between_ranks"] == [[64, 64], [64, 64]]
    skewed = rows["skewed"]
    assert sum(skewed["splits"]) == 128 and skewed["splits"][0] > skewed["splits"][-1]
    assert skewed["rows_between_ranks"][0][0] > skewed["rows_between_ranks"][0][1]
    for row in rows.values():
        assert row["routed_bytes"] == 2 * 128 * 128 and row["padded_bytes"] == 2 * 128 * 128
        systems = {s["system"]: s for s in row["systems"]}
        assert list(systems) == ["stepgraph_graph", "stepgraph_graph_with_counts", "stepgraph_eager",
                                 "stepgraph_graph_blocks8"], "no NCCL row with --reference none; the op's default swept"
        graph, counted, eager, swept = (systems[n] for n in systems)
        assert graph["verified"] and counted["verified"] and eager["verified"] and swept["verified"], \
            "combine(dispatch(x)) is x everywhere"
        assert graph["transport"] == counted["transport"] == swept["transport"] == data["graph_transport"]
        assert graph["copy_blocks"] == counted["copy_blocks"] == swept["copy_blocks"] == 8
        assert "copy_blocks" not in eager
        assert row["best_copy_blocks"] == 8
        assert eager["transport"] == "padded_nccl" and eager["bytes_moved_per_rank"] == row["padded_bytes"]
        if data["graph_transport"] != "peer_copy":
            assert graph["bytes_moved_per_rank"] == row["padded_bytes"]
        for s in (graph, counted, eager, swept):
            t = s["exchange_us"]["median_us"]
            assert s["algbw_gbps"] == pytest.approx(row["routed_bytes"] / (t * 1e-6) / 1e9)
            assert s["cross_rank_gbps"] == pytest.approx(row["cross_rank_bytes_max"] / (t * 1e-6) / 1e9)
            assert len(s["rank_median_us"]) == 2 and "ratio_vs_nccl" not in s
        assert graph["graph_speedup_vs_eager"] == pytest.approx(eager["exchange_us"]["median_us"] /
                                                                graph["exchange_us"]["median_us"])
    assert data["copy_blocks"] == [8] and data["default_copy_blocks"] == 8
    assert "captured exchange:" in logs[0] and "skewed" in logs[0] and "skewed" not in logs[1]
    assert "fastest copy: 8 blocks" in logs[0]


def test_copy_blocks_add_a_captured_row_per_count(tmp_path):
    codes, logs = run_world(tmp_path, 2, HOST_FLAGS + ["--routings", "uniform", "--copy-blocks", "16,1,132"])
    assert codes == [0, 0], logs
    data = json.loads((tmp_path / "rank0.json").read_text())
    assert data["copy_blocks"] == [16, 1, 132]
    (row,) = data["routings"]
    systems = {s["system"]: s for s in row["systems"]}
    swept = ["stepgraph_graph_blocks16", "stepgraph_graph_blocks1", "stepgraph_graph_blocks132"]
    assert list(systems) == ["stepgraph_graph", "stepgraph_graph_with_counts", "stepgraph_eager"] + swept
    assert systems["stepgraph_graph"]["copy_blocks"] == 8, "stepgraph_graph keeps the op's default"
    for name, blocks in zip(swept, [16, 1, 132]):
        s = systems[name]
        assert s["copy_blocks"] == blocks and s["verified"] and s["transport"] == data["graph_transport"]
        assert s["bytes_moved_per_rank"] == systems["stepgraph_graph"]["bytes_moved_per_rank"]
        t = s["exchange_us"]["median_us"]
        assert s["algbw_gbps"] == pytest.approx(row["routed_bytes"] / (t * 1e-6) / 1e9)
    fastest = min(swept, key=lambda name: systems[name]["exchange_us"]["median_us"])
    assert row["best_copy_blocks"] == systems[fastest]["copy_blocks"]
    assert f"fastest copy: {row['best_copy_blocks']} blocks" in logs[0]


@pytest.mark.parametrize(
    "flags, env, message",
    [
        (HOST_FLAGS, {}, "ep_exchange_bench needs 2 or more ranks"),
        (["--device", "host", "--config", "tiny", "--reference", "none"], RANK_1_OF_2,
         "--config tiny has no experts"),
        (HOST_FLAGS + ["--routings", "uniform,zipf"], RANK_1_OF_2, "--routing: unknown routing 'zipf'"),
        (HOST_FLAGS[:-2] + ["--iters", "0"], RANK_1_OF_2, "--samples and --iters must be >= 1"),
        (["--device", "host", "--config", "moe", "--reference", "none"],
         {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3"},
         "--config moe's 8 experts do not divide by the 3 ranks"),
        (["--device", "host", "--reference", "tpu"], {}, "--reference: tpu not in {nccl,none}"),
        (HOST_FLAGS + ["--copy-blocks", "8,x"], {}, "--copy-blocks: 'x' in '8,x' is not a whole number"),
        (HOST_FLAGS + ["--copy-blocks", "8,,16"], {}, "--copy-blocks: '' in '8,,16' is not a whole number"),
        (HOST_FLAGS + ["--copy-blocks", "16,200"], {}, "--copy-blocks: 200 thread blocks is outside [1, 132]"),
        (HOST_FLAGS + ["--copy-blocks", "0"], {}, "--copy-blocks: 0 thread blocks is outside [1, 132]"),
        (HOST_FLAGS + ["--copy-blocks", "32,8,32"], {}, "--copy-blocks: 32 appears twice"),
    ],
)
def test_refuses_what_it_cannot_run(flags, env, message):
    done = subprocess.run([BINARY, *flags], env=dp_test.clean_env(**env), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


def test_the_nccl_reference_without_a_gpu_names_the_flag(tmp_path):
    flags = [f if f != "none" else "nccl" for f in HOST_FLAGS]
    codes, logs = run_world(tmp_path, 2, flags)
    assert codes[0] != 0, logs
    assert "NCCL's all-to-all reference needs a GPU" in logs[0] and "pass --reference none" in logs[0], logs[0]
