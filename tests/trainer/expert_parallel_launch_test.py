"""The trainer's --ep with its ranks as separate processes on the host backend
(--nproc-per-node 2), as a user starts them: eager and graph print the same
losses as one process on the global batch, only rank 0 prints, a refused
combination ends every rank naming the flags (--ep 2 x --dp 2 among them:
host processes do not split a world, so they run --ep with --dp 1 only), and
a run stopped at a checkpoint and resumed prints the uninterrupted run's
losses, one part per rank; ranks started under a launcher with other experts
stop naming the flag, and a killed rank ends the other (inside an MoE
block's exchange or the gradients' all-reduce) naming it.
Bit-for-bit checks on thread worlds: expert_parallel_trainer_test.cc."""

import os
import re
import signal
import socket
import subprocess
import time

TRAINER = os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], "trainer/trainer")
FLAGS = {"--device": "host", "--dtype": "fp32", "--layers": "4", "--hidden": "32", "--ffn": "64", "--heads": "2",
         "--seq-len": "8", "--batch": "8", "--experts": "8", "--log-every": "1", "--seed": "3", "--steps": "8"}


def flags(**overrides):
    merged = dict(FLAGS, **{"--" + k.replace("_", "-"): str(v) for k, v in overrides.items()})
    return [part for item in merged.items() for part in item]


def run(args, timeout=180):
    result = subprocess.run([TRAINER] + args, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def step_lines(output):
    """The printed losses by step ("step 3 loss 2.0123"), without the timings."""
    return re.findall(r"^step \d+ loss [0-9.]+", output, re.M)


def test_two_ranks_print_the_same_losses_eager_and_graph():
    graph = run(flags(nproc_per_node=2, ep=2, mode="graph"))
    eager = run(flags(nproc_per_node=2, ep=2, mode="eager"))
    assert "expert parallel: 2 ranks" in graph, graph
    assert "experts [0, 4) on rank 0, [4, 8) on rank 1 in each of the 2 MoE blocks" in graph, graph
    assert len(step_lines(graph)) == 8 and step_lines(graph) == step_lines(eager), graph + eager
    assert graph.count("step 8 loss") == 1  # only rank 0 prints
    # One process on the global batch prints the same 4 decimals (the losses agree to ~1e-7 relative).
    assert step_lines(run(flags())) == step_lines(graph), graph


def test_a_refused_combination_ends_every_rank_naming_the_flags():
    for overrides, words in (({"tp": 2}, "--ep 2 with --tp 2"), ({"experts": 0}, "--ep 2 spreads the MoE"),
                             ({"nproc_per_node": 3}, "--ep 2 needs a world of a multiple of 2 ranks"),
                             ({"dp": 2}, "--ep 2 x --dp 2 needs a world of 4 ranks"),
                             # Host processes do not split a world: --ep x --dp runs on thread worlds and NCCL.
                             ({"nproc_per_node": 4, "dp": 2}, "host processes do not split a world")):
        args = flags(**dict({"nproc_per_node": 2, "ep": 2}, **overrides))
        result = subprocess.run([TRAINER] + args, capture_output=True, text=True, timeout=60)
        assert result.returncode != 0, result.stdout
        assert words in result.stderr, result.stderr
        assert "exited with status 2" in result.stderr, result.stderr


def test_a_resumed_run_prints_the_uninterrupted_losses(tmp_path):
    whole = run(flags(nproc_per_node=2, ep=2))
    path = str(tmp_path / "ep.safetensors")
    first = run(flags(nproc_per_node=2, ep=2, steps=4, checkpoint=path))
    assert "(the manifest of one file per rank: --ep 2)" in first, first
    resumed = run(flags(nproc_per_node=2, ep=2, checkpoint=path) + ["--resume"])
    assert "resumed from" in resumed, resumed
    assert step_lines(resumed) == step_lines(whole)[4:], resumed + whole
    parts = sorted(p.name for p in tmp_path.glob("ep.safetensors.step8.rank*"))
    assert [p.split(".")[3] for p in parts] == ["rank0-of-2", "rank1-of-2"], parts


def rank_env(rank, world, port):
    return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(per_rank_args):
    port = free_port()
    return [subprocess.Popen([TRAINER] + args, env=rank_env(r, len(per_rank_args), port), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for r, args in enumerate(per_rank_args)]


def test_ranks_started_with_other_experts_stop_naming_the_flag():
    procs = start_ranks([flags(ep=2, experts=8), flags(ep=2, experts=4)])
    outputs = [p.communicate(timeout=60) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 2, f"rank {rank}: {out}{err}"
        assert "different flags: --experts is 8 on rank 0 but 4 on rank 1" in err, err


def test_a_killed_rank_ends_the_other_with_an_error_naming_it():
    procs = start_ranks([flags(ep=2, steps=100000, comm_timeout=20)] * 2)
    # Wait until training runs (rank 0 prints step lines), then kill rank 1.
    deadline = time.monotonic() + 60
    seen = ""
    while "step 3 loss" not in seen and time.monotonic() < deadline:
        seen += procs[0].stdout.readline()
    assert "step 3 loss" in seen, seen
    procs[1].send_signal(signal.SIGKILL)
    start = time.monotonic()
    out, err = procs[0].communicate(timeout=60)
    elapsed = time.monotonic() - start
    assert procs[0].returncode not in (0, None)
    assert "rank 1" in err, err
    assert re.search(r"step \d+", err), err  # the step it was in
    assert elapsed < 20, f"rank 0 took {elapsed:.1f} s to notice"
    procs[1].communicate()
