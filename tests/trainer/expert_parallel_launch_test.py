"""The trainer's --ep with its ranks as separate processes on the host backend
(--nproc-per-node 2), as a user starts them: eager and graph print the same
losses as one process on the global batch, only rank 0 prints, a refused
combination ends every rank naming the flags, and a run stopped at a
checkpoint and resumed prints the uninterrupted run's losses, one part per rank.
Bit-for-bit checks on thread worlds: expert_parallel_trainer_test.cc."""

import os
import re
import subprocess

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
                             ({"nproc_per_node": 4}, "--ep 2 needs a world of 2 ranks")):
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
