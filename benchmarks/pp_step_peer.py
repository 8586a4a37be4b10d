#!/usr/bin/env python3
"""pp_step_peer.py: the PyTorch peer of step_bench --pp P, the whole GPT
training step (embedding, forward, cross-entropy, backward, AdamW) pipelined
over the P ranks of a launch with torch.distributed.pipelining, one process
per GPU:

    torchrun --nproc-per-node 2 benchmarks/pp_step_peer.py --configs medium,large --microbatches 8 \\
        --out pp_step_peer.json
    torchrun --nproc-per-node 2 benchmarks/pp_step_peer.py --configs medium,large --microbatches 8 \\
        --virtual-stages 2 --out pp_step_peer_v2.json

P is the launch's world size. The configs are step_configs.cc's dense GPTs
(pytorch_peer's small, medium, large: hidden, heads, layers, seq_len,
vocab 8192; bf16 compute over fp32 masters; fused AdamW with pytorch_peer's
lr and weight decay). As step_bench --pp, the global batch is M
(--microbatches) microbatches of ONE sequence of seq_len tokens each, the
model is the GPT with a token embedding (LanguageModel: embedding -> blocks
-> final LayerNorm -> head -> cross-entropy), and its layers are split
evenly over P V model chunks (V: --virtual-stages), Megatron's interleaved
layout: chunk c of rank r holds model chunk c P + r; model chunk 0 carries
the embedding, model chunk P V - 1 the final norm, the head and the loss.

The model. Each model chunk is an nn.Module (Chunk below) whose blocks hold
pytorch_peer.make_params' values (seed 1: the same parameters as
pytorch_peer's 1-GPU step of the config) and compute as
pytorch_peer.forward_loss does (LayerNorm -> QKV -> rotary -> causal SDPA
-> projection, + residual; LayerNorm -> Linear -> GeLU(tanh) -> Linear, +
residual); the embedding table [vocab, hidden] is drawn uniform in +-1
(seed 3: the scale of pytorch_peer's input x) and read in bf16; tokens and
labels are drawn with seed 2. The parameters are drawn once per config on
the GPU, kept on the host, and each row copies its chunks' to its GPU.

Rows per config (step_bench's schema, the pipeline fields below):
  pytorch_pp1              every rank the whole model alone on its GPU, all
                           ranks at once: the M microbatches one after the
                           other with gradient accumulation (each
                           microbatch's loss / M backward), one AdamW step;
                           eager (the baseline of step_bench's
                           stepgraph_<mode>_pp1)
  pytorch_pp1_compile      the same with each block under torch.compile
                           (Inductor), the embedding, head and loss eager
  pytorch_pp_1f1b_eager    PipelineStage per model chunk (explicit input and
                           output shapes: no runtime shape inference) over a
                           process group of the P ranks, Schedule1F1B (V = 1)
                           or ScheduleInterleaved1F1B (V > 1) with the
                           per-microbatch cross-entropy as loss_fn
                           (scale_grads: the gradients / M), AdamW over the
                           rank's chunks; the step's loss (the mean of the
                           last stage's microbatch losses) broadcast from the
                           last stage to every rank, as step_bench's
  pytorch_pp_1f1b_compile  the same with each block under torch.compile; the
                           blocks are compiled (one forward and backward of
                           each chunk alone, no communication) and two steps
                           run before the warm-up
  pytorch_pp_1f1b_graph    an attempt to capture pytorch_pp_1f1b_eager's whole
                           step (schedule.step, AdamW(capturable=True), the
                           loss broadcast) with torch.cuda.graph, PyTorch's
                           recipe: 3 eager steps on a side stream, grads set
                           to None, the capture on that stream with
                           capture_error_mode "thread_local", over a process
                           group of its own (so a refused capture cannot
                           leave the other rows' communicator behind), and
                           one replay whose loss must be finite. What
                           happened is the config's "graph_capture": captured
                           (the row is timed like the others) or refused
                           (the row is "failed" with PyTorch's error text);
                           graph_speedup_vs_eager against the eager row
The pipeline rows need P > 1 (at world size 1 only the pp1 rows run). A row
that cannot be built is "failed" with its reason; a refused compile or
capture of a pipeline row is a result and leaves the exit status 0. Rows
after the --budget-s deadline are "not_run" (rank 0's clock decides for all).

Each row, in step_bench --pp's field names (Note [Pipeline-parallel rows]
in benchmarks/pipeline_step_runner.h): step_us (median, min, max over
--steps samples after --warmup steps; the ranks meet with dist.barrier
before each sample and a sample is the largest over the ranks; pipelined:
the largest over the ranks of --steps steps and one synchronize, / steps),
tokens_per_s of the global batch (and tokens_per_s_per_gpu), tflops and mfu
per GPU (/ P for the pipeline rows), peak_bytes (the largest over the
ranks) and rank_peak_bytes (torch.cuda.max_memory_allocated of each rank
over the row's run; rank_device_used_delta_bytes: cudaMemGetInfo's used
bytes after it minus before it), first_losses, pp, virtual_stages,
microbatches, schedule, theoretical_bubble_fraction = (P - 1) / (V M + P - 1),
measured_bubble_fraction = 1 - T_pp1 / (P T_pp) against baseline_system
(the eager and graph rows: pytorch_pp1; the compiled row:
pytorch_pp1_compile), bubble_ratio = measured / theoretical, speedup_vs_pp1
= T_pp1 / T_pp, and loss_rel_diff: the first loss against one GPU's
(pytorch_peer.forward_loss over the whole model, no_grad, on each
microbatch of the same batch, their mean), agreeing within
PP_LOSS_TOLERANCE (pp_loss_check). Rank 0 writes the JSON after every
config; progress goes to stderr. NVLink multicast stays off:
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set before torch is imported. The config table,
flags, layer split, bubbles and row arithmetic need no torch (tests).
"""

