"""The binding's sweep for fuzz_test.py: every argument of every public entry point of stepgraph,
given one value of each class of fault its kind admits:

    a float where an integer belongs (2.5, and 4.0 too)    a bool (True)
    a value past its C type's range (2**64 + 3, 2**31)    a value that overflows float32 (1e40)
    a string ('3', '1e-5')                                  an object of the wrong kind (object(), 3)
    NaN and infinities for reals, NUL and '' for names, unknown names for choices

and the options that would be ignored silently (IGNORED). Each case expects the exception type
and words (always the argument's name) of a clear error. ENTRIES also lists the entry points
that take no argument and the constructors the library alone calls, so that fuzz_test can check
that every public entry point is here (test_every_public_entry_point_is_swept).

A case's body runs after fuzz_cases.PRELUDE, with a fresh `ctx`; `{arg}` in an entry's template
takes the argument's good value, or the bad one.
"""

import collections

Entry = collections.namedtuple("Entry", "name setup template args")
Arg = collections.namedtuple("Arg", "kind good optional")

TYPE, ARG, SGE = ("TypeError",), ("ArgumentError",), ("StepGraphError",)


def arg(kind, good, optional=False):
    return Arg(kind, good, optional)


# kind: [(label, bad value as source, errors, extra words)]. The argument's name is always a word.
_INT = [("float", "2.5", TYPE, ["float"]), ("integral_float", "4.0", TYPE, ["float", "use 4"]),
        ("bool", "True", TYPE, ["bool"]), ("past_int64", "2**64 + 3", ARG, ["18446744073709551619"]),
        ("below_int64", "-2**63 - 1", ARG, []), ("str", "'3'", TYPE, ["str"]), ("object", "object()", TYPE, [])]
