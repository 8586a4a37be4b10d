"""sg.init_distributed() and data-parallel TrainSteps on the host: two Python ranks, started as
torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
each train captured steps on their half of a global batch and must match one process training on
the whole batch (1e-5 relative), with the same loss bits on both ranks. Also: no launcher variables
make a world of one; bad arguments and bad launcher variables are clear errors; a rank that never
comes or that leaves early is an error on the others, never a hang.

The ranks run this file (`python3 distributed_test.py worker OUT_PATH`, `... readme`; the launcher
variables come from the environment), so python/README.md's example also runs under torchrun on a
GPU machine: `torchrun --nproc-per-node 2 distributed_test.py readme`."""

import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import stepgraph as sg

# Every launcher's variables (launch/launch_env.h): the tests set or clear all of them.
LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
    "SLURM_STEP_NODELIST", "SLURM_NODELIST",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "TORCHELASTIC_USE_AGENT_STORE", "STEPGRAPH_RENDEZVOUS_PORT",
)
GLOBAL_TOKENS = 16
STEPS = 6
HIDDEN, FFN, LAYERS, VOCAB = 16, 32, 2, 32
RANK_TIMEOUT_S = 120  # a rank still running after this has hung: the test fails instead


def batches():
    """The global batches, the same in every process: two, alternating (so the loss must fall)."""
    rng = np.random.default_rng(2024)
    two = [(rng.standard_normal((GLOBAL_TOKENS, HIDDEN)).astype(np.float32), rng.integers(0, VOCAB, GLOBAL_TOKENS))
           for _ in range(2)]
    return [two[i % 2] for i in range(STEPS)]


def train(device, world=None, tensor_parallel=False):
    """STEPS captured steps of the same fp32 model and one eager step; with a world, on this rank's rows
    of each global batch: data parallel, or with tensor_parallel the model sharded over the world.
    Returns (losses, {parameter name: fp32 master values})."""
    ranks, rank = (world.size, world.rank) if world is not None else (1, 0)
    rows = GLOBAL_TOKENS // ranks
    with sg.Context(device, side_streams=2, communication_stream=2) as ctx:
        shape = dict(hidden=HIDDEN, ffn=FFN, layers=LAYERS, vocab=VOCAB, dtype="float32", seed=5)
        if tensor_parallel:
            model = sg.ResidualStack(ctx, **shape, tensor_parallel=world, overlap="overlap")
            step = sg.TrainStep(model, sg.AdamW(ctx, model, lr=1e-2), tokens=rows)
        else:
            model = sg.ResidualStack(ctx, **shape)
            step = sg.TrainStep(model, sg.AdamW(ctx, model, lr=1e-2), tokens=rows, world=world)
        graph = step.capture(policy="error")
        losses = []
        for x, labels in batches():
            step.load(x[rank * rows:(rank + 1) * rows], labels[rank * rows:(rank + 1) * rows])
            graph.replay()
            losses.append(graph.outputs[0].item())
        losses.append(step().item())  # eager: the same collectives, run now
        step.check_errors()
        parameters = {p.name: p.master.numpy().copy() for p in model.parameters()}
    return losses, parameters


def worker(out_path, mode="dp"):
    device = os.environ.get("STEPGRAPH_DEVICE", "host")
    with sg.init_distributed(device, timeout=60) as world:
        print(world.describe(), flush=True)
        losses, parameters = train(device, world, tensor_parallel=mode == "tp")
    np.savez(out_path, losses=np.array(losses, np.float32), rank=world.rank, size=world.size,
             **{f"p:{name}": value for name, value in parameters.items()})


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_environment():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["STEPGRAPH_DEVICE"] = "host"
    return env


def start_ranks(size, args, port=None):
    """Starts `size` ranks of this file with torchrun's variables; returns the processes."""
    port = port or free_port()
    processes = []
    for rank in range(size):
        env = clean_environment()
        env.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        processes.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *args(rank)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return processes


def wait_all(processes):
    """[(returncode, output)]; kills every rank once one outlives RANK_TIMEOUT_S (a hang)."""
    deadline = time.monotonic() + RANK_TIMEOUT_S
    results = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            output, _ = process.communicate()
            pytest.fail(f"a rank hung for {RANK_TIMEOUT_S} s:\n{output}")
        results.append((process.returncode, output))
    return results