import os
import sys

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)  # comm_peer (imported next) enforces these values too

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_peer as peer  # noqa: E402  (first: comm_peer sets the multicast variables before torch loads)
import peer_common  # noqa: E402
import tp_step_peer  # noqa: E402  (the launch checks and flags)

import inspect  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

torch, dist, F = peer.torch, peer.dist, peer.F

CONFIGS = ("small", "medium", "large")  # pytorch_peer's dense configs with attention; moe: no PP peer
PP1, PP1_COMPILE = "pytorch_pp1", "pytorch_pp1_compile"
PP_EAGER, PP_COMPILE, PP_GRAPH = "pytorch_pp_1f1b_eager", "pytorch_pp_1f1b_compile", "pytorch_pp_1f1b_graph"
PP_ROWS = (PP_EAGER, PP_COMPILE, PP_GRAPH)
# row: (pipelined, compiled blocks, whole-step graph, baseline row); the capture attempt last, so that whatever a
# refused capture leaves behind meets no later row of the config.
ROWS = {
    PP1: (False, False, False, None),
    PP1_COMPILE: (False, True, False, None),
    PP_EAGER: (True, False, False, PP1),
    PP_COMPILE: (True, True, False, PP1_COMPILE),
    PP_GRAPH: (True, False, True, PP1),
}
PP_LOSS_TOLERANCE = 5e-3  # relative: a row's first loss against one GPU's (bf16; compiled rows fuse differently)
DATA_SEED, PARAM_SEED, EMBEDDING_SEED = 2, 1, 3
ONE_GPU = ("pytorch_peer.forward_loss over the whole model on one GPU (no_grad), on each of the M microbatches "
           "(embedding rows in bf16 as x), their mean: the parameters and batch every row starts from")
LAYOUT = ("the config's layers split evenly over P V model chunks; chunk c of rank r holds model chunk c P + r "
          "(Megatron's interleaved layout, PyTorch's loop-style stage-to-rank mapping); model chunk 0 carries the "
          "embedding, model chunk P V - 1 the final norm, the head and the loss")


def schedule_name(virtual):
    return "Schedule1F1B" if virtual == 1 else "ScheduleInterleaved1F1B"


def check_config(name, pp, virtual, microbatches):
    """None when `name` can be pipelined over `pp` ranks with `virtual` chunks a rank and `microbatches`
    microbatches, else why not (as step_bench --pp refuses it)."""
    if name not in CONFIGS:
        return f"config '{name}' has no pipeline-parallel PyTorch peer (dense configs only: {', '.join(CONFIGS)})"
    layers = peer.CONFIGS[name]["layers"]
    chunks = pp * virtual
    if layers % chunks:
        return (f"config '{name}': its {layers} layers do not split evenly into {pp} stages x {virtual} virtual "
                f"stages ({chunks} model chunks); pass a --virtual-stages whose product with the stages divides "
                f"{layers}")
    if microbatches < pp:
        return (f"--microbatches {microbatches} is fewer than the {pp} pipeline stages (1F1B needs at least one "
                "microbatch per stage)")
    if virtual > 1 and microbatches % pp:
        return (f"--microbatches {microbatches} does not divide by the {pp} pipeline stages, as the interleaved "
                "schedule needs with --virtual-stages > 1")
    return None


def rank_chunks(rank, pp, virtual):
    """The model chunks rank `rank` holds, in order: chunk c is model chunk c pp + rank."""
    return [c * pp + rank for c in range(virtual)]


def chunk_blocks(chunk, layers, chunks):
    """[start, stop) of the blocks of model chunk `chunk` of `chunks` (which divides `layers`)."""
    size = layers // chunks
    return chunk * size, (chunk + 1) * size


def stage_split(layers, pp, virtual):
    """Each rank's model chunks, for the JSON: [[{chunk, blocks, embedding, head}, ...] per rank]."""
    chunks = pp * virtual
    return [[{"chunk": k, "blocks": list(chunk_blocks(k, layers, chunks)), "embedding": k == 0,
              "head": k == chunks - 1} for k in rank_chunks(r, pp, virtual)] for r in range(pp)]


def theoretical_bubble(pp, virtual, microbatches):
    """The idle fraction of (interleaved) 1F1B: (P - 1) / (V M + P - 1)."""
    return (pp - 1) / (virtual * microbatches + pp - 1)