KINDS = {
    "int": _INT,
    "int32": _INT + [("past_int32", "2**31", ARG, ["2147483648"])],
    "uint32": _INT + [("negative", "-1", ARG, ["got -1"]), ("past_uint32", "2**32", ARG, ["4294967296"])],
    "flag": [("two", "2", ARG, ["got 2"]), ("str", "'yes'", TYPE, ["str"]), ("float", "0.5", TYPE, ["float"]),
             ("object", "object()", TYPE, [])],
    "float32": [("str", "'1e-5'", TYPE, ["str"]), ("overflow", "1e40", ARG, ["float32", "inf"]),
                ("huge_int", "10**400", ARG, ["float32"]), ("bool", "True", TYPE, ["bool"]),
                ("nan", "float('nan')", ARG, ["finite"]), ("inf", "float('inf')", ARG, ["finite"]),
                ("object", "object()", TYPE, [])],
    "real": [("str", "'300'", TYPE, ["str"]), ("bool", "True", TYPE, ["bool"]), ("nan", "float('nan')", ARG, []),
             ("inf", "float('inf')", ARG, []), ("huge_int", "10**400", ARG, []), ("object", "object()", TYPE, [])],
    "name": [("int", "5", TYPE, ["str"]), ("bytes", "b'x'", TYPE, ["str"]), ("nul", "'a\\0b'", ARG, ["NUL"]),
             ("empty", "''", ARG, ["empty"]), ("object", "object()", TYPE, [])],
    "choice": [("int", "3", TYPE, ["str"]), ("unknown", "'nonsense'", ARG, ["'nonsense'"]),
               ("list", "['x']", TYPE, []), ("bytes", "b'x'", TYPE, [])],
    "dtype": [("int", "3", TYPE, []), ("bool", "True", TYPE, []), ("unknown", "'float64'", ARG, ["unknown dtype"]),
              ("object", "object()", TYPE, [])],
    "shape": [("int", "5", TYPE, []), ("str", "'ab'", TYPE, []), ("float_dim", "(2.5,)", TYPE, ["float"]),
              ("bool_dim", "(True,)", TYPE, ["bool"]), ("past_int64_dim", "(2**64,)", ARG, []),
              ("negative_dim", "(-1,)", ARG, ["got -1"])],
    "tensor": [("numpy", "np.ones((2, 4), np.float32)", TYPE, ["stepgraph Tensor"]), ("int", "3", TYPE, []),
               ("str", "'x'", TYPE, [])],
    "context": [("str", "'host'", TYPE, ["stepgraph Context"]), ("int", "3", TYPE, []),
                ("object", "object()", TYPE, [])],
    "callable": [("int", "3", TYPE, ["callable"]), ("str", "'step'", TYPE, ["callable"])],
    "layers": [("int", "3", TYPE, []), ("str", "'mlp'", TYPE, []), ("list_of_int", "[3]", TYPE, []),
               ("empty", "[]", ARG, [])],
    "tensors": [("int", "3", TYPE, []), ("str", "'x'", TYPE, []), ("list_of_int", "[3]", TYPE, [])],
    "ints": [("int", "3", TYPE, []), ("str", "'12'", TYPE, []), ("floats", "[1.5, -1.5]", TYPE, ["float"]),
             ("bools", "[True, -1]", TYPE, ["bool"]), ("past_int64", "[2**64, -1]", ARG, [])],
    "pair": [("float", "0.9", TYPE, []), ("triple", "(0.9, 0.99, 0.999)", TYPE, ["2"]), ("str", "'ab'", TYPE, []),
             ("overflow", "(0.9, 1e40)", ARG, ["float32"]), ("strs", "('0.9', '0.999')", TYPE, ["str"])],
    "world": [("int", "3", TYPE, ["World"]), ("str", "'world'", TYPE, ["World"]), ("object", "object()", TYPE, [])],
    "schedule": [("str", "'cosine'", TYPE, ["LrSchedule"]), ("dict", "{'kind': 'cosine'}", TYPE, ["LrSchedule"])],
    "recipe": [("str", "'current'", TYPE, ["Fp8Recipe"]), ("dict", "{'scaling': 'current'}", TYPE, ["Fp8Recipe"])],
    "model": [("linear", "sg.Linear(ctx, 8, 8, dtype='float32')", TYPE, ["ResidualStack"]),
              ("int", "3", TYPE, [])],
    "optimizer": [("model", "small_model(ctx)", TYPE, ["AdamW"]), ("int", "3", TYPE, [])],
    "saved": [("tensor", "ctx.tensor((2, 4))", TYPE, ["Saved"]), ("int", "3", TYPE, [])],
    "bindings": [("int", "3", TYPE, []), ("str", "'x'", TYPE, []), ("single", "[(x,)]", TYPE, ["bindings[0]"]),
                 ("numpy_source", "{x: np.ones((2, 4), np.float32)}", TYPE, ["stepgraph Tensors"])],
    "key": [("float", "1.5", TYPE, ["str"]), ("bool", "True", TYPE, ["str"]), ("object", "object()", TYPE, []),
            ("nul", "'a\\0b'", ARG, ["NUL"]), ("empty", "''", ARG, ["empty"])],
    "host_array": [("list", "[1.0, 2.0]", TYPE, ["array_interface__"]), ("int", "3", TYPE, []),
                   ("str", "'abc'", TYPE, [])],
    "numpy_in": [("strings", "np.array(['a', 'b'])", ("TypeError", "ArgumentError"), []),
                 ("objects", "np.array([object(), object()])", ("TypeError", "ArgumentError"), []),
                 ("complex", "np.ones(2, complex)", ("TypeError", "ArgumentError"), [])],
    "label": [("int", "3", TYPE, ["str"]), ("object", "object()", TYPE, [])],
    "metadata": [("str", "'step=3'", TYPE, ["dict"]), ("int_value", "{'step': 3}", TYPE, ["str"]),
                 ("int_key", "{3: 'step'}", TYPE, ["str"]), ("empty_key", "{'': 'x'}", ARG, ["empty"]),
                 ("nul_value", "{'a': 'b\\0'}", ARG, ["NUL"]),
                 ("reserved_key", "{'stepgraph.step': '3'}", ARG, ["library writes itself"])],
    "loss_scaling": [("str", "'dynamic'", TYPE, ["LossScaling"]), ("int", "3", TYPE, ["LossScaling"]),
                     ("false", "False", TYPE, ["LossScaling"])],
}
# None is a fault for these kinds unless the argument is optional (None then means the default).
_NONE_IS_A_FAULT = {"int", "int32", "uint32", "flag", "float32", "real", "name", "choice", "dtype", "shape", "tensor",
                    "context", "callable", "layers", "tensors", "ints", "pair", "model", "optimizer", "saved", "key",
                    "host_array", "label"}

