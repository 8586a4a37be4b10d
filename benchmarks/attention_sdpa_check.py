#!/usr/bin/env python3
"""Our attention kernels against PyTorch's scaled_dot_product_attention on random shapes.

    python3 benchmarks/attention_sdpa_check.py --binary bazel-bin/benchmarks/attention_sdpa_dump [--cases 16] [--seed N]

Runs attention_sdpa_dump (random packings: odd lengths, one-token and empty
sequences, sequences over several tiles; bf16/fp16; head_dim 64, 128 and 96;
MHA, GQA, MQA; causal or not), then recomputes every sequence of every case
with torch.nn.functional.scaled_dot_product_attention in fp32 from the same
16-bit inputs (enable_gqa for grouped heads), its gradients by autograd from
the same dout, and the log-sum-exp of the scaled scores. Each of out, lse, dq,
dk, dv must be within the tolerance of the largest reference magnitude (the
kernel tests' measure: bf16 2e-2, fp16 4e-3, relative to the largest |value|;
lse absolute 1e-2). Prints a row per case and the seed; exits 1 on any miss.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

TOLERANCE = {"bf16": 2e-2, "fp16": 4e-3}
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def load_case(directory, index):
    with open(os.path.join(directory, f"case_{index}.json")) as f:
        meta = json.load(f)
    raw = np.fromfile(os.path.join(directory, f"case_{index}.bin"), dtype=np.uint8)
    t, h, hkv, d = meta["tokens"], meta["heads"], meta["kv_heads"], meta["head_dim"]
    dtype = TORCH_DTYPE[meta["dtype"]]

    def array(name, shape, floating32=False):
        where = meta["arrays"][name]
        data = raw[where["offset"] : where["offset"] + where["bytes"]]
        if floating32:
            return torch.from_numpy(data.view(np.float32).copy()).reshape(shape)
        return torch.from_numpy(data.view(np.int16).copy()).view(dtype).reshape(shape)

    tensors = {name: array(name, (t, h, d)) for name in ("q", "dout", "out", "dq")}
    tensors.update({name: array(name, (t, hkv, d)) for name in ("k", "v", "dk", "dv")})
    tensors["lse"] = array("lse", (h, t), floating32=True)
    return meta, tensors


def reference(meta, x, device):
    """SDPA in fp32 per sequence: out, lse, dq, dk, dv over the packed tokens."""
    t, h, hkv, d = meta["tokens"], meta["heads"], meta["kv_heads"], meta["head_dim"]
    scale = meta["scale"]
    out = torch.zeros(t, h, d, dtype=torch.float32)
    lse = torch.zeros(h, t, dtype=torch.float32)
    dq = torch.zeros(t, h, d, dtype=torch.float32)
    dk = torch.zeros(t, hkv, d, dtype=torch.float32)
    dv = torch.zeros(t, hkv, d, dtype=torch.float32)
    cu = meta["cu_seqlens"]
    for begin, end in zip(cu[:-1], cu[1:]):
        if end == begin:
            continue
        # [L, H, D] -> [1, H, L, D]
        q = x["q"][begin:end].float().permute(1, 0, 2).unsqueeze(0).to(device).requires_grad_()
        k = x["k"][begin:end].float().permute(1, 0, 2).unsqueeze(0).to(device).requires_grad_()
        v = x["v"][begin:end].float().permute(1, 0, 2).unsqueeze(0).to(device).requires_grad_()
        dout = x["dout"][begin:end].float().permute(1, 0, 2).unsqueeze(0).to(device)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=meta["causal"], scale=scale, enable_gqa=hkv != h)
        o.backward(dout)
        out[begin:end] = o[0].permute(1, 0, 2).detach().cpu()
        dq[begin:end] = q.grad[0].permute(1, 0, 2).cpu()
        dk[begin:end] = k.grad[0].permute(1, 0, 2).cpu()
        dv[begin:end] = v.grad[0].permute(1, 0, 2).cpu()
        with torch.no_grad():
            kk = k[0].repeat_interleave(h // hkv, dim=0)
            scores = scale * (q[0] @ kk.transpose(1, 2))  # [H, L, L]
            if meta["causal"]:
                length = end - begin
                mask = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
                scores = scores.masked_fill(mask, -math.inf)
            lse[:, begin:end] = torch.logsumexp(scores, dim=-1).cpu()
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def relative_error(got, want):
    got = got.float()
    if not torch.isfinite(got).all():
        return math.inf
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    return diff / scale if scale > 0 else diff


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", required=True, help="attention_sdpa_dump")
    parser.add_argument("--cases", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="0: a new one (printed)")
    parser.add_argument("--keep", help="write the cases here instead of a temporary directory")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_sdpa_check: needs a GPU (torch.cuda.is_available() is False)")
        return 1
    seed = args.seed or int.from_bytes(os.urandom(4), "little") or 1
    directory = args.keep or tempfile.mkdtemp(prefix="attention_sdpa_")
    subprocess.run([args.binary, "--out", directory, "--cases", str(args.cases), "--seed", str(seed)], check=True)
    device = torch.device("cuda")
    failures = 0
    print(f"{'case':>4} {'dtype':>9} {'H/Hkv':>6} {'D':>4} {'causal':>6} {'kernels':>8} {'lengths':<40} "
          f"{'out':>8} {'lse':>8} {'dq':>8} {'dk':>8} {'dv':>8}")
    for index in range(args.cases):
        meta, x = load_case(directory, index)
        want = reference(meta, x, device)
        tol = TOLERANCE[meta["dtype"]]
        errors = {name: relative_error(x[name], want[name]) for name in ("out", "dq", "dk", "dv")}
        # lse: absolute, over tokens of non-empty rows (every token belongs to a non-empty sequence).
        lse_error = (x["lse"] - want["lse"]).abs().max().item() if meta["tokens"] > 0 else 0.0
        ok = all(e <= tol for e in errors.values()) and lse_error <= 1e-2
        failures += 0 if ok else 1
        cu = meta["cu_seqlens"]
        lengths = ",".join(str(b - a) for a, b in zip(cu[:-1], cu[1:]))
        print(f"{index:>4} {meta['dtype']:>9} {meta['heads']:>3}/{meta['kv_heads']:<2} {meta['head_dim']:>4} "
              f"{str(meta['causal']):>6} {'tensor' if meta['tensor_cores'] else 'plain':>8} {lengths[:40]:<40} "
              f"{errors['out']:8.1e} {lse_error:8.1e} {errors['dq']:8.1e} {errors['dk']:8.1e} {errors['dv']:8.1e}"
              f"{'' if ok else '  FAIL (tolerance %.0e)' % tol}")
    print(f"attention_sdpa_check: {args.cases - failures} of {args.cases} cases within tolerance; seed {seed} "
          f"(rerun with --seed {seed})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
