"""StepGraph from Python: a thin ctypes binding over the engine's C API
(capi/stepgraph.h, libstepgraph_c.so). No compiled extension: the same
files work with any Python 3.

    import stepgraph as sg
    with sg.Context("host") as ctx:
        model = sg.ResidualStack(ctx, hidden=64, ffn=256, layers=2, vocab=128, dtype="float32")
        step = sg.TrainStep(model, sg.AdamW(ctx, model, lr=1e-2), tokens=32)
        graph = step.capture()
        graph.replay()
        print(graph.outputs[0].item())

Data parallel over the ranks a launcher started (torchrun, srun, mpirun): sg.init_distributed(),
then sg.TrainStep(..., world=world). Checkpoints: sg.save_checkpoint and sg.load_checkpoint. See
python/README.md.
"""

from stepgraph._library import ArgumentError, StepGraphError, library_path
from stepgraph.checkpoint import load_checkpoint, save_checkpoint
from stepgraph.context import Context, cuda_device_count
from stepgraph.context_parallel import context_parallel_rows
from stepgraph.distributed import World, init_distributed
from stepgraph.dtypes import DType, bf16_bits_to_float32, float32_to_bf16_bits
from stepgraph.fp8 import Fp8Recipe
from stepgraph.graph import CapturedStep, GraphCache, capture
from stepgraph.language_model import LanguageModel
from stepgraph.layers import (LayerNorm, LayerNormLinear, LayerNormMLP, Linear, Norm, Parameter, ResidualStack, RMSNorm,
                              Saved)
from stepgraph.pipeline import GraphedLayers, make_graphed_layers, one_f_one_b
from stepgraph.tensor import Tensor
from stepgraph.training import IGNORE_INDEX, AdamW, LossScaling, LrSchedule, TrainStep

__version__ = "0.4.0"
__all__ = [
    "AdamW", "ArgumentError", "CapturedStep", "Context", "DType", "Fp8Recipe", "GraphCache", "GraphedLayers",
    "IGNORE_INDEX", "LanguageModel", "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear", "LossScaling",
    "LrSchedule", "Norm", "Parameter", "RMSNorm", "ResidualStack", "Saved", "StepGraphError", "Tensor",
    "TrainStep", "World",
    "__version__", "bf16_bits_to_float32", "capture", "context_parallel_rows", "cuda_device_count", "float32_to_bf16_bits",
    "init_distributed", "library_path", "load_checkpoint", "make_graphed_layers", "one_f_one_b", "save_checkpoint",
]