LINEAR = "layer = sg.Linear(ctx, 4, 4, dtype='float32')"
GRAPH = "layer = sg.Linear(ctx, 4, 4, dtype='float32'); x = ctx.tensor((2, 4)); g = sg.capture(ctx, lambda: [layer(x)])"
PIPELINE = ("layer = sg.Linear(ctx, 4, 4, dtype='float32'); "
            "gl = sg.make_graphed_layers([layer], [ctx.tensor((2, 4))], [1, -1])")
MODEL = "model = small_model(ctx)"
STEP = "model = small_model(ctx); step = sg.TrainStep(model, sg.AdamW(ctx, model), tokens=4)"
CHECKPOINT = ("model = small_model(ctx); opt = sg.AdamW(ctx, model); import os, tempfile; "
              "path = os.path.join(tempfile.mkdtemp(), 'c.safetensors'); sg.save_checkpoint(path, model, opt)")

_ENTRIES = [
    Entry("Context", "", "sg.Context(device={device}, side_streams={side_streams}, "
                         "communication_stream={communication_stream}, gemm_algorithms={gemm_algorithms})",
          {"device": arg("choice", "DEVICE"), "side_streams": arg("int32", "1"),
           "communication_stream": arg("int32", "None", optional=True),
           "gemm_algorithms": arg("choice", "'timed'")}),
    Entry("Context.communication_stream", "c2 = sg.Context(DEVICE, side_streams=1)",
          "c2.communication_stream = {index}", {"index": arg("int32", "1", optional=True)}),
    Entry("Context.cuda_stream", "", "ctx.cuda_stream(index={index})",
          {"index": arg("int32", "0")}),
    Entry("Context.stream", "", "ctx.stream(index={index}).__enter__()", {"index": arg("int32", "0")}),
    Entry("Context.tensor", "", "ctx.tensor(shape={shape}, dtype={dtype}, name={name})",
          {"shape": arg("shape", "(2, 4)"), "dtype": arg("dtype", "'float32'"),
           "name": arg("name", "None", optional=True)}),
    Entry("Context.from_numpy", "", "ctx.from_numpy(array={array}, dtype={dtype}, name={name})",
          {"array": arg("numpy_in", "np.ones((2, 4), np.float32)"), "dtype": arg("dtype", "None", optional=True),
           "name": arg("name", "None", optional=True)}),
    Entry("Context.wrap", "", "ctx.wrap(array={array}, name={name})",
          {"array": arg("host_array", "np.ones((2, 4), np.float32) if DEVICE == 'host' else ctx.tensor((2, 4))"),
           "name": arg("name", "None", optional=True)}),
    Entry("Tensor.name", "t = ctx.tensor((2,))", "t.name = {value}", {"value": arg("name", "'t'")}),
    Entry("Tensor.copy_from", "t = ctx.tensor((2, 4))", "t.copy_from(array={array}, name={name})",
          {"array": arg("numpy_in", "np.ones((2, 4), np.float32)"), "name": arg("label", "'copy_from: array'")}),
    Entry("Linear", "", "sg.Linear(ctx={ctx}, in_features={in_features}, out_features={out_features}, bias={bias}, "
                        "dtype={dtype}, dgrad={dgrad}, wgrad={wgrad}, name={name}, seed={seed}, fp8={fp8})",
          {"ctx": arg("context", "ctx"), "in_features": arg("int", "16"), "out_features": arg("int", "16"),
           "bias": arg("flag", "True"), "dtype": arg("dtype", "'float32'"), "dgrad": arg("flag", "True"),
           "wgrad": arg("flag", "True"), "name": arg("name", "'fc'"), "seed": arg("uint32", "1"),
           "fp8": arg("recipe", "None", optional=True)}),
    Entry("Norm", "", "sg.Norm(ctx={ctx}, hidden={hidden}, kind={kind}, eps={eps}, dtype={dtype}, name={name})",
          {"ctx": arg("context", "ctx"), "hidden": arg("int", "8"), "kind": arg("choice", "'layernorm'"),
           "eps": arg("float32", "1e-5"), "dtype": arg("dtype", "'float32'"), "name": arg("name", "'n'")}),
    Entry("LayerNorm", "", "sg.LayerNorm(ctx={ctx}, hidden={hidden}, eps={eps}, dtype={dtype}, name={name})",
          {"ctx": arg("context", "ctx"), "hidden": arg("int", "8"), "eps": arg("float32", "1e-5"),
           "dtype": arg("dtype", "'float32'"), "name": arg("name", "'n'")}),
    Entry("RMSNorm", "", "sg.RMSNorm(ctx={ctx}, hidden={hidden}, eps={eps}, dtype={dtype}, name={name})",
          {"ctx": arg("context", "ctx"), "hidden": arg("int", "8"), "eps": arg("float32", "1e-5"),
           "dtype": arg("dtype", "'float32'"), "name": arg("name", "'n'")}),
    Entry("LayerNormLinear", "", "sg.LayerNormLinear(ctx={ctx}, in_features={in_features}, "
                                 "out_features={out_features}, norm={norm}, eps={eps}, bias={bias}, dtype={dtype}, "
                                 "dgrad={dgrad}, wgrad={wgrad}, name={name}, seed={seed}, fp8={fp8})",
          {"ctx": arg("context", "ctx"), "in_features": arg("int", "16"), "out_features": arg("int", "16"),
           "norm": arg("choice", "'rmsnorm'"), "eps": arg("float32", "1e-5"), "bias": arg("flag", "False"),
           "dtype": arg("dtype", "'float32'"), "dgrad": arg("flag", "True"), "wgrad": arg("flag", "True"),
           "name": arg("name", "'l'"), "seed": arg("uint32", "1"), "fp8": arg("recipe", "None", optional=True)}),
    Entry("LayerNormMLP", "", "sg.LayerNormMLP(ctx={ctx}, hidden={hidden}, ffn={ffn}, norm={norm}, eps={eps}, "
                              "dtype={dtype}, name={name}, seed={seed}, fp8={fp8})",
          {"ctx": arg("context", "ctx"), "hidden": arg("int", "16"), "ffn": arg("int", "32"),
           "norm": arg("choice", "'layernorm'"), "eps": arg("float32", "1e-5"), "dtype": arg("dtype", "'float32'"),
           "name": arg("name", "'m'"), "seed": arg("uint32", "1"), "fp8": arg("recipe", "None", optional=True)}),
    Entry("ResidualStack", "", "sg.ResidualStack(ctx={ctx}, hidden={hidden}, ffn={ffn}, layers={layers}, "
                               "vocab={vocab}, norm={norm}, eps={eps}, dtype={dtype}, seed={seed}, "
                               "experts={experts}, topk={topk}, moe_every={moe_every}, "
                               "tensor_parallel={tensor_parallel}, overlap={overlap})",
          {"ctx": arg("context", "ctx"), "hidden": arg("int", "8", True), "ffn": arg("int", "16", True),
           "layers": arg("int", "2", True), "vocab": arg("int", "16", True), "norm": arg("choice", "'layernorm'"),
           "eps": arg("float32", "None", True), "dtype": arg("dtype", "'float32'"), "seed": arg("uint32", "None", True),
           "experts": arg("int", "2", True), "topk": arg("int", "1", True), "moe_every": arg("int", "2", True),
           "tensor_parallel": arg("world", "None", True), "overlap": arg("name", "None", True)}),
    Entry("Layer.forward", LINEAR, "layer.forward(x={x})", {"x": arg("tensor", "ctx.tensor((2, 4))")}),
    Entry("Layer.__call__", LINEAR, "layer({x})", {"x": arg("tensor", "ctx.tensor((2, 4))")}),
    Entry("Layer.backward", LINEAR + "; y, saved0 = layer.forward(ctx.tensor((2, 4)))",
          "layer.backward(saved={saved}, dy={dy})",
          {"saved": arg("saved", "saved0"), "dy": arg("tensor", "ctx.tensor((2, 4))")}),
    Entry("Fp8Recipe", "", "sg.Fp8Recipe(scaling={scaling}, formats={formats}, amax_history_len={amax_history_len}, "
                           "amax_reduction={amax_reduction}, margin={margin}, "
                           "power_of_two_scales={power_of_two_scales}, "
                           "fast_accumulation_forward={fast_accumulation_forward}, "
                           "fast_accumulation_backward={fast_accumulation_backward}, on_non_finite={on_non_finite})",
          {"scaling": arg("choice", "'delayed'"), "formats": arg("choice", "'hybrid'"),
           "amax_history_len": arg("int32", "16"), "amax_reduction": arg("choice", "'max'"),
           "margin": arg("int32", "0"), "power_of_two_scales": arg("flag", "True"),
           "fast_accumulation_forward": arg("flag", "True"), "fast_accumulation_backward": arg("flag", "False"),
           "on_non_finite": arg("choice", "'stop'")}),
    Entry("Fp8Recipe.current", "", "sg.Fp8Recipe.current(on_non_finite={on_non_finite})",
          {"on_non_finite": arg("choice", "'stop'")}),
    Entry("Fp8Recipe.delayed", "", "sg.Fp8Recipe.delayed(margin={margin})", {"margin": arg("int32", "1")}),
    Entry("Fp8Recipe.block", "", "sg.Fp8Recipe.block(power_of_two_scales={power_of_two_scales})",
          {"power_of_two_scales": arg("flag", "False")}),
    Entry("LrSchedule", "", "sg.LrSchedule(kind={kind}, base={base}, min_lr={min_lr}, warmup={warmup}, "
                            "total={total})",
          {"kind": arg("choice", "'cosine'"), "base": arg("float32", "1e-3"), "min_lr": arg("float32", "1e-4"),
           "warmup": arg("int", "2"), "total": arg("int", "10")}),
    Entry("AdamW", MODEL, "sg.AdamW(ctx={ctx}, layers={layers}, lr={lr}, betas={betas}, eps={eps}, "
                          "weight_decay={weight_decay}, schedule={schedule}, skip_nonfinite={skip_nonfinite}, "
                          "loss_scaling={loss_scaling}, step_scoped_gradients={step_scoped_gradients})",
          {"ctx": arg("context", "ctx"), "layers": arg("layers", "model"), "lr": arg("float32", "None", True),
           "betas": arg("pair", "(0.9, 0.999)"), "eps": arg("float32", "1e-8"),
           "weight_decay": arg("float32", "0.0"), "schedule": arg("schedule", "None", True),
           "skip_nonfinite": arg("flag", "True"), "loss_scaling": arg("loss_scaling", "None", True),
           "step_scoped_gradients": arg("flag", "False")}),
    Entry("LossScaling", "", "sg.LossScaling(initial_scale={initial_scale}, growth_factor={growth_factor}, "
                             "backoff_factor={backoff_factor}, growth_interval={growth_interval})",
          {"initial_scale": arg("float32", "1024.0"), "growth_factor": arg("float32", "2.0"),
           "backoff_factor": arg("float32", "0.5"), "growth_interval": arg("int32", "100")}),
    Entry("LanguageModel", "", "sg.LanguageModel(ctx={ctx}, vocab={vocab}, hidden={hidden}, layers={layers}, "
                               "heads={heads}, kv_heads={kv_heads}, ffn={ffn}, seq_len={seq_len}, context={context}, "
                               "norm={norm}, eps={eps}, dtype={dtype}, seed={seed}, experts={experts}, topk={topk}, "
                               "moe_every={moe_every}, rope_base={rope_base}, dropout={dropout}, "
                               "recompute_activation={recompute_activation}, fp8={fp8}, "
                               "fp8_weight_cache={fp8_weight_cache}, tensor_parallel={tensor_parallel}, "
                               "overlap={overlap}, context_parallel={context_parallel})",
          {"ctx": arg("context", "ctx"), "vocab": arg("int", "16", True), "hidden": arg("int", "16", True),
           "layers": arg("int", "1", True), "heads": arg("int", "2", True), "kv_heads": arg("int", "1", True),
           "ffn": arg("int", "32", True), "seq_len": arg("int", "4", True), "context": arg("int", "None", True),
           "norm": arg("choice", "'rmsnorm'"), "eps": arg("float32", "None", True), "dtype": arg("dtype", "'float32'"),
           "seed": arg("uint32", "2", True), "experts": arg("int", "2", True), "topk": arg("int", "1", True),
           "moe_every": arg("int", "1", True), "rope_base": arg("float32", "500.0", True),
           "dropout": arg("float32", "0.1"), "recompute_activation": arg("flag", "False"),
           "fp8": arg("recipe", "None", True), "fp8_weight_cache": arg("flag", "False"),
           "tensor_parallel": arg("world", "None", True), "overlap": arg("name", "None", True),
           "context_parallel": arg("world", "None", True)}),
    Entry("AdamW.set_lr", MODEL + "; opt = sg.AdamW(ctx, model)", "opt.set_lr(lr={lr})", {"lr": arg("float32", "0.1")}),
    Entry("TrainStep", MODEL + "; opt = sg.AdamW(ctx, model)",
          "sg.TrainStep(model={model}, optimizer={optimizer}, tokens={tokens}, world={world}, "
          "sequences={sequences}, dp_mode={dp_mode})",
          {"model": arg("model", "model"), "optimizer": arg("optimizer", "opt"), "tokens": arg("int", "4"),
           "world": arg("world", "None", True), "sequences": arg("int", "None", True),
           "dp_mode": arg("choice", "'allreduce'")}),
    Entry("TrainStep.load", STEP, "step.load(x={x}, labels={labels}, packing={packing})",
          {"x": arg("numpy_in", "np.ones((4, 8), np.float32)"), "labels": arg("numpy_in", "[0, 1, 2, 3]"),
           "packing": arg("numpy_in", "None", True)}),
    Entry("TrainStep.capture", STEP, "step.capture(policy={policy})", {"policy": arg("choice", "'error'")}),
    Entry("capture", LINEAR + "; x = ctx.tensor((2, 4))", "sg.capture(ctx={ctx}, fn={fn}, policy={policy})",
          {"ctx": arg("context", "ctx"), "fn": arg("callable", "lambda: [layer(x)]"),
           "policy": arg("choice", "'warn'")}),
    Entry("CapturedStep.replay", GRAPH, "g.replay(bindings={bindings})",
          {"bindings": arg("bindings", "{x: ctx.tensor((2, 4))}", True)}),
    Entry("GraphCache", "", "sg.GraphCache(max_pool_bytes={max_pool_bytes})",
          {"max_pool_bytes": arg("int", "1 << 20")}),
    Entry("GraphCache.get_or_capture", LINEAR + "; x = ctx.tensor((2, 4)); cache = sg.GraphCache()",
          "cache.get_or_capture(key={key}, ctx={ctx}, fn={fn}, policy={policy})",
          {"key": arg("key", "'fc'"), "ctx": arg("context", "ctx"), "fn": arg("callable", "lambda: [layer(x)]"),
           "policy": arg("choice", "'warn'")}),
    Entry("GraphCache.contains", "cache = sg.GraphCache()", "cache.contains(key={key}, ctx={ctx})",
          {"key": arg("key", "'fc'"), "ctx": arg("context", "ctx")}),
    Entry("GraphCache.erase", "cache = sg.GraphCache()", "cache.erase(key={key}, ctx={ctx})",
          {"key": arg("key", "'fc'"), "ctx": arg("context", "ctx")}),
    Entry("make_graphed_layers", LINEAR, "sg.make_graphed_layers(layers={layers}, sample_inputs={sample_inputs}, "
                                         "order={order}, policy={policy})",
          {"layers": arg("layers", "[layer]"), "sample_inputs": arg("tensors", "[ctx.tensor((2, 4))]"),
           "order": arg("ints", "[1, -1]"), "policy": arg("choice", "'error'")}),
    Entry("save_checkpoint", CHECKPOINT,
          "sg.save_checkpoint(path={path}, model={model}, optimizer={optimizer}, metadata={metadata}, world={world})",
          {"path": arg("name", "path"), "model": arg("model", "model"), "optimizer": arg("optimizer", "opt"),
           "metadata": arg("metadata", "{'data.position': '3'}", True), "world": arg("world", "None", True)}),
    Entry("load_checkpoint", CHECKPOINT,
          "sg.load_checkpoint(path={path}, model={model}, optimizer={optimizer}, world={world})",
          {"path": arg("name", "path"), "model": arg("model", "model"), "optimizer": arg("optimizer", "opt"),
           "world": arg("world", "None", True)}),
    Entry("one_f_one_b", "", "sg.one_f_one_b(microbatches={microbatches}, warmup={warmup})",
          {"microbatches": arg("int", "4"), "warmup": arg("int", "1")}),
    Entry("GraphedLayers.forward", PIPELINE, "gl.forward(microbatch={microbatch}, x={x})",
          {"microbatch": arg("int", "0"), "x": arg("tensor", "None", True)}),
    Entry("GraphedLayers.backward", PIPELINE + "; gl.forward(0)", "gl.backward(microbatch={microbatch}, dy={dy})",
          {"microbatch": arg("int", "0"), "dy": arg("tensor", "None", True)}),
    Entry("GraphedLayers.input", PIPELINE, "gl.input(microbatch={microbatch})", {"microbatch": arg("int", "0")}),
    Entry("GraphedLayers.grad_output", PIPELINE, "gl.grad_output(microbatch={microbatch})",
          {"microbatch": arg("int", "0")}),
    Entry("World.split", "w = sg.init_distributed(DEVICE)", "w.split(color={color}, key={key})",
          {"color": arg("int32", "0"), "key": arg("int32", "None", True)}),
    Entry("init_distributed", "", "sg.init_distributed(device={device}, timeout={timeout})",
          {"device": arg("choice", "DEVICE"), "timeout": arg("real", "30")}),
    Entry("context_parallel_rows", "w = sg.init_distributed(DEVICE)",
          "sg.context_parallel_rows(values={values}, world={world})",
          {"values": arg("numpy_in", "np.arange(4, dtype=np.int32)"), "world": arg("world", "w")}),
    Entry("bf16_bits_to_float32", "", "sg.bf16_bits_to_float32(bits={bits})",
          {"bits": arg("numpy_in", "np.array([16256], np.uint16)")}),
    Entry("float32_to_bf16_bits", "", "sg.float32_to_bf16_bits(values={values})",
          {"values": arg("numpy_in", "np.array([1.0], np.float32)")}),
]
ENTRIES = {entry.name: entry for entry in _ENTRIES}