def measured_bubble(one_gpu_us, pipelined_us, pp):
    """1 - T_pp1 / (P T_pp): the share of P GPUs' time that the whole model's work on one GPU does not fill."""
    return 1.0 - one_gpu_us / (pp * pipelined_us)


def batch_config(c, microbatches):
    """The global batch's config: M sequences of seq_len (FLOPs and tokens per step)."""
    return dict(c, sequences=microbatches, tokens=microbatches * c["seq_len"])


def microbatch_config(c):
    """One microbatch's config: one sequence of seq_len (what the attention reads)."""
    return dict(c, sequences=1, tokens=c["seq_len"])


def config_header(name, microbatches):
    """pytorch_peer.config_header's fields for the global batch of M microbatches of one sequence."""
    c = batch_config(peer.CONFIGS[name], microbatches)
    out = peer.config_header(name)
    out.update(tokens=c["tokens"], sequences=c["sequences"], attention_core_flops_per_step=peer.attention_core_flops(c),
               flops_per_step=peer.step_flops(c), microbatches=microbatches, microbatch_sequences=1,
               microbatch_tokens=c["seq_len"],
               global_batch=f"{microbatches} microbatches of one sequence of {c['seq_len']} tokens each: {c['tokens']} "
               "tokens a step (the config's own `sequences` are not used)")
    return out


def pp_row(name, c, world, combined, rank_memory, pipeline, baseline=None, baseline_name=None):
    """A row from the combined ranks (pytorch_peer.combine_ranks): pytorch_peer's row of the global batch `c`,
    tflops and mfu per GPU, each rank's memory (`rank_memory`: row_memory's of every rank), the pipeline's shape
    (`pipeline`: pp, virtual_stages, microbatches, schedule) and bubble, and against a baseline the measured bubble
    and speedup; the names are step_bench --pp's (Note [Pipeline-parallel rows] in
    benchmarks/pipeline_step_runner.h)."""
    row = peer_common.per_gpu_row(peer.system_json(name, c, combined), world, combined)
    row["rank_first_loss"] = combined["rank_first_loss"]
    row["rank_peak_bytes"] = [m["peak_bytes"] for m in rank_memory]
    row["rank_device_used_delta_bytes"] = [m["device_used_delta_bytes"] for m in rank_memory]
    row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / world  # tokens_per_s stays the pipeline's
    row.update(pipeline)
    theoretical = theoretical_bubble(pipeline["pp"], pipeline["virtual_stages"], pipeline["microbatches"])
    row.update(theoretical_bubble_fraction=theoretical, baseline_system=None, speedup_vs_pp1=None,
               measured_bubble_fraction=None, pipelined_measured_bubble_fraction=None, bubble_ratio=None)
    if baseline is not None:
        one, mine = baseline["step_us"]["median_us"], row["step_us"]["median_us"]
        measured = measured_bubble(one, mine, world)
        row.update(baseline_system=baseline_name, speedup_vs_pp1=one / mine, measured_bubble_fraction=measured,
                   pipelined_measured_bubble_fraction=measured_bubble(baseline["pipelined_step_us"],
                                                                      row["pipelined_step_us"], world),
                   bubble_ratio=measured / theoretical if theoretical > 0 else None)
    return row


def loss_checks(rows, reference):
    """(loss_check, pp_loss_check): the rows' first losses side by side (the pipeline rows' against each other, as
    step_bench compares its eager and graph rows), and each row's first loss against `reference` (ONE_GPU's; None:
    not computed), also written into the row as loss_rel_diff."""
    check = peer_common.first_losses_check(rows, [n for n in PP_ROWS if n in rows])
    one_gpu = {}
    if reference is not None:
        for n, row in rows.items():
            got = row["first_losses"][0] if row["first_losses"] else float("nan")
            rel = abs(got - reference) / max(abs(reference), 1e-30)
            one_gpu[n] = {"first_loss": got, "one_gpu_first_loss": reference, "rel_diff": rel,
                          "agrees": rel <= PP_LOSS_TOLERANCE}
            row["loss_rel_diff"] = rel
    return check, one_gpu


def describe(name, r):
    if r["status"] != "ok":
        return peer_common.describe_not_ok(name, r, 7, 400)
    s = r["step_us"]
    line = (f"{name:7s} {r['system']:24s} {s['median_us'] / 1000:.3f} ms [{s['min_us'] / 1000:.3f}-"
            f"{s['max_us'] / 1000:.3f}] {r['tokens_per_s']:.0f} tok/s, per-GPU MFU {100 * r['mfu']:.1f}%, bubble "
            f"theoretical {r['theoretical_bubble_fraction']:.3f}")
    if r["measured_bubble_fraction"] is not None:
        line += (f" measured {r['measured_bubble_fraction']:.3f} (speedup {r['speedup_vs_pp1']:.3f}x vs "
                 f"{r['baseline_system']})")
    peaks = ", ".join(f"{p / 2**20:.0f}" for p in r["rank_peak_bytes"])
    return line + f", peak MiB per rank [{peaks}]"


