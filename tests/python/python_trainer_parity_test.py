"""Python reaches the C++ trainer's losses bit for bit: for one configuration per group of trainer
options (the GPT's shape, the window model, MoE with grouped-query attention, FP8 with its weight
cache, dropout, an LR schedule, fp16 loss scaling, shape buckets, step-scoped gradients, eager
mode, bf16, and over 2 ranks data parallelism, ZeRO-1 and tensor parallelism), trainer_reference runs the trainer's own train()
on the host and writes its losses and the inputs of each of its steps; this file builds the same
model, optimizer and step from Python with the flags' Python spellings (TRAINER_FLAGS_IN_PYTHON
below, the same table as python/README.md), loads the same inputs and compares the loss bits.

The ranks of the data-parallel cases run this file: `python3 python_trainer_parity_test.py worker
REFERENCE.json FLAGS.json OUT.npy` with torchrun's variables in the environment."""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stepgraph as sg

# Every configuration starts from this small host GPT; each case changes one group of options.
BASE = {"device": "host", "mode": "graph", "steps": "6", "layers": "1", "hidden": "32", "heads": "2", "ffn": "64",
        "seq-len": "8", "batch": "4", "dtype": "fp32", "lr": "3e-3", "seed": "2", "log-every": "100"}
CASES = {
    "gpt": {},
    "window_model": {"heads": "0", "seq-len": None, "context": "2", "layers": "2", "batch": "16"},
    "gqa_moe": {"heads": "4", "kv-heads": "2", "experts": "4", "topk": "1", "layers": "2"},
    "fp8_delayed_weight_cache": {"fp8": "delayed", "fp8-weight-cache": True, "dtype": "bf16", "hidden": "64",
                                 "ffn": "128", "batch": "4", "seq-len": "16"},
    "dropout": {"dropout": "0.1"},
    "lr_schedule": {"lr-schedule": "cosine", "warmup-steps": "2", "min-lr": "1e-4", "decay-steps": "5"},
    "fp16_loss_scaling": {"dtype": "fp16", "loss-scale-interval": "2"},
    "buckets": {"buckets": "pow2", "min-seq-len": "3", "batch": "6"},
    "step_scoped_gradients": {"no-skip-nonfinite": True},
    "eager": {"mode": "eager", "dropout": "0.1"},
    "bf16": {"dtype": "bf16"},
}
DATA_PARALLEL = {
    "data_parallel_2": {"batch": "8"},
    "zero1_2": {"batch": "8", "dp-mode": "zero1"},
    "tensor_parallel_2": {"tp": "2", "overlap": "overlap", "heads": "0", "seq-len": None, "context": "2",
                          "layers": "2", "batch": "16"},
}
RANK_TIMEOUT_S = 300


def trainer_flags(changes):
    flags = dict(BASE)
    flags.update(changes)
    out = []
    for name, value in flags.items():
        if value is None:
            continue
        out += [f"--{name}"] if value is True else [f"--{name}", value]
    return flags, out


def reference_binary():
    """trainer_reference, which Bazel builds and names in STEPGRAPH_TRAINER_REFERENCE; without it (the GPU
    bundle carries no such binary) the comparison cannot run and the test skips saying so."""
    binary = os.environ.get("STEPGRAPH_TRAINER_REFERENCE", "")
    if not binary or not Path(binary).is_file():
        pytest.skip("needs the trainer_reference binary: `./bazelw test //tests/python:python_trainer_parity_test` "
                    "builds it (or set STEPGRAPH_TRAINER_REFERENCE to its path)")
    return binary