# Public entry points without arguments (checked by introspection in fuzz_test), and the
# constructors the library calls itself: Tensor, CapturedStep, GraphedLayers and Saved are made
# from C handles (a TypeError from anything else: the cases below), World by init_distributed.
NO_ARGUMENTS = {"Context.close", "Context.memory", "Context.synchronize", "Tensor.item", "Tensor.numpy",
                "Tensor.to_float32", "Tensor.torch", "AdamW.step", "TrainStep.__call__", "TrainStep.check_errors",
                "CapturedStep.dump", "CapturedStep.profile", "CapturedStep.release_pool", "GraphCache.clear", "World.close",
                "World.describe", "Layer.check_errors", "Layer.parameters", "Layer.sync_parameters",
                "cuda_device_count", "library_path", "Context.__enter__", "World.__enter__"}
MADE_BY_THE_LIBRARY = {"Tensor": "ctx.tensor", "CapturedStep": "capture", "GraphedLayers": "make_graphed_layers",
                       "Saved": "forward", "World": "init_distributed"}

# Options that would be ignored without these errors: (name, body, errors, words).
IGNORED = [
    ("overlap_without_tensor_parallel", "small_model(ctx, overlap='none')", ARG, ["overlap", "tensor-parallel"]),
    ("topk_without_experts", "small_model(ctx, topk=2)", ARG, ["topk", "experts"]),
    ("moe_every_with_zero_experts", "small_model(ctx, experts=0, moe_every=1)", ARG, ["moe_every", "experts"]),
    ("lr_with_a_schedule", "m = small_model(ctx); sg.AdamW(ctx, m, lr=0.1, schedule=sg.LrSchedule('constant'))",
     ARG, ["lr", "schedule"]),
    ("constant_schedule_total", "sg.LrSchedule('constant', total=100)", ARG, ["total", "constant"]),
    ("constant_schedule_min_lr", "sg.LrSchedule('constant', base=0.1, min_lr=0.01)", ARG, ["min_lr", "constant"]),
    ("current_recipe_margin", "sg.Fp8Recipe.current(margin=2)", ARG, ["margin", "delayed"]),
    ("block_recipe_history", "sg.Fp8Recipe.block(amax_history_len=16)", ARG, ["amax_history_len", "delayed"]),
    ("current_recipe_reduction", "sg.Fp8Recipe(amax_reduction='most_recent')", ARG, ["amax_reduction", "delayed"]),
    ("delayed_recipe_power_of_two", "sg.Fp8Recipe.delayed(power_of_two_scales=False)", ARG,
     ["power_of_two_scales", "block"]),
    ("weight_cache_without_fp8", "sg.LanguageModel(ctx, fp8_weight_cache=True)", ARG, ["fp8_weight_cache", "fp8"]),
    ("kv_heads_of_the_window_model", "sg.LanguageModel(ctx, heads=0, kv_heads=2)", ARG, ["kv_heads", "heads=0"]),
    ("seq_len_of_the_window_model", "sg.LanguageModel(ctx, heads=0, seq_len=8)", ARG, ["seq_len", "context"]),
    ("context_of_the_gpt", "sg.LanguageModel(ctx, heads=2, context=8)", ARG, ["context", "seq_len"]),
    ("language_model_overlap_alone", "sg.LanguageModel(ctx, overlap='none')", ARG, ["overlap", "tensor-parallel"]),
    ("sequences_of_a_stack", "m = small_model(ctx); sg.TrainStep(m, sg.AdamW(ctx, m), tokens=4, sequences=2)",
     ARG, ["sequences", "attention"]),
    ("loss_scaling_without_the_skip", "m = small_model(ctx); sg.AdamW(ctx, m, loss_scaling=True)", ARG,
     ["loss_scaling", "skip_nonfinite"]),
]

