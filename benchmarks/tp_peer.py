"""tp_peer.py: tp_mlp_bench's PyTorch peer, the same sequence-parallel MLP
(LayerNorm -> fc1 -> GeLU(tanh) -> fc2, bf16, fwd + bwd) at the same shapes
in torch.distributed, launched the same way:

    torchrun --nproc-per-node 2 tp_peer.py --config large --out tp_peer.json

Rows (each rank holds T / N tokens outside the MLP and ffn / N inside it):
  pytorch_sequential  all_gather_into_tensor, then the GEMM; the GEMM, then
                      reduce_scatter_tensor (no overlap), eager
  pytorch_async_tp    PyTorch's async tensor parallelism over symmetric memory:
                      torch.ops.symm_mem.fused_all_gather_matmul for the two
                      all-gather + GEMM pairs and fused_matmul_reduce_scatter
                      for the two GEMM + reduce-scatter pairs, eager
The backward is written out (the fused ops have no autograd): d_act by the
gathered dy, GeLU's derivative, fc1's data gradient reduce-scattered, both
weight gradients as bf16 GEMMs from the gathered tensors (kept in fp32), the norm's backward by
autograd on the shard. Timing: rows interleaved in rounds, a sample is
--iters steps between CUDA events after a barrier, medians of the slowest
rank. NVLink multicast stays off: the three variables are set before torch
is imported.
"""

import os


def keep_multicast_off():
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    for name, value in env.items():
        os.environ[name] = value
    return env


MULTICAST_ENV = keep_multicast_off()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
except ImportError:  # the build machines: tp_step_peer's config checks import this file without torch
    torch = dist = F = None

# hidden, ffn, tokens per step: benchmarks/step_configs.cc
CONFIGS = {"small": (512, 2048, 256), "medium": (2048, 8192, 4096), "large": (4096, 16384, 8192)}


def gelu(x):
    return F.gelu(x, approximate="tanh")


def gelu_grad(x):
    # d/dx of the tanh GeLU, in fp32
    x = x.float()
    k = 0.7978845608028654
    inner = k * (x + 0.044715 * x * x * x)
    t = torch.tanh(inner)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)


def enable_async_tp(group):
    """Symmetric memory for the group, where this torch still needs it enabled (the fused ops' workspace)."""
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group.group_name)


