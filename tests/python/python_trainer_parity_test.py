"""Python reaches the C++ trainer's losses bit for bit: for one configuration per group of trainer
options (the GPT's shape, the window model, MoE with grouped-query attention, FP8 with its weight
cache, dropout, an LR schedule, fp16 loss scaling, shape buckets, step-scoped gradients, eager
mode, bf16, checkpoints, and over 2 ranks data parallelism, ZeRO-1, tensor and context parallelism), trainer_reference runs the trainer's own train()
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
    "context_parallel_2": {"cp": "2", "batch": "8"},
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


def build(ctx, flags, ref, world=None, step_scoped_gradients=False):
    """The model and optimizer of `flags` (BASE with a case's changes) on `ctx`, with the trainer's
    vocabulary `ref["vocab"]`."""
    heads = int(flags["heads"])
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[flags["dtype"]]
    fp8 = {None: None, "current": sg.Fp8Recipe.current(), "delayed": sg.Fp8Recipe.delayed(),
           "block": sg.Fp8Recipe.block()}[flags.get("fp8")]
    length = {"seq_len": int(flags["seq-len"])} if heads > 0 else {"context": int(flags["context"])}
    zero1 = flags.get("dp-mode") == "zero1"
    tensor_parallel = world if int(flags.get("tp", "1")) > 1 else None  # the whole world: --tp = the world size
    context_parallel = world if int(flags.get("cp", "1")) > 1 else None  # likewise --cp
    steps, lr = int(flags["steps"]), float(flags["lr"])
    schedule = None
    if flags.get("lr-schedule", "constant") != "constant" or int(flags.get("warmup-steps", "0")) > 0:
        schedule = sg.LrSchedule(flags.get("lr-schedule", "constant"), base=lr, min_lr=float(flags.get("min-lr", "0")),
                                 warmup=int(flags.get("warmup-steps", "0")),
                                 total=int(flags.get("decay-steps", "0")) or steps)
    skip = not (flags.get("no-skip-nonfinite") or zero1)  # the trainer's default: on, off with ZeRO-1
    loss_scaling = sg.LossScaling(growth_interval=int(flags.get("loss-scale-interval", "2000"))) \
        if dtype == "float16" else None
    model = sg.LanguageModel(ctx, vocab=model_vocab(ref["vocab"]), hidden=int(flags["hidden"]),
                             layers=int(flags["layers"]), heads=heads, kv_heads=int(flags["kv-heads"]) if "kv-heads" in flags else None,
                             ffn=int(flags["ffn"]), dtype=dtype, seed=int(flags["seed"]),
                             experts=int(flags.get("experts", "0")),
                             topk=int(flags.get("topk", "2")) if flags.get("experts") else None,
                             dropout=float(flags.get("dropout", "0")), fp8=fp8,
                             fp8_weight_cache=bool(flags.get("fp8-weight-cache")),
                             tensor_parallel=tensor_parallel, overlap=flags.get("overlap"),
                             context_parallel=context_parallel, **length)
    optimizer = sg.AdamW(ctx, model, lr=None if schedule else lr, schedule=schedule, skip_nonfinite=skip,
                         loss_scaling=loss_scaling, step_scoped_gradients=step_scoped_gradients)
    return model, optimizer


def context(flags, world=None):
    ranks = world.size if world is not None else 1
    return sg.Context(flags["device"], side_streams=2 if ranks > 1 else 1,
                      communication_stream=2 if ranks > 1 else None)


def train(model, optimizer, flags, steps, world=None, first_step_made=None):
    """The losses of training on `steps` (the reference's inputs of each step, per rank) as the trainer does;
    `first_step_made()` runs once the first TrainStep exists (a ZeRO-1 step shards the optimizer)."""
    ranks, rank = (world.size, world.rank) if world is not None else (1, 0)
    heads = int(flags["heads"])
    zero1 = flags.get("dp-mode") == "zero1"
    data_parallel = None if int(flags.get("tp", "1")) > 1 else world
    rows = int(flags["batch"]) // ranks
    steps_by_shape = {}  # one step (and graph) per shape: with buckets, per bucket

    def step_for(inputs):
        bucket = inputs.get("bucket")
        if bucket not in steps_by_shape:
            if bucket is None:
                tokens = rows * (int(flags["seq-len"]) if heads > 0 else 1)
                step = sg.TrainStep(model, optimizer, tokens=tokens, world=data_parallel,
                                    dp_mode="zero1" if zero1 else "allreduce")
            else:
                step = sg.TrainStep(model, optimizer, tokens=bucket, sequences=inputs["sequences"],
                                    world=data_parallel)
            graph = step.capture() if flags["mode"] == "graph" else None
            if not steps_by_shape and first_step_made is not None:
                first_step_made()
            steps_by_shape[bucket] = (step, graph)
        return steps_by_shape[bucket]

    losses = []
    for per_rank in steps:
        inputs = per_rank[rank]
        if "group_tokens" in inputs and int(flags.get("tp", "1")) == 1:
            # Context-parallel: Python's helper cuts the trainer's share from the group's batch.
            for mine, group in (("tokens", "group_tokens"), ("labels", "group_labels")):
                assert sg.context_parallel_rows(inputs[group], world).tolist() == inputs[mine], mine
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
    return losses


def python_losses(flags, ref, world=None, step_scoped_gradients=False):
    """The losses of `flags` (BASE with a case's changes) trained from Python on the reference's inputs."""
    with context(flags, world) as ctx:
        model, optimizer = build(ctx, flags, ref, world, step_scoped_gradients)
        return np.array(train(model, optimizer, flags, ref["steps"], world), np.float32)


def python_losses_through_a_checkpoint(flags, ref, path, world=None):
    """The losses of the first half of the steps, a checkpoint saved, and the rest trained by a new context,
    model and optimizer that load it (over a world: every rank its part, as the trainer's --checkpoint)."""
    half = len(ref["steps"]) // 2
    with context(flags, world) as ctx:
        model, optimizer = build(ctx, flags, ref, world)
        first = train(model, optimizer, flags, ref["steps"][:half], world)
        sg.save_checkpoint(path, model, optimizer, world=world)
    with context(flags, world) as ctx:
        model, optimizer = build(ctx, flags, ref, world)
        rest = train(model, optimizer, flags, ref["steps"][half:], world,
                     first_step_made=lambda: sg.load_checkpoint(path, model, optimizer, world=world))
    return np.array(first + rest, np.float32)


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


def test_checkpoints_resume_bit_for_bit_in_python_and_across_python_and_the_trainer(tmp_path):
    """The checkpoint flags (--checkpoint, --save-every, --resume) and their Python spelling
    (sg.save_checkpoint, sg.load_checkpoint). The trainer trains 6 steps saving every 3; Python trains 3,
    saves, builds a new context, model and optimizer, loads and trains 3 more: the 6 losses are the
    trainer's. Python also resumes from the trainer's own step-3 checkpoint, and the trainer (--resume)
    from Python's, given the trainer's config.* entries: each reaches the trainer's last 3 losses."""
    flags, args = trainer_flags({"dropout": "0.1"})  # the generator's state must travel too
    ref = reference(tmp_path, "checkpoint_6", args + ["--checkpoint", str(tmp_path / "trainer6.safetensors"),
                                                     "--save-every", "3"])
    want = ref["losses"]
    assert len(want) == 6

    saved = tmp_path / "python3.safetensors"
    with context(flags) as ctx:
        model, optimizer = build(ctx, flags, ref)
        first = train(model, optimizer, flags, ref["steps"][:3])
        sg.save_checkpoint(saved, model, optimizer, metadata={"script.position": "3"})
    with context(flags) as ctx:  # a new process would do the same
        model, optimizer = build(ctx, flags, ref)
        metadata = sg.load_checkpoint(saved, model, optimizer)
        assert metadata == {"script.position": "3", "stepgraph.step": "3"}
        rest = train(model, optimizer, flags, ref["steps"][3:])
    expect_same_bits(np.array(first + rest, np.float32), want, "save at 3, load into a new model, train to 6")

    # Python resumes the trainer's checkpoint of a 3-step run of the same flags.
    trainer3 = tmp_path / "trainer3.safetensors"
    reference(tmp_path, "checkpoint_3", trainer_flags({"dropout": "0.1", "steps": "3"})[1] +
              ["--checkpoint", str(trainer3)])
    with context(flags) as ctx:
        model, optimizer = build(ctx, flags, ref)
        trainer_metadata = sg.load_checkpoint(trainer3, model, optimizer)
        assert trainer_metadata["stepgraph.step"] == "3" and trainer_metadata["stepgraph.data_position"] == "3"
        assert trainer_metadata["config.hidden"] == flags["hidden"] and trainer_metadata["config.dropout"] == "0.1"
        resumed = train(model, optimizer, flags, ref["steps"][3:])
    expect_same_bits(np.array(resumed, np.float32), want[3:], "Python resuming the trainer's step-3 checkpoint")

    # The trainer resumes Python's checkpoint where it carries the trainer's entries (its flags as
    # config.*, the data position), here copied from the trainer's own checkpoint.
    for_trainer = tmp_path / "python_for_trainer.safetensors"
    with context(flags) as ctx:
        model, optimizer = build(ctx, flags, ref)
        train(model, optimizer, flags, ref["steps"][:3])
        sg.save_checkpoint(for_trainer, model, optimizer,
                           metadata={k: v for k, v in trainer_metadata.items() if k != sg.checkpoint.STEP_KEY})
    trainer_resumed = reference(tmp_path, "resume_python", args + ["--checkpoint", str(for_trainer), "--resume"])
    expect_same_bits(np.array(trainer_resumed["losses"], np.float32), want[3:],
                     "the trainer resuming Python's step-3 checkpoint")


def test_checkpoint_arguments_are_checked(tmp_path):
    flags, _ = trainer_flags({})
    with context(flags) as ctx:
        model, optimizer = build(ctx, flags, {"vocab": 8})
        path = tmp_path / "c.safetensors"
        with pytest.raises(TypeError, match="save_checkpoint: path must be a str or os.PathLike"):
            sg.save_checkpoint(3, model, optimizer)
        with pytest.raises(TypeError, match="save_checkpoint: model must be a stepgraph LanguageModel"):
            sg.save_checkpoint(path, optimizer, optimizer)
        with pytest.raises(TypeError, match="save_checkpoint: optimizer must be the stepgraph AdamW"):
            sg.save_checkpoint(path, model, model)
        with pytest.raises(TypeError, match=r"save_checkpoint: metadata\['n'\] must be a str"):
            sg.save_checkpoint(path, model, optimizer, metadata={"n": 3})
        with pytest.raises(sg.ArgumentError, match=r"metadata\['stepgraph.step'\] is an entry the library writes"):
            sg.save_checkpoint(path, model, optimizer, metadata={"stepgraph.step": "3"})
        with pytest.raises(sg.ArgumentError, match="save_checkpoint: metadata key must not be empty"):
            sg.save_checkpoint(path, model, optimizer, metadata={"": "x"})
        with pytest.raises(TypeError, match="load_checkpoint: world must be a stepgraph World"):
            sg.load_checkpoint(path, model, optimizer, world="all")
        with pytest.raises(sg.StepGraphError, match="c.safetensors"):
            sg.load_checkpoint(path, model, optimizer)  # not written yet
        sg.save_checkpoint(str(path), model, optimizer, metadata={"note": "caf\u00e9"})
        assert sg.load_checkpoint(path, model, optimizer) == {"note": "caf\u00e9", "stepgraph.step": "0"}
        other, other_optimizer = build(ctx, dict(flags, hidden="64"), {"vocab": 8})
        with pytest.raises(sg.StepGraphError, match="checkpoint tensor '.*' is .* but this model's is"):
            sg.load_checkpoint(path, other, other_optimizer)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", sorted(DATA_PARALLEL) + ["data_parallel_2_through_a_checkpoint", "zero1_2_through_a_checkpoint"])
def test_data_parallel_python_ranks_reach_the_trainers_losses(tmp_path, name):
    """Each case over two ranks. The _through_a_checkpoint ones save after 3 steps and train the rest after a
    new model and optimizer load it: with all-reduce rank 0 writes one file, which both ranks load; with
    ZeRO-1 each rank writes its optimizer shard and a manifest commits them."""
    through_checkpoint = name.endswith("_through_a_checkpoint")
    flags, args = trainer_flags(DATA_PARALLEL[name.removesuffix("_through_a_checkpoint")])
    if through_checkpoint:
        flags = dict(flags, checkpoint_in_python=str(tmp_path / "python.safetensors"))
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
        got = np.load(tmp_path / f"rank{rank}.npy")
        expect_same_bits(got, ref["losses"], f"{name} rank {rank}")
    if through_checkpoint and flags.get("dp-mode") == "zero1":  # a manifest at the path, each rank's part beside it
        parts = sorted(p.name.split(".")[3] for p in tmp_path.glob("python.safetensors.step3.rank*"))
        assert (tmp_path / "python.safetensors").is_file() and parts == ["rank0-of-2", "rank1-of-2"], parts


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
        if "checkpoint_in_python" in flags:
            np.save(out_path, python_losses_through_a_checkpoint(flags, ref, flags["checkpoint_in_python"], world))
        else:
            np.save(out_path, python_losses(flags, ref, world=world))


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    worker(*sys.argv[2:])
if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "split":
    split_worker(sys.argv[2])