# The constructors made from handles, given something else.
MADE_FROM_OTHER = [
    ("tensor_from_int", "sg.Tensor(3)", TYPE, ["Tensor is made by a Context"]),
    ("captured_step_from_str", "sg.CapturedStep('g')", TYPE, ["CapturedStep is made by capture()"]),
    ("graphed_layers_from_none", "sg.GraphedLayers(None, [])", TYPE, ["made by make_graphed_layers()"]),
    ("saved_from_tensor", "sg.Saved(ctx.tensor((2,)))", TYPE, ["Saved is made by a layer's forward"]),
    ("world_directly", "sg.World()", TYPE, ["init_distributed"]),
    ("recipe_unknown_field", "sg.Fp8Recipe.current(scale=2)", TYPE, ["scale"]),
]

# Arguments whose message names them otherwise than by their parameter name.
_WORD = {("AdamW", "betas"): "beta", ("Context.communication_stream", "index"): "communication_stream",
         ("Tensor.name", "value"): "name", ("Context.wrap", "array"): "wrap",
         ("Context.from_numpy", "array"): "from_numpy", ("Tensor.copy_from", "array"): "copy_from",
         ("TrainStep.load", "x"): "x", ("TrainStep.load", "labels"): "labels",
         ("bf16_bits_to_float32", "bits"): "bits", ("float32_to_bf16_bits", "values"): "values",
         ("Fp8Recipe.current", "on_non_finite"): "on_non_finite"}


def _body(entry, bad_arg, bad_value):
    values = {name: (bad_value if name == bad_arg else a.good) for name, a in entry.args.items()}
    call = entry.template.format(**values)
    return f"{entry.setup}\n{call}" if entry.setup else call


def cases():
    """(name, body, errors, words) of every sweep case."""
    out = []
    for entry in _ENTRIES:
        for name, a in entry.args.items():
            faults = list(KINDS[a.kind])
            if a.kind in _NONE_IS_A_FAULT and not a.optional:
                faults.append(("none", "None", TYPE, []))
            word = _WORD.get((entry.name, name), name)
            for label, value, errors, words in faults:
                out.append((f"{entry.name}.{name}.{label}", _body(entry, name, value), errors, [word, *words]))
    for name, body, errors, words in IGNORED:
        out.append((f"ignored.{name}", body, errors, words))
    for name, body, errors, words in MADE_FROM_OTHER:
        out.append((f"made_by_the_library.{name}", body, errors, words))
    return out


def good_bodies():
    """(entry name, body) with every argument good: each must run (no fault, no error)."""
    return [(entry.name, _body(entry, None, None)) for entry in _ENTRIES]