@pytest.fixture
def no_launcher(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ---- two ranks equal one process -------------------------------------------------------------

def test_two_host_ranks_train_like_one_process_on_the_whole_batch(tmp_path, no_launcher):
    outputs = [tmp_path / f"rank{rank}.npz" for rank in range(2)]
    results = wait_all(start_ranks(2, lambda rank: ["worker", str(outputs[rank])]))
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{output}"
        assert f"rank {rank} of 2 (local {rank} of 2) via torchrun" in output, output
    ranks = [np.load(path) for path in outputs]
    assert [int(r["rank"]) for r in ranks] == [0, 1] and all(int(r["size"]) == 2 for r in ranks)

    # Both ranks report the global mean loss, bit for bit the same, and end with the same parameters.
    assert ranks[0]["losses"].tobytes() == ranks[1]["losses"].tobytes(), (ranks[0]["losses"], ranks[1]["losses"])
    names = sorted(name for name in ranks[0].files if name.startswith("p:"))
    assert names and names == sorted(name for name in ranks[1].files if name.startswith("p:"))
    for name in names:
        assert ranks[0][name].tobytes() == ranks[1][name].tobytes(), f"{name} differs between the ranks"

    # One process on the whole batch: the same losses and parameters up to the order of the sums.
    losses, parameters = train("host")
    np.testing.assert_allclose(ranks[0]["losses"], np.array(losses, np.float32), rtol=1e-5, atol=0)
    assert losses[STEPS - 2] < losses[0] and losses[STEPS - 1] < losses[1], f"did not train: {losses}"
    for name in names:
        reference = parameters[name[2:]]
        np.testing.assert_allclose(ranks[0][name], reference, rtol=1e-5, atol=1e-6, err_msg=name)


# Tensor parallelism: the stack sharded over the two ranks (each holds half of every ffn and of the
# vocabulary, and its half of the rows outside the blocks), the overlapped schedules; the loss is the
# same global mean, bit for bit on both ranks, and one process's within 1e-5 (the split sums' fp32
# order, as for data parallelism).
def test_two_host_ranks_tensor_parallel_train_like_one_process(tmp_path, no_launcher):
    outputs = [tmp_path / f"tp{rank}.npz" for rank in range(2)]
    results = wait_all(start_ranks(2, lambda rank: ["worker", str(outputs[rank]), "tp"]))
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{output}"
    ranks = [np.load(path) for path in outputs]
    assert ranks[0]["losses"].tobytes() == ranks[1]["losses"].tobytes(), (ranks[0]["losses"], ranks[1]["losses"])
    fc1 = "p:block0.fc1.weight"
    assert ranks[0][fc1].shape == (FFN // 2, HIDDEN), "each rank holds half of fc1's rows"
    losses, parameters = train("host")
    np.testing.assert_allclose(ranks[0]["losses"], np.array(losses, np.float32), rtol=1e-5, atol=0)
    np.testing.assert_allclose(np.concatenate([ranks[0][fc1], ranks[1][fc1]]), parameters[fc1[2:]], rtol=1e-5,
                               atol=1e-6, err_msg="fc1's rows, both ranks together")


# ---- a world of one ----------------------------------------------------------------------------

def test_no_launcher_variables_make_a_world_of_one(no_launcher):
    with sg.init_distributed("host") as world:
        assert (world.rank, world.size, world.local_rank, world.device) == (0, 1, 0, "host")
        assert world.describe() == "a single process (rank 0 of 1, no launcher)"
        assert "rank 0 of 1" in repr(world)
        # A world of one trains as without a world.
        with sg.Context("host") as ctx:
            model = sg.ResidualStack(ctx, hidden=8, ffn=16, layers=1, vocab=16, dtype="float32", seed=1)
            step = sg.TrainStep(model, sg.AdamW(ctx, model), tokens=4, world=world)
            step.load(np.ones((4, 8), np.float32), [0, 1, 2, 3])
            assert np.isfinite(step().item())
    assert world.closed and "closed" in repr(world)
    with pytest.raises(sg.StepGraphError, match="this World is closed"):
        world.describe()
    world.close()  # a second close is harmless


def test_context_parallel_rows_of_a_world_of_one_and_their_errors(no_launcher):
    # Over one rank the share is the whole batch (chunks 0 and 1); the worlds of two are
    # python_trainer_parity_test's context_parallel_2, against the C++ cut.
    with sg.init_distributed("host") as world:
        assert sg.context_parallel_rows(np.arange(6).reshape(2, 3), world).tolist() == [0, 1, 2, 3, 4, 5]
        with pytest.raises(sg.ArgumentError, match="the batch's 5 tokens must divide into 2 x 1"):
            sg.context_parallel_rows(np.arange(5), world)
    with pytest.raises(TypeError, match="world must be a stepgraph World"):
        sg.context_parallel_rows([0, 1], "all")


def test_auto_device_is_host_without_a_gpu(no_launcher):
    with sg.init_distributed() as world:
        assert world.device == ("cuda" if sg.cuda_device_count()[0] > 0 else "host")


def test_torchrun_world_of_one_opens_no_socket(no_launcher):
    # WORLD_SIZE=1 is a world of one even with every variable set: MASTER_PORT is never listened on.
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="1").items():
        no_launcher.setenv(name, value)
    with sg.init_distributed("host", timeout=0.5) as world:
        assert (world.rank, world.size) == (0, 1)
        assert "via torchrun" in world.describe()


def test_the_step_keeps_the_world_alive_after_close(no_launcher):
    world = sg.init_distributed("host")
    with sg.Context("host") as ctx:
        model = sg.ResidualStack(ctx, hidden=8, ffn=16, layers=1, vocab=16, dtype="float32")
        step = sg.TrainStep(model, sg.AdamW(ctx, model), tokens=4, world=world)
        world.close()
        graph = step.capture()
        step.load(np.ones((4, 8), np.float32), [0, 1, 2, 3])
        graph.replay()
        assert np.isfinite(graph.outputs[0].item())
        with pytest.raises(sg.StepGraphError, match="this World is closed"):
            sg.TrainStep(model, sg.AdamW(ctx, model), tokens=4, world=world)


# ---- bad arguments and bad launches -------------------------------------------------------------

@pytest.mark.parametrize("device, error, words", [
    ("tpu", sg.ArgumentError, "init_distributed: device must be one of 'auto', 'cuda', 'host', got 'tpu'"),
    (0, TypeError, "device must be one of 'auto', 'cuda', 'host' (a str), got int 0"),
    (None, TypeError, "got NoneType None"),
])
def test_bad_device_is_a_clear_error(no_launcher, device, error, words):
    with pytest.raises(error) as raised:
        sg.init_distributed(device)
    assert words in str(raised.value)


@pytest.mark.parametrize("timeout, error", [
    (0, sg.ArgumentError), (-5, sg.ArgumentError), (float("nan"), sg.ArgumentError), (float("inf"), sg.ArgumentError),
    (1e9, sg.ArgumentError), (10**400, sg.ArgumentError), ("300", TypeError), (True, TypeError), (None, TypeError),
])
def test_bad_timeout_is_a_clear_error(no_launcher, timeout, error):
    with pytest.raises(error, match="init_distributed: timeout must be"):
        sg.init_distributed("host", timeout=timeout)


def test_numpy_and_int_timeouts_are_taken(no_launcher):
    for timeout in (np.float32(2.5), np.int64(3), 1):
        sg.init_distributed("host", timeout=timeout).close()


def test_train_step_world_must_be_a_world(no_launcher):
    with sg.Context("host") as ctx:
        model = sg.ResidualStack(ctx, hidden=8, ffn=16, layers=1, vocab=16, dtype="float32")
        with pytest.raises(TypeError, match="TrainStep: world must be a stepgraph World"):
            sg.TrainStep(model, sg.AdamW(ctx, model), tokens=4, world="world")
    with pytest.raises(TypeError, match="init_distributed"):
        sg.World()


def test_communication_stream_is_checked():
    with sg.Context("host", side_streams=2) as ctx:
        assert ctx.communication_stream is None
        ctx.communication_stream = 1
        assert ctx.communication_stream == 1
        ctx.communication_stream = None
        assert ctx.communication_stream is None
        with pytest.raises(sg.StepGraphError, match=r"communication stream must be a side stream in \[1, 3\)"):
            ctx.communication_stream = 3
        with pytest.raises(sg.StepGraphError, match="communication stream must be a side stream"):
            ctx.communication_stream = 0  # the main stream
        with pytest.raises(sg.ArgumentError, match="communication_stream"):
            ctx.communication_stream = -1
    with pytest.raises(sg.StepGraphError, match="communication stream must be a side stream"):
        sg.Context("host", communication_stream=2)  # one side stream only
    with pytest.raises(TypeError, match="communication_stream"):
        sg.Context("host", side_streams=2, communication_stream=2.0)


def test_inconsistent_launcher_variables_name_the_variable(no_launcher):
    for name, value in dict(RANK="2", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="29500").items():
        no_launcher.setenv(name, value)
    with pytest.raises(sg.StepGraphError, match="sg_world_init: .*RANK") as raised:
        sg.init_distributed("host", timeout=1)
    assert raised.value.code_name == "invalid_argument"
    no_launcher.setenv("RANK", "1")
    no_launcher.delenv("WORLD_SIZE")
    with pytest.raises(sg.StepGraphError, match="sg_world_init: .*WORLD_SIZE"):
        sg.init_distributed("host", timeout=1)


def test_a_rank_whose_peers_never_come_fails_within_the_timeout(no_launcher):
    # Rank 1 of 2 with nobody listening at MASTER_PORT: an error after the timeout, not a hang.
    for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port())).items():
        no_launcher.setenv(name, value)
    start = time.monotonic()
    with pytest.raises(sg.StepGraphError, match="sg_world_init: .*rank 0") as raised:
        sg.init_distributed("host", timeout=0.5)
    assert time.monotonic() - start < 10, "the timeout was not kept"
    assert raised.value.code_name == "io"