def describe_loss(name, row, d):
    verdict = "agrees" if d["agrees"] else "DIFFERS"
    return (f"{name:7s} {row}: first loss {d['first_loss']:.5f} vs one GPU's {d['one_gpu_first_loss']:.5f} "
            f"(relative {d['rel_diff']:.2e}): {verdict}")


def failures(result):
    """config/row of every config not run or failed and every row not ok, but for a compiled or captured pipeline
    row that failed: PyTorch refusing to compile or capture its pipeline is a result, said in the row."""
    def refused(system):
        pipelined, compiled, graph, _ = ROWS[system]
        return pipelined and (compiled or graph)

    return ([f"{c['name']}: {c['reason']}" for c in result["configs"] if c["status"] != "ok"]
            + peer_common.failed_rows(result, refused))


def capture_summary(row_name, result, why):
    """The config's "graph_capture": what torch.cuda.graph did with the pipelined step."""
    if result is not None:
        return {"row": row_name, "captured": True, "error": None,
                "what": "torch.cuda.graph captured the whole pipelined step on every rank; the row times its replays"}
    if "CaptureFailed" in why:
        return {"row": row_name, "captured": False, "error": why,
                "what": "torch.cuda.graph refused the pipelined step (the error is PyTorch's, rank by rank)"}
    if "ReplayFailed" in why:
        return {"row": row_name, "captured": True, "error": why,
                "what": "torch.cuda.graph captured the pipelined step, but its replay gave no finite loss"}
    return {"row": row_name, "captured": None, "error": why, "what": "the row failed before the capture"}


# --- the pipelined step (torch needed from here on) -----------------------

class CaptureFailed(Exception):
    """torch.cuda.graph refused the pipelined step."""


class ReplayFailed(Exception):
    """The captured pipelined step's replay gave no finite loss."""


def memory_mark():
    """Before a row: pytorch_peer.fresh_memory (frees what earlier rows left, resets the peak), the device bytes in
    use. run_everywhere does the same again right after, with nothing allocated in between."""
    return peer.fresh_memory()


def row_memory(mark):
    """After a row: this rank's torch.cuda.max_memory_allocated over it and cudaMemGetInfo used bytes now minus
    `mark` (the row's memory is still cached: nothing was emptied since its timed steps)."""
    return {"peak_bytes": torch.cuda.max_memory_allocated(), "device_used_delta_bytes": peer.device_used_bytes() - mark}


def block_forward(c, p, h, rope):
    """One block of pytorch_peer.forward_loss (attention, then the dense MLP, each + residual)."""
    bf = peer.bf
    n = F.layer_norm(h, (c["hidden"],), bf(p["attn_ln_w"]), bf(p["attn_ln_b"]), peer.EPS)
    h = h + peer.attention(c, p, n, rope)
    n = F.layer_norm(h, (c["hidden"],), bf(p["ln_w"]), bf(p["ln_b"]), peer.EPS)
    return h + peer.dense_mlp(p, n)


def microbatch_loss(logits, labels):
    """The schedule's loss_fn: the mean cross-entropy of one microbatch, on fp32 logits."""
    return F.cross_entropy(logits.float(), labels.reshape(-1))


class ModelDraw:
    """A config's parameters and batch, drawn once on the GPU: pytorch_peer.make_params (seed 1) of one microbatch's
    config, the embedding table (seed 3, uniform +-1), tokens and labels [M, seq_len] (seed 2), the rotary tables;
    reference_loss (ONE_GPU). The parameters are then kept on the host; each row's Chunks copy theirs."""

    def __init__(self, c, microbatches):
        self.c = microbatch_config(c)
        blocks, top, everything = peer.make_params(self.c, seed=PARAM_SEED)
        g = torch.Generator(device="cuda")
        g.manual_seed(DATA_SEED)
        shape = (microbatches, self.c["seq_len"])
        self.tokens = torch.randint(0, peer.VOCAB, shape, generator=g, device="cuda")
        self.labels = torch.randint(0, peer.VOCAB, shape, generator=g, device="cuda")
        g.manual_seed(EMBEDDING_SEED)
        embedding = peer.uniform((peer.VOCAB, self.c["hidden"]), 1.0, g)
        self.rope = peer.rope_tables(self.c)
        with torch.no_grad():
            losses = [peer.forward_loss(self.c, blocks, top, F.embedding(self.tokens[m], peer.bf(embedding)),
                                        self.labels[m], self.rope) for m in range(microbatches)]
            self.reference_loss = torch.stack(losses).mean().item()
        self.blocks = [{k: t.detach().cpu() for k, t in p.items()} for p in blocks]
        self.top = {k: t.detach().cpu() for k, t in top.items()}
        self.embedding = embedding.cpu()
        del blocks, top, everything, embedding, losses


def draw_model(c, microbatches):
    return ModelDraw(c, microbatches)


