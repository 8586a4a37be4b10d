"""Elastic restarts (Note [Elastic restarts] in trainer/distributed.h), on the
host backend as a user runs them: a rank killed mid-run under --nproc-per-node
--max-restarts, every rank restarted from the newest complete checkpoint, and
the finished run's checkpoint equal to an uninterrupted run's byte for byte;
torchrun's restart count resumes the same way; bad combinations are clear
errors."""

import os
import re
import signal
import subprocess
import tempfile
import time

TRAINER = os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], "trainer/trainer")
FLAGS = {"--device": "host", "--dtype": "fp32", "--layers": "2", "--hidden": "32", "--ffn": "64", "--heads": "0",
         "--context": "2", "--batch": "32", "--log-every": "1", "--seed": "5", "--comm-timeout": "20"}


def small(**overrides):
    flags = dict(FLAGS, **{"--" + k.replace("_", "-"): str(v) for k, v in overrides.items()})
    return [part for item in flags.items() for part in item]


def run(args, env=None, timeout=180):
    return subprocess.run([TRAINER] + args, capture_output=True, text=True, timeout=timeout, env=env)


def children(pid):
    """The processes whose parent is `pid`, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return sorted(found)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def test_a_killed_rank_is_restarted_and_the_run_ends_as_an_uninterrupted_one():
    with tempfile.TemporaryDirectory() as work:
        whole = os.path.join(work, "whole.safetensors")
        done = run(small(steps=16, nproc_per_node=2, checkpoint=whole, save_every=2))
        assert done.returncode == 0, done.stdout + done.stderr

        restarted = os.path.join(work, "restarted.safetensors")
        launcher = subprocess.Popen([TRAINER] + small(steps=16, nproc_per_node=2, max_restarts=1,
                                                      checkpoint=restarted, save_every=2),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = ""
        deadline = time.monotonic() + 120
        while "step 7 loss" not in seen and time.monotonic() < deadline:
            line = launcher.stdout.readline()
            if not line:
                break
            seen += line
        assert "step 7 loss" in seen, seen
        workers = children(launcher.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        out, err = launcher.communicate(timeout=180)
        out = seen + out
        assert launcher.returncode == 0, out + err
        assert "restarting every rank (restart 1 of 1)" in err, err
        match = re.search(r"^restart 1: resuming from \S+", out, re.M)
        assert match, out
        # The run went on from its last save (step 6 or later) to step 16.
        assert out.count("step 16 loss") == 1, out
        assert read(restarted) == read(whole), "the restarted run's checkpoint differs from the uninterrupted run's"


def test_torchrun_restart_count_resumes_from_the_checkpoint():
    with tempfile.TemporaryDirectory() as work:
        whole = os.path.join(work, "whole.safetensors")
        assert run(small(steps=8, checkpoint=whole)).returncode == 0
        path = os.path.join(work, "restarted.safetensors")
        first = run(small(steps=4, checkpoint=path))
        assert first.returncode == 0, first.stderr
        env = dict(os.environ, TORCHELASTIC_RESTART_COUNT="1")
        again = run(small(steps=8, checkpoint=path), env=env)
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"restart 1: resuming from {path}" in again.stdout, again.stdout
        assert read(path) == read(whole)
        # No checkpoint yet: a restart starts over.
        fresh = os.path.join(work, "fresh.safetensors")
        over = run(small(steps=8, checkpoint=fresh), env=env)
        assert over.returncode == 0, over.stderr
        assert "restart 1: no checkpoint saved yet, starting over" in over.stdout, over.stdout
        assert read(fresh) == read(whole)


def test_bad_restart_flags_are_clear_errors():
    alone = run(small(steps=2, max_restarts=1, checkpoint="/tmp/unused.safetensors"))
    assert alone.returncode == 2 and "--max-restarts restarts the ranks that --nproc-per-node starts" in alone.stderr
    no_checkpoint = run(small(steps=2, max_restarts=1, nproc_per_node=2))
    assert no_checkpoint.returncode == 2 and "--max-restarts needs --checkpoint" in no_checkpoint.stderr
    env = dict(os.environ, STEPGRAPH_RESTART_COUNT="-1")
    bad = run(small(steps=2), env=env)
    assert bad.returncode != 0 and "STEPGRAPH_RESTART_COUNT is '-1', not a restart count" in bad.stderr, bad.stderr