def test_a_rank_that_leaves_early_fails_the_others_step(tmp_path, no_launcher):
    # Rank 1 joins and exits; rank 0's capture (which exchanges with every rank) is an error, not a hang.
    results = wait_all(start_ranks(2, lambda rank: ["leave" if rank == 1 else "capture"]))
    (code0, output0), (code1, output1) = results
    assert code1 == 0, output1
    assert code0 == 3, output0
    assert "StepGraphError" in output0 and "rank 1" in output0, output0


def readme_example():
    """The torchrun example of python/README.md (its second python block), as written."""
    candidates = [os.environ.get("STEPGRAPH_README", ""), "python/README.md",
                  os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "README.md")]
    path = next((c for c in candidates if c and os.path.isfile(c)), None)
    assert path, f"python/README.md not found (looked at {candidates}); set STEPGRAPH_README"
    with open(path) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) >= 2 and "init_distributed" in blocks[1], "the README's second block is the torchrun example"
    return blocks[1]


def test_readme_torchrun_example_runs_on_two_ranks(no_launcher):
    (code0, output0), (code1, output1) = wait_all(start_ranks(2, lambda rank: ["readme"]))
    assert code0 == 0 and code1 == 0, f"rank 0:\n{output0}\nrank 1:\n{output1}"
    losses = [float(v) for v in re.findall(r"step \d+: loss ([0-9.]+)", output0)]
    assert len(losses) == 10 and losses[-1] < losses[0], output0
    assert "loss" not in output1, "only rank 0 prints"