def reference(tmp_path, name, args, ranks=1):
    binary = reference_binary()
    path = tmp_path / f"{name}.json"
    rank_args = ["--ranks", str(ranks)] if ranks > 1 else []
    run = subprocess.run([binary, str(path), *rank_args, *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return json.loads(path.read_text())


# The trainer's flags and how Python says each (the trainer's default where a flag is absent).
def model_vocab(vocab):
    """The trainer's LM head width: the data's vocabulary rounded up to 8 (cross-entropy reads 16-byte vectors)."""
    return (vocab + 7) // 8 * 8


def python_losses(flags, ref, world=None, step_scoped_gradients=False):
    """The losses of `flags` (BASE with a case's changes) trained from Python on the reference's inputs."""
    ranks, rank = (world.size, world.rank) if world is not None else (1, 0)
    heads = int(flags["heads"])
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[flags["dtype"]]
    fp8 = {None: None, "current": sg.Fp8Recipe.current(), "delayed": sg.Fp8Recipe.delayed(),
           "block": sg.Fp8Recipe.block()}[flags.get("fp8")]
    length = {"seq_len": int(flags["seq-len"])} if heads > 0 else {"context": int(flags["context"])}
    zero1 = flags.get("dp-mode") == "zero1"
    tensor_parallel = world if int(flags.get("tp", "1")) > 1 else None  # the whole world: --tp = the world size
    data_parallel = None if tensor_parallel is not None else world
    steps, lr = int(flags["steps"]), float(flags["lr"])
    schedule = None
    if flags.get("lr-schedule", "constant") != "constant" or int(flags.get("warmup-steps", "0")) > 0:
        schedule = sg.LrSchedule(flags.get("lr-schedule", "constant"), base=lr, min_lr=float(flags.get("min-lr", "0")),
                                 warmup=int(flags.get("warmup-steps", "0")),
                                 total=int(flags.get("decay-steps", "0")) or steps)
    skip = not (flags.get("no-skip-nonfinite") or zero1)  # the trainer's default: on, off with ZeRO-1
    loss_scaling = sg.LossScaling(growth_interval=int(flags.get("loss-scale-interval", "2000"))) \
        if dtype == "float16" else None
    side_streams = 2 if ranks > 1 else 1
    with sg.Context(flags["device"], side_streams=side_streams,
                    communication_stream=2 if ranks > 1 else None) as ctx:
        model = sg.LanguageModel(ctx, vocab=model_vocab(ref["vocab"]), hidden=int(flags["hidden"]),
                                 layers=int(flags["layers"]), heads=heads, kv_heads=int(flags["kv-heads"]) if "kv-heads" in flags else None,
                                 ffn=int(flags["ffn"]), dtype=dtype, seed=int(flags["seed"]),
                                 experts=int(flags.get("experts", "0")),
                                 topk=int(flags.get("topk", "2")) if flags.get("experts") else None,
                                 dropout=float(flags.get("dropout", "0")), fp8=fp8,
                                 fp8_weight_cache=bool(flags.get("fp8-weight-cache")),
                                 tensor_parallel=tensor_parallel, overlap=flags.get("overlap"), **length)
        optimizer = sg.AdamW(ctx, model, lr=None if schedule else lr, schedule=schedule, skip_nonfinite=skip,
                             loss_scaling=loss_scaling, step_scoped_gradients=step_scoped_gradients)
        rows = int(flags["batch"]) // ranks
        steps_by_shape = {}  # one step (and graph) per shape: with buckets, per bucket

        def step_for(inputs):
            bucket = inputs.get("bucket")
            if bucket not in steps_by_shape:
                if bucket is None:
                    step = sg.TrainStep(model, optimizer, tokens=rows * (length.get("seq_len", 1)), world=data_parallel,
                                        dp_mode="zero1" if zero1 else "allreduce")
                else:
                    step = sg.TrainStep(model, optimizer, tokens=bucket, sequences=inputs["sequences"],
                                        world=data_parallel)
                graph = step.capture() if flags["mode"] == "graph" else None
                steps_by_shape[bucket] = (step, graph)
            return steps_by_shape[bucket]

        losses = []
        for per_rank in ref["steps"]:
            inputs = per_rank[rank]
            step, graph = step_for(inputs)
            tokens = np.array(inputs["tokens"], np.int32)
            if heads == 0:
                tokens = tokens.reshape(rows, -1)
            step.load(tokens, np.array(inputs["labels"], np.int32), inputs.get("packing"))
            if graph is not None:
                graph.replay()
                loss = graph.outputs[0]
            else:
                loss = step()
            losses.append(loss.item())
            step.check_errors()
    return np.array(losses, np.float32)


def expect_same_bits(got, want, name):
    want = np.array(want, np.float32)
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist(), (
        f"{name}: Python's losses {got.tolist()} differ from the trainer's {want.tolist()}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_python_reaches_the_trainers_losses_bit_for_bit(tmp_path, name):
    flags, args = trainer_flags(CASES[name])
    ref = reference(tmp_path, name, args)
    assert len(ref["losses"]) == int(flags["steps"]) and all(math.isfinite(v) for v in ref["losses"])
    got = python_losses(flags, ref, step_scoped_gradients=name == "step_scoped_gradients")
    expect_same_bits(got, ref["losses"], name)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", sorted(DATA_PARALLEL))
def test_data_parallel_python_ranks_reach_the_trainers_losses(tmp_path, name):
    flags, args = trainer_flags(DATA_PARALLEL[name])
    ref = reference(tmp_path, name, args, ranks=2)
    (tmp_path / "ref.json").write_text(json.dumps(ref))
    (tmp_path / "flags.json").write_text(json.dumps(flags))
    port = str(free_port())
    ranks = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        ranks.append(subprocess.Popen([sys.executable, __file__, "worker", str(tmp_path / "ref.json"),
                                       str(tmp_path / "flags.json"), str(tmp_path / f"rank{rank}.npy")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [rank.communicate(timeout=RANK_TIMEOUT_S)[0] for rank in ranks]
    for rank, process in enumerate(ranks):
        assert process.returncode == 0, f"rank {rank}:\n{outputs[rank]}"
        expect_same_bits(np.load(tmp_path / f"rank{rank}.npy"), ref["losses"], f"{name} rank {rank}")


def test_host_worlds_of_two_refuse_to_split_saying_so(tmp_path):
    """--dp x --tp needs World.split, which NCCL worlds support; the host's TCP worlds of several
    ranks refuse it on every rank with a clear error, never a hang."""
    port = str(free_port())
    ranks = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        ranks.append(subprocess.Popen([sys.executable, __file__, "split", str(tmp_path / f"rank{rank}.txt")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [rank.communicate(timeout=RANK_TIMEOUT_S)[0] for rank in ranks]
    for rank, process in enumerate(ranks):
        assert process.returncode == 0, f"rank {rank}:\n{outputs[rank]}"
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "unsupported" in message and "split" in message, message


def split_worker(out_path):
    with sg.init_distributed("host", timeout=60) as world:
        try:
            world.split(world.rank % 2)
            Path(out_path).write_text("split")
        except sg.StepGraphError as error:
            Path(out_path).write_text(f"{error.code_name}: {error}")


def worker(ref_path, flags_path, out_path):
    ref = json.loads(Path(ref_path).read_text())
    flags = json.loads(Path(flags_path).read_text())
    with sg.init_distributed(flags["device"], timeout=120) as world:
        np.save(out_path, python_losses(flags, ref, world=world))


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    worker(*sys.argv[2:])
if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "split":
    split_worker(sys.argv[2])
