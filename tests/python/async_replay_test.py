"""The DataLoader loop: replay with a fresh torch batch every step, no
synchronize, the batch dropped right after replay(). torch's caching allocator
hands the freed memory to the next clone() at once, so the replay must order
torch's stream after its input copies (Note [Sources the caller reuses] in
graphs/captured_step.h). The graphed model must end equal to an eager one
trained on the same batches, bit for bit, and the test counts the reused
addresses to show the reuse happened. Skips without a CUDA device or torch.
Runs under pytest or as `python3 async_replay_test.py`."""

import numpy as np

import stepgraph as sg
from gpu_support import require_cuda, require_torch, run_as_script

STEPS = 12
TOKENS = 256
HIDDEN = 256
VOCAB = 128


def make_step(ctx):
    model = sg.ResidualStack(ctx, hidden=HIDDEN, ffn=1024, layers=4, vocab=VOCAB, dtype="bf16", seed=5)
    return sg.TrainStep(model, sg.AdamW(ctx, model, lr=1e-2), TOKENS)


def parameter_bytes(step):
    """Every parameter tensor of the step's model, as raw bytes (masters, copies, gradients)."""
    out = []
    for parameter in step.model.parameters():
        for tensor in (parameter.master, parameter.value, parameter.grad):
            out.append(np.ascontiguousarray(tensor.numpy()).tobytes())
    return out


def test_replay_with_dropped_torch_batches_equals_eager_bit_for_bit():
    ctx = require_cuda()
    torch = require_torch()
    generator = torch.Generator(device="cuda").manual_seed(0)
    batches = torch.randn(STEPS, TOKENS, HIDDEN, device="cuda", generator=generator).to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (STEPS, TOKENS), device="cuda", generator=generator, dtype=torch.int32)
    torch.cuda.synchronize()

    eager = make_step(ctx)
    for s in range(STEPS):
        eager.load(batches[s].float().cpu().numpy(), labels[s].cpu().numpy())
        eager_loss = eager().item()

    graphed = make_step(ctx)
    graph = graphed.capture(policy="error")
    addresses = []
    for s in range(STEPS):
        x = batches[s].clone()  # torch's allocator: the memory the last step's batch had
        y = labels[s].clone()
        addresses.append(x.data_ptr())
        graph.replay({graphed.x: ctx.wrap(x), graphed.labels: ctx.wrap(y)})
        del x, y  # dropped before StepGraph's stream has copied it
    ctx.synchronize()
    torch.cuda.synchronize()

    reused = len(addresses) - len(set(addresses))
    assert reused > 0, f"torch never reused a batch's memory ({addresses}); the test shows nothing"
    graph_loss = graph.outputs[0].item()
    assert np.float32(graph_loss).tobytes() == np.float32(eager_loss).tobytes(), (graph_loss, eager_loss)
    assert graphed.optimizer.steps_taken == eager.optimizer.steps_taken == STEPS
    eager_bytes, graph_bytes = parameter_bytes(eager), parameter_bytes(graphed)
    differing = sum(a != b for a, b in zip(eager_bytes, graph_bytes))
    assert differing == 0, f"{differing} of {len(eager_bytes)} parameter tensors differ from eager ({reused} reused addresses)"
    print(f"{reused} of {STEPS} batches reused an earlier batch's memory; every parameter equals eager")


if __name__ == "__main__":
    run_as_script(globals(), __file__)
