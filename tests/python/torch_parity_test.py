"""A bf16 LayerNormMLP built in StepGraph from Python against the same module in
torch (LayerNorm -> Linear -> GeLU(tanh) -> Linear) with the same weights: the
output, dx and every parameter gradient agree within bf16 tolerances, eager and
from a captured step replayed with new inputs. Inputs are torch tensors wrapped
without a copy; outputs are read back as torch views without a copy.

Needs torch and a CUDA device; skips saying which is missing. Runs under pytest
or as a plain script: `python3 torch_parity_test.py` (exit status 1 on failure).
"""

import unittest

import stepgraph as sg
from gpu_support import require_cuda, require_torch, run_as_script

TOKENS, HIDDEN, FFN = 128, 256, 1024
EPS = 1e-5
# bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2%); both sides round
# the normed input, the pre-activation, the activation and the output to bf16 and
# sum in fp32 in different orders. Measured as a relative L2 error over the whole
# tensor, plus a bound on the largest single difference.
OUTPUT_REL_L2 = 1e-2
GRAD_REL_L2 = 2e-2
MAX_ABS_FRACTION = 6e-2  # largest |ours - torch| over the largest |torch|


def requirements():
    """(torch, cuda context), or a skip naming what is missing."""
    torch = require_torch()
    return torch, require_cuda()


def compare(what, ours, reference, rel_l2_bound):
    ours, reference = ours.float(), reference.float()
    difference = (ours - reference).norm().item()
    scale = reference.norm().item()
    rel_l2 = difference / max(scale, 1e-30)
    max_abs = (ours - reference).abs().max().item()
    max_ref = reference.abs().max().item()
    print(f"  {what:16s} rel_l2 {rel_l2:.2e} (bound {rel_l2_bound:.0e})  max|diff| {max_abs:.3e} of max|ref| "
          f"{max_ref:.3e}")
    assert rel_l2 <= rel_l2_bound, f"{what}: relative L2 error {rel_l2:.3e} > {rel_l2_bound}"
    assert max_abs <= MAX_ABS_FRACTION * max_ref, f"{what}: max |diff| {max_abs:.3e} > {MAX_ABS_FRACTION} * {max_ref}"


def build(torch, ctx):
    """The StepGraph layer with random masters, and the torch module with its bf16 weights."""
    mlp = sg.LayerNormMLP(ctx, HIDDEN, FFN, norm="layernorm", eps=EPS, dtype="bf16", name="mlp", seed=11)
    generator = torch.Generator(device="cuda").manual_seed(0)
    params = mlp.parameters()
    assert [p.name for p in params] == ["mlp.norm.gamma", "mlp.norm.beta", "mlp.fc1.weight", "mlp.fc1.bias",
                                        "mlp.fc2.weight", "mlp.fc2.bias"], [p.name for p in params]
    for p in params:
        master = p.master.torch()  # fp32, StepGraph's memory
        values = torch.randn(master.shape, generator=generator, device="cuda") * 0.05
        if p.name.endswith("gamma"):
            values += 1.0
        master.copy_(values)
    torch.cuda.synchronize()  # torch's writes land before StepGraph reads the masters
    mlp.sync_parameters()  # the bf16 copies the forward reads
    ctx.synchronize()

    module = torch.nn.Sequential(
        torch.nn.LayerNorm(HIDDEN, eps=EPS), torch.nn.Linear(HIDDEN, FFN), torch.nn.GELU(approximate="tanh"),
        torch.nn.Linear(FFN, HIDDEN)).to(device="cuda", dtype=torch.bfloat16)
    targets = [module[0].weight, module[0].bias, module[1].weight, module[1].bias, module[3].weight, module[3].bias]
    with torch.no_grad():
        for p, target in zip(params, targets):
            value = p.value.torch()
            assert value.dtype == torch.bfloat16 and value.data_ptr() == p.value.data_ptr, "a view, not a copy"
            target.copy_(value)
    return mlp, module, list(zip(params, targets))


def torch_reference(torch, module, x, dy):
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad


def check_against_torch(torch, ctx, pairs, y, dx, y_ref, dx_ref):
    ctx.synchronize()  # StepGraph's streams are done before torch reads
    y_view, dx_view = y.torch(), dx.torch()
    assert y_view.data_ptr() == y.data_ptr and y_view.dtype == torch.bfloat16
    compare("y", y_view, y_ref, OUTPUT_REL_L2)
    compare("dx", dx_view, dx_ref, GRAD_REL_L2)
    for p, target in pairs:
        compare(p.name, p.grad.torch(), target.grad, GRAD_REL_L2)


def test_layernorm_mlp_bf16_matches_torch_autograd():
    torch, ctx = requirements()
    mlp, module, pairs = build(torch, ctx)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.1
    xt, dyt = ctx.wrap(x, name="x"), ctx.wrap(dy, name="dy")
    assert xt.data_ptr == x.data_ptr(), "wrapped without a copy"
    y, saved = mlp.forward(xt)
    dx = mlp.backward(saved, dyt)
    y_ref, dx_ref = torch_reference(torch, module, x, dy)
    print("eager:")
    check_against_torch(torch, ctx, pairs, y, dx, y_ref, dx_ref)


def test_captured_layernorm_mlp_replayed_with_new_torch_inputs_matches_torch():
    torch, ctx = requirements()
    mlp, module, pairs = build(torch, ctx)
    x_static = ctx.tensor((TOKENS, HIDDEN), "bf16", name="x")
    dy_static = ctx.tensor((TOKENS, HIDDEN), "bf16", name="dy")

    def step():
        y, saved = mlp.forward(x_static)
        return [y, mlp.backward(saved, dy_static)]

    graph = sg.capture(ctx, step, policy="error")
    for seed in (1, 2):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator)
        dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.1
        graph.replay({x_static: ctx.wrap(x), dy_static: ctx.wrap(dy)})
        y, dx = graph.outputs
        y_ref, dx_ref = torch_reference(torch, module, x, dy)
        print(f"graph replay {seed}:")
        check_against_torch(torch, ctx, pairs, y, dx, y_ref, dx_ref)
    assert graph.replay_count == 2


def test_cupy_array_is_wrapped_through_cuda_array_interface():
    torch, ctx = requirements()
    try:
        import cupy
    except ImportError as error:
        raise unittest.SkipTest(f"cupy is not installed: {error}")
    layer = sg.Linear(ctx, 64, 32, bias=True, dtype="float32", name="fc")
    import numpy as np

    x = cupy.asarray(np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32))
    xt = ctx.wrap(x)
    assert xt.data_ptr == x.data.ptr
    y = layer(xt)
    ctx.synchronize()
    weight, bias = (cupy.asarray(p.master) for p in layer.parameters()[:2])  # fp32 masters via the interface
    expected = x @ weight.T + bias
    difference = float(cupy.abs(cupy.asarray(y) - expected).max())
    print(f"cupy fp32 linear: max|diff| {difference:.3e}")
    assert difference <= 1e-3 * float(cupy.abs(expected).max()) + 1e-5


if __name__ == "__main__":
    run_as_script(globals(), "torch_parity_test")