def leave():
    with sg.init_distributed("host", timeout=30):
        pass


def capture_alone():
    with sg.init_distributed("host", timeout=30) as world:
        with sg.Context("host") as ctx:
            model = sg.ResidualStack(ctx, hidden=8, ffn=16, layers=1, vocab=16, dtype="float32")
            step = sg.TrainStep(model, sg.AdamW(ctx, model), tokens=4, world=world)
            try:
                step.capture()
                step.load(np.ones((4, 8), np.float32), [0, 1, 2, 3])
                step()
            except sg.StepGraphError as error:
                print(f"StepGraphError: {error}", flush=True)
                sys.exit(3)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2], *sys.argv[3:4])
    elif sys.argv[1:2] == ["leave"]:
        leave()
    elif sys.argv[1:2] == ["capture"]:
        capture_alone()
    elif sys.argv[1:2] == ["readme"]:
        example = readme_example()
        # Two ranks need two GPUs (NCCL puts one rank on a GPU; with fewer the
        # example's "auto" is a clear error): run it on the host then.
        if sg.cuda_device_count()[0] < int(os.environ["LOCAL_WORLD_SIZE"]):
            assert "sg.init_distributed()" in example
            example = example.replace("sg.init_distributed()", 'sg.init_distributed("host")')
        exec(compile(example, "python/README.md", "exec"), {"__name__": "readme_example"})
    else:
        sys.exit(pytest.main([__file__, *sys.argv[1:]]))