if torch is not None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    class Parameters(torch.nn.Module):
        """Named fp32 masters (make_params' keys) as nn.Parameters of their own attributes; values() gives the dict
        pytorch_peer's functions read."""

        def __init__(self, tensors, device):
            super().__init__()
            self.names = list(tensors)
            for k, t in tensors.items():
                setattr(self, k, torch.nn.Parameter(t.to(device)))

        def values(self):
            return {k: getattr(self, k) for k in self.names}

    class Block(torch.nn.Module):
        """One block over make_params' values of that block (fp32 masters as nn.Parameters, bf16 compute)."""

        def __init__(self, c, p, rope, device):
            super().__init__()
            self.c, self.rope = c, rope  # rope: plain tensors, shared by the blocks
            self.p = Parameters(p, device)

        def forward(self, h):
            return block_forward(self.c, self.p.values(), h, self.rope)

    class Chunk(torch.nn.Module):
        """Model chunk `chunk` of `chunks`: its blocks (chunk_blocks), the embedding on chunk 0 (input: tokens
        [1, seq_len]), the final norm and head on the last (output: logits [seq_len, vocab] bf16); between chunks
        the residual stream [seq_len, hidden] bf16. Chunk 0 of 1 is the whole model."""

        def __init__(self, draw, chunk, chunks, device, compiled):
            super().__init__()
            c = draw.c
            self.hidden = c["hidden"]
            start, stop = chunk_blocks(chunk, c["layers"], chunks)
            self.embedding = torch.nn.Parameter(draw.embedding.to(device)) if chunk == 0 else None
            self.blocks = torch.nn.ModuleList(Block(c, draw.blocks[b], draw.rope, device) for b in range(start, stop))
            self.top = Parameters(draw.top, device) if chunk == chunks - 1 else None
            if compiled:
                for block in self.blocks:
                    block.compile()  # per block, as torchtitan; the embedding, head and loss stay eager

        def forward(self, x):
            h = F.embedding(x.reshape(-1), peer.bf(self.embedding)) if self.embedding is not None else x
            for block in self.blocks:
                h = block(h)
            if self.top is not None:
                top = self.top.values()
                n = F.layer_norm(h, (self.hidden,), peer.bf(top["ln_w"]), peer.bf(top["ln_b"]), peer.EPS)
                h = F.linear(n, peer.bf(top["head"]))
            return h

    def chunk_shapes(draw, chunk, chunks):
        """(input, output) of a model chunk as meta tensors: PipelineStage's explicit shapes (no runtime shape
        inference, whose object send/recv a captured step could not hold)."""
        length, hidden = draw.c["seq_len"], draw.c["hidden"]
        stream = torch.empty((length, hidden), dtype=torch.bfloat16, device="meta")
        first = torch.empty((1, length), dtype=draw.tokens.dtype, device="meta")
        last = torch.empty((length, peer.VOCAB), dtype=torch.bfloat16, device="meta")
        return (first if chunk == 0 else stream), (last if chunk == chunks - 1 else stream)

    def precompile(modules, draw):
        """One forward and backward of each compiled chunk alone (no communication), so that Inductor compiles
        outside the pipeline: a compile error is then every rank's before any send or receive is in flight.
        Returns None or the error's text."""
        try:
            for module in modules:
                if module.embedding is not None:
                    x = torch.zeros_like(draw.tokens[:1])
                else:
                    x = torch.zeros((draw.c["seq_len"], draw.c["hidden"]), dtype=torch.bfloat16, device="cuda",
                                    requires_grad=True)
                module(x).float().sum().backward()
                module.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            return None
        except Exception as error:
            return f"{type(error).__name__}: {error}"[:2000]

    class OneGpuSetup:
        """The whole model on this rank's GPU, the M microbatches with gradient accumulation; train_step() as
        pytorch_peer.Setup's."""

        def __init__(self, draw, device, compiled):
            self.draw = draw
            self.model = Chunk(draw, 0, 1, device, compiled)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=peer.LR, weight_decay=peer.WEIGHT_DECAY,
                                               fused=True)

        def train_step(self):
            """One step; returns the mean of the microbatches' losses (a tensor, no host read)."""
            tokens, labels = self.draw.tokens, self.draw.labels
            microbatches = tokens.shape[0]
            total = None
            for m in range(microbatches):
                loss = microbatch_loss(self.model(tokens[m:m + 1]), labels[m:m + 1])
                (loss / microbatches).backward()
                total = loss.detach() if total is None else total + loss.detach()
            self.optimizer.step()
            return total / microbatches

    class PipelineSetup:
        """This rank's model chunks as PipelineStages over `group` (its ranks are the P stages), their schedule,
        AdamW over the rank's parameters; train_step() runs one schedule step and returns the step's loss on every
        rank."""

        def __init__(self, draw, rank, pp, virtual, group, device, compiled, capturable):
            self.draw, self.group, self.device = draw, group, device
            chunks = pp * virtual
            ids = rank_chunks(rank, pp, virtual)
            self.modules = [Chunk(draw, k, chunks, device, compiled) for k in ids]
            self.first, self.last = 0 in ids, chunks - 1 in ids
            self.stages = []
            for k, module in zip(ids, self.modules):
                inputs, outputs = chunk_shapes(draw, k, chunks)
                self.stages.append(PipelineStage(module, k, chunks, device, input_args=inputs, output_args=outputs,
                                                 group=group))
            microbatches = draw.tokens.shape[0]
            if virtual == 1:
                self.schedule = Schedule1F1B(self.stages[0], microbatches, loss_fn=microbatch_loss)
            else:
                self.schedule = ScheduleInterleaved1F1B(self.stages, microbatches, loss_fn=microbatch_loss)
            # The last stage would otherwise keep every microbatch's logits to merge them (newer PyTorch only).
            self.step_kwargs = {}
            if "return_outputs" in inspect.signature(self.schedule.step).parameters:
                self.step_kwargs["return_outputs"] = False
            self.last_rank = dist.get_global_rank(group, (chunks - 1) % pp)
            params = [p for module in self.modules for p in module.parameters()]
            self.optimizer = torch.optim.AdamW(params, lr=peer.LR, weight_decay=peer.WEIGHT_DECAY, fused=True,
                                               capturable=capturable)

        def train_step(self):
            """One step; returns the loss tensor (the mean of the microbatches' losses, no host read), the same on
            every rank."""
            kwargs = dict(self.step_kwargs)
            losses = []
            if self.last:
                kwargs.update(target=self.draw.labels, losses=losses)
            args = (self.draw.tokens,) if self.first else ()
            self.schedule.step(*args, **kwargs)
            self.optimizer.step()
            if self.last:
                loss = torch.stack([loss.detach() for loss in losses]).mean()
            else:
                loss = torch.zeros((), dtype=torch.float32, device=self.device)
            dist.broadcast(loss, src=self.last_rank, group=self.group)
            return loss


