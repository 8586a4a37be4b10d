"""The trainer's --pp with its ranks as separate processes on the host backend
(--nproc-per-node 2), as a user starts them: eager and graph print the same
losses, one microbatch prints one process's losses, only rank 0 prints, a
refused combination ends every rank naming the flags, and a run stopped at a
checkpoint and resumed prints the uninterrupted run's losses.
Bit-for-bit checks on thread worlds: pipeline_trainer_test.cc."""

import os
import re
import subprocess

TRAINER = os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], "trainer/trainer")
FLAGS = {"--device": "host", "--dtype": "fp32", "--layers": "4", "--hidden": "32", "--ffn": "64", "--heads": "2",
         "--seq-len": "8", "--batch": "8", "--log-every": "1", "--seed": "3", "--steps": "8"}


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


def test_two_stages_print_the_same_losses_eager_and_graph():
    for extra in ([], ["--virtual-stages", "2"]):
        graph = run(flags(nproc_per_node=2, pp=2, mode="graph") + extra)
        eager = run(flags(nproc_per_node=2, pp=2, mode="eager") + extra)
        assert "pipeline parallel: 2 stages" in graph, graph
        assert ("interleaved 1F1B" in graph) == bool(extra), graph
        assert len(step_lines(graph)) == 8 and step_lines(graph) == step_lines(eager), graph + eager
        assert graph.count("step 8 loss") == 1  # only rank 0 prints


def test_one_microbatch_trains_as_one_process_eager_and_graph():
    # Stage 0 sends its activation and receives its gradient in one group; stage 1 receives alone, then sends
    # alone: the processes' communicator pairs them as NCCL does. One microbatch trains as one rank, bit for bit.
    alone = run(flags())
    assert len(step_lines(alone)) == 8, alone
    for mode in ("graph", "eager"):
        staged = run(flags(nproc_per_node=2, pp=2, microbatches=1, mode=mode))
        assert "1 microbatches" in staged, staged
        assert step_lines(staged) == step_lines(alone), staged + alone


def test_a_refused_combination_ends_every_rank_naming_the_flags():
    result = subprocess.run([TRAINER] + flags(nproc_per_node=2, pp=2, experts=2, layers=4), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0
    assert "--pp 2 does not support --experts (2)" in result.stderr, result.stderr
    assert "exited with status 2" in result.stderr, result.stderr


def test_a_resumed_run_prints_the_uninterrupted_losses(tmp_path):
    whole = run(flags(nproc_per_node=2, pp=2, virtual_stages=2))
    path = str(tmp_path / "pp.safetensors")
    run(flags(nproc_per_node=2, pp=2, virtual_stages=2, steps=4, checkpoint=path))
    resumed = run(flags(nproc_per_node=2, pp=2, virtual_stages=2, checkpoint=path) + ["--resume"])
    assert "resumed from" in resumed, resumed
    assert step_lines(resumed) == step_lines(whole)[4:], resumed + whole
    parts = sorted(p.name for p in tmp_path.glob("pp.safetensors.step8.rank*"))
    assert [p.split(".")[3] for p in parts] == ["rank0-of-2", "rank1-of-2"], parts