class TPComm:
    """How a rank's tensor-parallel collectives meet their GEMMs along the token dimension (dim 0):
    sequential NCCL collectives (all_gather_into_tensor, then the GEMM; the GEMM, then reduce_scatter_tensor) or,
    with async_tp, PyTorch's fused ops over symmetric memory (enable_async_tp first)."""

    def __init__(self, group, async_tp):
        self.group = group
        self.name = group.group_name
        self.async_tp = async_tp

    def all_gather_mm(self, shard, weight_t):
        """(gathered shard, gathered @ weight_t)."""
        if self.async_tp:
            gathered, outs = torch.ops.symm_mem.fused_all_gather_matmul(shard, [weight_t], 0, self.name)
            return gathered, outs[0]
        gathered = torch.empty((shard.shape[0] * self.group.size(), shard.shape[1]), dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(gathered, shard, group=self.group)
        return gathered, gathered @ weight_t

    def mm_reduce_scatter(self, a, weight_t):
        """(a @ weight_t) summed over the ranks, this rank's rows."""
        if self.async_tp:
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, weight_t, "sum", 0, self.name)
        partial = a @ weight_t
        out = torch.empty((a.shape[0] // self.group.size(), weight_t.shape[1]), dtype=a.dtype, device=a.device)
        dist.reduce_scatter_tensor(out, partial, group=self.group)
        return out


class Layer:
    def __init__(self, hidden, local_ffn, group, async_tp):
        dev = torch.device("cuda")
        g = torch.Generator(device=dev).manual_seed(7 + dist.get_rank())
        self.norm = torch.nn.LayerNorm(hidden, device=dev, dtype=torch.bfloat16)
        self.w1 = (torch.rand(local_ffn, hidden, generator=g, device=dev) * 2 - 1).bfloat16() / hidden**0.5
        self.b1 = torch.zeros(local_ffn, device=dev, dtype=torch.bfloat16)
        self.w2 = (torch.rand(hidden, local_ffn, generator=g, device=dev) * 2 - 1).bfloat16() / local_ffn**0.5
        self.b2 = torch.zeros(hidden, device=dev, dtype=torch.bfloat16)
        self.group = group
        self.comm = TPComm(group, async_tp)
        self.all_gather_mm = self.comm.all_gather_mm
        self.mm_reduce_scatter = self.comm.mm_reduce_scatter

    def step(self, x, dy):
        x = x.detach().requires_grad_(True)
        normed = self.norm(x)
        gathered, pre = self.all_gather_mm(normed.detach(), self.w1.t())
        pre = pre + self.b1
        act = gelu(pre)
        y = self.mm_reduce_scatter(act, self.w2.t())
        if self.group.rank() == 0:
            y = y + self.b2
        # backward
        dy_all, d_act = self.all_gather_mm(dy, self.w2)
        d_pre = (d_act.float() * gelu_grad(pre)).bfloat16()
        # bf16 GEMMs (fp32 accumulation inside cuBLAS), gradients kept in fp32
        w2_grad = (dy_all.t() @ act).float()
        w1_grad = (d_pre.t() @ gathered).float()
        d_normed = self.mm_reduce_scatter(d_pre, self.w1)
        normed.backward(d_normed)
        return y, x.grad, w1_grad, w2_grad


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="large", choices=sorted(CONFIGS))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    group = dist.group.WORLD
    n = group.size()
    hidden, ffn, tokens = CONFIGS[args.config]
    rows = {"pytorch_sequential": Layer(hidden, ffn // n, group, False)}
    notes = {}
    try:
        enable_async_tp(group)
        rows["pytorch_async_tp"] = Layer(hidden, ffn // n, group, True)
    except Exception as error:  # report, do not hide: the row is missing with its reason
        notes["pytorch_async_tp"] = f"unavailable: {error}"
    g = torch.Generator(device="cuda").manual_seed(1234 + dist.get_rank())
    x = (torch.rand(tokens // n, hidden, generator=g, device="cuda") * 2 - 1).bfloat16()
    dy = (torch.rand(tokens // n, hidden, generator=g, device="cuda") * 2 - 1).bfloat16()
    samples = {name: [] for name in rows}
    for name in list(rows):
        try:
            rows[name].step(x, dy)
        except Exception as error:
            notes[name] = f"failed: {error}"
            del rows[name]
            del samples[name]
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for round_ in range(-args.warmup, args.repeats):
        for name, layer in rows.items():
            dist.barrier(group=group)
            start.record()
            for _ in range(args.iters):
                layer.step(x, dy)
            stop.record()
            stop.synchronize()
            if round_ >= 0:
                samples[name].append(1000.0 * start.elapsed_time(stop) / args.iters)
    results = []
    for name, values in samples.items():
        mine = torch.tensor([statistics.median(values), min(values), max(values)], device="cuda", dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
        med, low, high = mine.tolist()
        results.append({"name": name, "median_us": med, "min_us": low, "max_us": high})
    if dist.get_rank() == 0:
        print(f"tp_peer: torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
              f"{n} rank(s), config {args.config}: hidden {hidden}, ffn {ffn} ({ffn // n} per rank), "
              f"{tokens} tokens ({tokens // n} per rank), bf16")
        for r in results:
            print(f"  {r['name']:<20} {r['median_us']:9.1f} us [{r['min_us']:.1f}-{r['max_us']:.1f}]")
        for name, note in notes.items():
            print(f"  {name}: {note}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"benchmark": "tp_mlp", "source": "pytorch", "torch": torch.__version__,
                           "world_size": n, "config": args.config, "hidden": hidden, "ffn": ffn, "tokens": tokens,
                           "iters": args.iters, "repeats": args.repeats, "multicast_env": MULTICAST_ENV,
                           "notes": notes, "rows": results}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