def build_one_gpu(row, draw, device):
    """pytorch_peer.build_system's tuple for a pp1 row."""
    _, compiled, _, _ = ROWS[row]
    s = OneGpuSetup(draw, device, compiled)

    def run_one():
        s.optimizer.zero_grad(set_to_none=True)
        return s.train_step()

    if not compiled:
        return run_one, {}, [], s
    compile_start = time.perf_counter()  # the compilation before the timed warm-up
    losses = [run_one().item() for _ in range(2)]
    return run_one, {"compile_ms": 1000 * (time.perf_counter() - compile_start)}, losses, s


def build_pipeline(row, draw, group, pipeline_group, device, virtual):
    """pytorch_peer.build_system's tuple for a pipeline row on every rank."""
    _, compiled, graph, _ = ROWS[row]
    start = time.perf_counter()
    if graph:
        pipeline_group = dist.new_group(list(range(group.world)))  # the capture's own communicator
    setup = lambda: PipelineSetup(draw, group.rank, group.world, virtual, pipeline_group, device,  # noqa: E731
                                  compiled, capturable=graph)
    if not graph:
        if not compiled:
            s = setup()
        else:  # every rank reaches the one gather, whatever failed before it
            s, error = None, None
            try:
                s = setup()
                error = precompile(s.modules, draw)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"[:2000]
            errors = group.gather(error)
            if any(errors):
                raise RuntimeError("building or compiling the stages: " +
                                   "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))

        def run_one():
            s.optimizer.zero_grad(set_to_none=True)
            return s.train_step()

        if not compiled:
            return run_one, {}, [], s
        compile_start = time.perf_counter()  # the rest of the compilation before the timed warm-up
        losses = [run_one().item() for _ in range(2)]
        return run_one, {"compile_ms": 1000 * (time.perf_counter() - compile_start)}, losses, s
    # PyTorch's recipe for a whole-step graph (pytorch_peer.build_ddp_system's, for collectives): eager steps on a
    # side stream (the first also sets up the schedule's communication and buffers), grads set to None, the capture
    # on that stream, thread_local so that NCCL's watchdog thread may query its events meanwhile.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    losses = []
    warmup_start = time.perf_counter()
    with torch.cuda.stream(side):
        s = setup()
        for _ in range(peer.GRAPH_WARMUP):
            s.optimizer.zero_grad(set_to_none=True)
            losses.append(s.train_step())
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    losses = [loss.item() for loss in losses]
    warmup_ms = 1000 * (time.perf_counter() - warmup_start)
    s.optimizer.zero_grad(set_to_none=True)  # the capture's backward allocates the grads from its pool
    try:
        run_one, extra, graph_ = peer.capture_whole_step(s, start, stream=side, capture_error_mode="thread_local")
    except Exception as error:
        raise CaptureFailed(f"capture failed: {type(error).__name__}: {error}") from error
    # One replay here, where a failure is the row's (the loss is broadcast: every rank sees the same value), not
    # in the timed steps, where a non-finite loss ends the process.
    replayed = run_one().item()
    if not math.isfinite(replayed):
        raise ReplayFailed(f"the pipelined step was captured, but its first replay's loss is {replayed} (step "
                           f"{peer.GRAPH_WARMUP + 1}; the eager warm-up steps' losses: {losses})")
    extra["warmup_ms"] = warmup_ms
    return run_one, extra, losses + [replayed], (s, graph_, pipeline_group)


def run_pp_config(name, rows, steps, warmup, deadline, group, virtual, microbatches, pipeline_group=None,
                  device=None):
    """One config's rows on every rank; the config's JSON (the same on every rank). pipeline_group: the process
    group of the ranks that the eager and compiled pipeline rows send and receive over."""
    c = peer.CONFIGS[name]
    n = group.world
    cb = batch_config(c, microbatches)
    out = config_header(name, microbatches)
    out.update(status="ok", reason=None, world_size=n, pp=n, virtual_stages=virtual, schedule=schedule_name(virtual),
               pipeline_parallel_rows=True,
               theoretical_bubble_fraction=theoretical_bubble(n, virtual, microbatches),
               graph_capture=None, systems=[])
    why = check_config(name, n, virtual, microbatches)
    if why is not None:
        out.update(status="not_run", reason=why)
        return out
    out["stages"] = stage_split(c["layers"], n, virtual)
    out["blocks_per_chunk"] = c["layers"] // (n * virtual)
    draw, made = None, {}
    for row_name in rows:
        pipelined, compiled, graph, baseline_name = ROWS[row_name]
        if pipelined and n == 1:
            continue  # the pipeline rows need P > 1 ranks
        row = None
        if not group.agree(time.perf_counter() <= deadline):  # rank 0's clock decides for all
            row = {"system": row_name, "status": "not_run", "reason": "the --budget-s time was spent"}
        elif draw is None:  # before the first row that runs: the parameters, batch and one GPU's loss
            error = None
            try:
                draw = draw_model(c, microbatches)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"[:2000]
            errors = group.gather(error)
            if any(errors):
                out.update(status="failed", reason="drawing the model failed: " +
                           "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))
                break
            out["one_gpu_first_loss"] = draw.reference_loss
        if row is None:
            if group.rank == 0:  # before the row: a compile or a capture can take minutes
                print(f"{name:7s} {row_name} ...", file=sys.stderr, flush=True)
            if pipelined:
                build = lambda: build_pipeline(row_name, draw, group, pipeline_group, device, virtual)  # noqa: E731
            else:
                build = lambda: build_one_gpu(row_name, draw, device)  # noqa: E731
            mark = memory_mark()
            result, why = peer.run_everywhere(build, cb, steps, warmup, group, world_one=n == 1)
            memory = group.gather(row_memory(mark))  # the row's, still: nothing allocated since its timed steps
            if compiled and torch is not None:
                peer.reset_compiled_state()  # the next row compiles afresh
            if graph:
                out["graph_capture"] = capture_summary(row_name, result, why)
                if group.rank == 0:
                    print(f"{name:7s} {row_name}: {out['graph_capture']['what']}", file=sys.stderr, flush=True)
            if result is None:
                row = {"system": row_name, "status": "failed", "reason": why}
            else:
                base = made.get(baseline_name)
                if pipelined:
                    pipeline = dict(pp=n, virtual_stages=virtual, microbatches=microbatches,
                                    schedule=schedule_name(virtual))
                else:
                    pipeline = dict(pp=1, virtual_stages=1, microbatches=microbatches, schedule=None)
                row = pp_row(row_name, cb, n if pipelined else 1, result, memory, pipeline, base,
                             baseline_name if base else None)
                made[row_name] = row
                if baseline_name and base is None:
                    row["reason"] = f"no bubble measured: {baseline_name} did not run"
                if graph:  # as step_bench's graphed rows: against the eager row of the same pipeline
                    eager = made.get(PP_EAGER)
                    row["graph_speedup_vs_eager"] = (eager["step_us"]["median_us"] / row["step_us"]["median_us"]
                                                     if eager else None)
        out["systems"].append(row)
        if group.rank == 0:
            print(describe(name, row), file=sys.stderr, flush=True)
    out["loss_check"], out["pp_loss_check"] = loss_checks(made, out.get("one_gpu_first_loss"))
    if group.rank == 0:
        for row_name, d in out["pp_loss_check"].items():
            print(describe_loss(name, row_name, d), file=sys.stderr, flush=True)
    if out["status"] == "ok" and not made:
        out["status"], out["reason"] = "failed", "no row ran"
    return out


def parse_flags(argv):
    """The flags, checked before torch is needed (SystemExit naming the flag)."""
    def pipeline_flags(parser):
        parser.add_argument("--microbatches", type=int, default=8, help="M: microbatches of one sequence per step")
        parser.add_argument("--virtual-stages", type=int, default=1,
                            help="V: model chunks per rank (V > 1: ScheduleInterleaved1F1B)")

    args = tp_step_peer.parse_run_flags(argv, "pp_step_peer", __doc__.split("\n")[0], "medium,large", CONFIGS, ROWS,
                                        pipeline_flags)
    if args.microbatches < 1:
        raise SystemExit(f"pp_step_peer: --microbatches must be >= 1, got {args.microbatches}")
    if args.virtual_stages < 1:
        raise SystemExit(f"pp_step_peer: --virtual-stages must be >= 1, got {args.virtual_stages}")
    for name in args.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"pp_step_peer: {check_config(name, 1, 1, 1)}")
    args.configs = peer.parse_list(args.configs, list(CONFIGS), "config")
    rows = peer.parse_list(args.systems or ",".join(ROWS), list(ROWS), "system")
    args.systems = [r for r in ROWS if r in rows]  # baselines before the rows measured against them
    return args


def result_json(args, device, world, local_world, launcher):
    """The JSON's header (pytorch_peer.result_header and the pipeline's description); configs appended later."""
    flops_text = peer.FLOPS_TEXT + "; of the global batch (M sequences); tflops and mfu per GPU (/ P for the " \
        "pipeline rows)"
    result = peer.result_header(args, device, flops_text, "row", " (largest over the ranks)")
    result.update({
        "pipeline_parallel": {
            **peer_common.launch_fields(world, local_world, launcher, peer.comm_nccl_version(), peer.MULTICAST_ENV),
            "pp": world,
            "virtual_stages": args.virtual_stages,
            "microbatches": args.microbatches,
            "schedule": f"torch.distributed.pipelining.{schedule_name(args.virtual_stages)} over PipelineStage per "
            "model chunk (explicit input and output shapes), loss_fn the microbatch's mean cross-entropy, "
            "scale_grads (gradients / M); the step's loss broadcast from the last stage",
            "layout": LAYOUT,
            "global_batch": "M microbatches of one sequence of the config's seq_len tokens each (M x seq_len tokens "
            "a step, the same on every rank; stage 0 reads the tokens, the last stage the labels; tokens and labels "
            "seed 2, embedding table seed 3 uniform +-1, parameters pytorch_peer.make_params seed 1)",
            "compile": "each block under torch.compile (Inductor), compiled outside the pipeline first; the "
            "embedding, head and loss eager",
            "capture": f"{PP_GRAPH}: torch.cuda.graph over the whole step (schedule.step, AdamW(capturable=True), the "
            f"loss broadcast) after {peer.GRAPH_WARMUP} eager steps on the capturing side stream, capture_error_mode "
            "thread_local, its own process group; the config's graph_capture says what happened",
            "baseline": f"{PP1}, {PP1_COMPILE}: every rank the whole model over the same M microbatches alone "
            "(gradient accumulation), all ranks at the same time",
            "formulas": {"theoretical_bubble_fraction": "(P - 1) / (V M + P - 1)",
                         "measured_bubble_fraction": "1 - T_pp1 / (P T_pp), medians, T_pp1 the baseline_system's "
                         "(pipelined_: of pipelined_step_us)",
                         "bubble_ratio": "measured / theoretical",
                         "speedup_vs_pp1": "T_pp1 / T_pp",
                         "graph_speedup_vs_eager": f"median({PP_EAGER}) / median({PP_GRAPH})",
                         "tokens_per_s": "the row's tokens (M x seq_len) / median step time; tokens_per_s_per_gpu: "
                         "/ its world_size",
                         "tflops": "per GPU: the step's model FLOPs / the row's world_size / median step time",
                         "loss_rel_diff": "|first loss - one GPU's| / one GPU's"},
            "one_gpu_loss": ONE_GPU,
            "timing": peer.DP_TIMING,
            "rows": "benchmarks/pp_step_peer.py's docstring",
            "note": "world size 1: the pp1 rows alone; nothing is pipelined" if world == 1 else "",
        },
        "configs": [],
    })
    return result


def main(argv=None):
    args = parse_flags(argv)
    tp_step_peer.check_launch("pp_step_peer")
    group, local_rank, local_world, launcher, device, store_dir = peer.start_process_group(args.timeout_s,
                                                                                         "pp_step_peer")
    try:
        world, leader = group.world, group.rank == 0
        # The eager and compiled pipeline rows' sends and receives: a communicator apart from the barriers'.
        pipeline_group = dist.new_group(list(range(world))) if world > 1 else None
        result = result_json(args, device, world, local_world, launcher)
        if leader:
            peer_common.print_launch(result, world, local_world, launcher, peer.comm_nccl_version(),
                                     f"pipeline parallel, {schedule_name(args.virtual_stages)}, V "
                                     f"{args.virtual_stages}, M {args.microbatches}",
                                     result["pipeline_parallel"]["note"], file=sys.stderr)
        deadline = time.perf_counter() + args.budget_s
        peer_common.run_configs(
            result, args.configs,
            lambda name: run_pp_config(name, args.systems, args.steps, args.warmup, deadline, group,
                                       args.virtual_stages, args.microbatches, pipeline_group, device),
            leader, lambda r: peer.save_progress(r, args.out))
        wrong = peer_common.disagreements(result, "pp_loss_check", "first_loss", "one_gpu_first_loss")
        return peer.exit_status("pp_step_peer", failures(result), wrong, "a row's first loss differs from one GPU's",
                                leader)
    finally:
        peer.end_process_group(store_dir)


if __name__ == "__main__":
    sys.exit(main())
