"""The trainer's ranks as separate processes on the host backend, as a user
starts them: --nproc-per-node, and the launcher variables (torchrun's) set by
hand. Checks that two ranks train like one process on the same global batch,
that ranks started with different flags stop naming the flag, and that a
killed rank ends the others with an error naming it, in bounded time."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

TRAINER = os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], "trainer/trainer")
FLAGS = {"--device": "host", "--dtype": "fp32", "--layers": "2", "--hidden": "32", "--ffn": "64", "--heads": "0", "--context": "2",
         "--batch": "32", "--log-every": "1", "--seed": "5"}


def small(**overrides):
    """The small host model's flags; overrides by name (hidden="64")."""
    flags = dict(FLAGS, **{"--" + k.replace("_", "-"): str(v) for k, v in overrides.items()})
    return [part for item in flags.items() for part in item]


def run(args, env=None, timeout=120):
    return subprocess.run([TRAINER] + args, capture_output=True, text=True, timeout=timeout, env=env)


def losses(output):
    return [float(m.group(2)) for m in re.finditer(r"^step (\d+) loss ([0-9.]+) ", output, re.M)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank, world, port):
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def test_two_ranks_train_like_one_process_on_the_global_batch():
    single = run(small(steps=15))
    assert single.returncode == 0, single.stderr
    two = run(small(steps=15, nproc_per_node=2))
    assert two.returncode == 0, two.stdout + two.stderr
    assert "data parallel: 2 ranks" in two.stdout, two.stdout
    one_losses, two_losses = losses(single.stdout), losses(two.stdout)
    assert len(one_losses) == len(two_losses) == 15, two.stdout
    # The log prints 4 decimals; the ranks differ from one process by fp32
    # reduction order only (bitwise checks: data_parallel_trainer_test.cc).
    for step, (a, b) in enumerate(zip(one_losses, two_losses), start=1):
        assert abs(a - b) <= 2e-4, f"step {step}: one process {a}, two ranks {b}"
    # Only rank 0 prints step lines.
    assert two.stdout.count("step 15 loss") == 1


def test_ranks_started_with_different_flags_stop_naming_the_flag():
    port = free_port()
    procs = [subprocess.Popen([TRAINER] + small(steps=5, hidden=hidden), env=rank_env(r, 2, port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, hidden in enumerate(["32", "64"])]
    outputs = [p.communicate(timeout=60) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 2, f"rank {rank}: {out}{err}"
        assert "different flags: --hidden is 32 on rank 0 but 64 on rank 1" in err, err


def test_a_killed_rank_ends_the_other_with_an_error_naming_it():
    port = free_port()
    args = small(steps=100000, comm_timeout=20)
    procs = [subprocess.Popen([TRAINER] + args, env=rank_env(r, 2, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
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


def test_nproc_per_node_ends_the_survivors_and_fails_when_a_rank_fails():
    # --nproc-per-node with a bad flag value for the workers: every rank fails at once.
    result = run(small(steps=5, batch=33, nproc_per_node=2), timeout=60)
    assert result.returncode != 0
    assert "--batch 33 is the global batch and must split evenly over the 2" in result.stderr, result.stderr
    assert "rank 0 exited with status 2" in result.stderr or "rank 1 exited with status 2" in result.stderr


def test_nproc_per_node_under_a_launcher_is_an_error():
    result = run(small(steps=1, nproc_per_node=2), env=rank_env(0, 2, free_port()), timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "leave out --nproc-per-node" in result.stderr, result.stderr
