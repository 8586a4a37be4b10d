/* StepGraph's C API: the one public header of libstepgraph_c.so.
 *
 * Flat calls over opaque handles. Every call returns an sg_result: SG_OK (0)
 * or one of the error codes (they mirror stepgraph::ErrorCode). On an error,
 * sg_last_error() holds the message of the failed call on this thread (a
 * successful call leaves it unchanged). No C++ exception crosses this API.
 *
 *   sg_context ctx;
 *   sg_residual_stack_config config;
 *   sg_residual_stack_config_default(&config);  (size, magic, version, defaults)
 *   if (sg_context_create(SG_DEVICE_HOST, 1, &ctx) != SG_OK) puts(sg_last_error());
 *
 * Handles are opaque 64-bit values checked on every call, not addresses: the
 * library keeps a table of the handles it issued (with a generation count per
 * entry), so a handle that was destroyed, that this library never issued
 * (garbage, 0xdeadbeef) or that is of another type (a tensor passed as a
 * graph) makes the call return SG_ERROR_INVALID_ARGUMENT, with a last error
 * naming the call, the argument and the handle, e.g.
 * "sg_graph_replay: graph handle 0x... (graph) was destroyed; ...". Never a
 * crash.
 *
 * Handles are reference holders: a tensor keeps its context alive, a layer its
 * context, a train step its model, optimizer and world, a graph what it replays;
 * destroy each handle you were given (out-parameters), in any order.
 * Destroying a handle only ends that handle: whatever other handles still use
 * stays alive and usable (a tensor after sg_context_destroy of its context
 * still reads, writes and is destroyed normally; the context goes when its
 * last user goes). Tensors handed back by a call (outputs, parameters) are new
 * handles owned by the caller.
 *
 * Destroying NULL is SG_OK (like free). Destroying a handle twice, or using it
 * after its destroy, is SG_ERROR_INVALID_ARGUMENT ("... was already destroyed"),
 * never undefined behaviour. A handle value is never reissued for a new object
 * (a slot's generation moves on). Handles stay valid until destroyed or the
 * process ends. Handle checks are thread-safe; a destroy on one thread while
 * another thread's call uses the handle lets that call finish first.
 *
 * Strings come back through (buffer, capacity, length): the text is copied
 * (truncated, always NUL-terminated when capacity > 0) and *length is set to
 * the full length without the NUL, so a caller can size a second call.
 *
 * Not thread-safe per handle: use a context (and everything made from it) from
 * one thread at a time.
 */
#ifndef STEPGRAPH_CAPI_STEPGRAPH_H_
#define STEPGRAPH_CAPI_STEPGRAPH_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 2: sg_model_* became sg_residual_stack_*, sg_train_step_check_labels became
 * sg_train_step_check_errors.
 * 3: additions only: worlds (sg_world_*), sg_train_step_config and
 * sg_train_step_create_with_config (data parallelism), the context's
 * communication stream; exported as STEPGRAPH_C_3 (capi/stepgraph.lds). */
/* 4: additions only: sg_residual_stack_create_tensor_parallel (a stack
 * sharded over a world's ranks); exported as STEPGRAPH_C_4. */
/* 5: additions only: FP8 recipes (sg_fp8_recipe) and the layers that take
 * one (sg_linear_create_fp8, sg_layernorm_linear_create_fp8,
 * sg_layernorm_mlp_create_fp8); exported as STEPGRAPH_C_5. */
/* 6: additions only: learning-rate schedules (sg_lr_schedule,
 * sg_adamw_create_scheduled) and the rate set between steps
 * (sg_optimizer_set_lr, sg_optimizer_lr); exported as STEPGRAPH_C_6. */
/* 7: additions only: per-layer graphs for pipeline schedules
 * (sg_graphed_layers_*); exported as STEPGRAPH_C_7. */
/* 8: additions only: sg_layer_check_errors (an FP8 layer's non-finite amaxes
 * where its recipe says stop, a stack's routing errors); exported as
 * STEPGRAPH_C_8. Flags of the config structs take 0 or 1 only, norms' eps
 * must be finite and >= 0, a schedule's total >= 0, and sg_tensor_wrap checks
 * its byte count for every address. Fields a layer would ignore are refused
 * unless they keep their defaults: an FP8 recipe's delayed-only fields
 * (amax_history_len, amax_most_recent, margin) for another scaling and
 * power_of_two_scales outside block scaling, a residual stack's topk and
 * moe_every without experts, a constant schedule's min_lr and total. */
/* 9: additions only: language models (sg_language_model_config,
 * sg_language_model_create: the trainer's GPT and window model), optimizers
 * with every option of the trainer's (sg_optimizer_config, sg_optimizer_create:
 * schedule, non-finite skip, loss scaling, step-scoped gradients), version 2 of
 * sg_train_step_config (packed sequences, ZeRO-1) and sg_train_step_packing.
 * Every versioned config starts with size, magic and version (NCCL's
 * ncclConfig_t pattern): fill it with its _default function or _INITIALIZER
 * macro; a config from another stepgraph.h is read up to the fields of its
 * version, and one this library cannot read is an error saying so. Exported as
 * STEPGRAPH_C_9. */
/* 10: one versioned config per object instead of create variants: the layer
 * configs (sg_linear_config, sg_norm_config, sg_layernorm_linear_config,
 * sg_layernorm_mlp_config, sg_residual_stack_config) start with size, magic
 * and version and hold the FP8 recipe (fp8, fp8_recipe) or the
 * tensor-parallel world and overlap; sg_train_step_create takes an
 * sg_train_step_config; optimizers are made by sg_optimizer_create. Removed:
 * sg_linear_create_fp8, sg_layernorm_linear_create_fp8,
 * sg_layernorm_mlp_create_fp8, sg_residual_stack_create_tensor_parallel,
 * sg_train_step_create_with_config, sg_adamw_create, sg_adamw_create_scheduled.
 * Added: sg_context_set_gemm_algorithms and sg_context_gemm_algorithms, and
 * sg_graph_profile and sg_graph_last_profile (the trainer's --profile), and
 * sg_world_split (2-D worlds). The
 * functions whose arguments changed are exported as STEPGRAPH_C_10, so a
 * binary built against an older header fails to load instead of passing the
 * old structs. */
/* 11: additions only: checkpoints of a model's and its optimizer's whole
 * training state (sg_checkpoint_config, sg_checkpoint_save,
 * sg_checkpoint_load, sg_checkpoint_metadata_*: the trainer's --checkpoint,
 * --save-every and --resume); exported as STEPGRAPH_C_11. */
#define SG_API_VERSION 11

/* Result codes: the values of stepgraph::ErrorCode (engine/error.h). */
typedef enum sg_result {
  SG_OK = 0,
  SG_ERROR_INVALID_ARGUMENT = 1,
  SG_ERROR_INVALID_STATE = 2,
  SG_ERROR_UNSUPPORTED = 3,
  SG_ERROR_NO_DEVICE = 4,
  SG_ERROR_OUT_OF_MEMORY = 5,
  SG_ERROR_CUDA = 6,
  SG_ERROR_CUBLAS = 7,
  SG_ERROR_NCCL = 8,
  SG_ERROR_IO = 9,
  SG_ERROR_INTERNAL = 10
} sg_result;

typedef enum sg_device { SG_DEVICE_CUDA = 0, SG_DEVICE_HOST = 1 } sg_device;

/* The values of stepgraph::DType. */
typedef enum sg_dtype {
  SG_DTYPE_FLOAT32 = 0,
  SG_DTYPE_BFLOAT16 = 1,
  SG_DTYPE_FLOAT16 = 2,
  SG_DTYPE_FLOAT8_E4M3 = 3,
  SG_DTYPE_FLOAT8_E5M2 = 4,
  SG_DTYPE_INT32 = 5,
  SG_DTYPE_INT64 = 6
} sg_dtype;

typedef enum sg_norm_kind { SG_NORM_LAYERNORM = 0, SG_NORM_RMSNORM = 1 } sg_norm_kind;

/* Where a tensor's memory is (stepgraph::StorageKind). */
typedef enum sg_storage {
  SG_STORAGE_PERSISTENT = 0, /* fixed address: created or wrapped */
  SG_STORAGE_EAGER = 1,      /* an eager op's output */
  SG_STORAGE_TRACED = 2,     /* a value of a step being traced: no memory */
  SG_STORAGE_POOL = 3,       /* a captured step's output, in its graph pool */
  SG_STORAGE_UNAVAILABLE = 4 /* held past a capture whose pool report policy was
                              * "free": its memory is reused, reading it is an error */
} sg_storage;

/* What a capture does with pool tensors the step keeps without returning them. */
typedef enum sg_pool_report_policy {
  SG_POOL_REPORT_WARN = 0,  /* keep them valid, log the report */
  SG_POOL_REPORT_ERROR = 1, /* refuse the capture with the report */
  SG_POOL_REPORT_FREE = 2   /* reuse their memory; using them is an error */
} sg_pool_report_policy;

typedef struct sg_context_s* sg_context;
typedef struct sg_stream_scope_s* sg_stream_scope;
typedef struct sg_tensor_s* sg_tensor;
typedef struct sg_layer_s* sg_layer;
typedef struct sg_saved_s* sg_saved;
typedef struct sg_optimizer_s* sg_optimizer;
typedef struct sg_train_step_s* sg_train_step;
typedef struct sg_graph_s* sg_graph;
typedef struct sg_graph_cache_s* sg_graph_cache;
typedef struct sg_world_s* sg_world;
typedef struct sg_graphed_layers_s* sg_graphed_layers;
typedef struct sg_checkpoint_metadata_s* sg_checkpoint_metadata;

/* ---- Errors and versions ------------------------------------------------ */

/* The message of the last failed call on this thread ("" if none). Valid until
 * the next failing call on this thread. */
const char* sg_last_error(void);
/* "ok", "invalid_argument", "cuda", ...; "unknown" for other values. */
const char* sg_result_name(int result);
int sg_api_version(void);

/* ---- Devices and contexts ------------------------------------------------ */

/* How many CUDA devices this process sees; 0 with the reason in `reason`
 * (never an error: a machine without a GPU is an answer). */
sg_result sg_cuda_device_count(int* count, char* reason, size_t capacity, size_t* length);

/* A context on `device` with `side_streams` streams besides the main one. */
sg_result sg_context_create(sg_device device, int side_streams, sg_context* out);
sg_result sg_context_destroy(sg_context ctx);
sg_result sg_context_device(sg_context ctx, sg_device* out);
sg_result sg_context_stream_count(sg_context ctx, int* out);
/* The cudaStream_t of stream `index` (cuda contexts only). */
sg_result sg_context_cuda_stream(sg_context ctx, int index, void** out);
/* Waits for all work of the context (nothing to do on host). */
sg_result sg_context_synchronize(sg_context ctx);
/* Sends the ops called until sg_stream_scope_exit to stream `index` (0: main);
 * exit restores the stream before enter. Scopes nest: exit them in reverse. */
sg_result sg_stream_scope_enter(sg_context ctx, int index, sg_stream_scope* out);
sg_result sg_stream_scope_exit(sg_stream_scope scope);
/* Waits on the host for an external cudaStream_t (another library's stream,
 * as __cuda_array_interface__ names it) before StepGraph reads its data. */
sg_result sg_cuda_stream_synchronize(void* stream);
/* Bytes of persistent tensors, and of eager tensors alive now and at peak. */
sg_result sg_context_memory(sg_context ctx, int64_t* persistent_bytes, int64_t* eager_bytes, int64_t* eager_peak_bytes);
/* Where collective ops run (a data-parallel step's gradient all-reduces), eager
 * and captured: side stream `index` (in [1, stream count)), so communication
 * overlaps compute, or -1 (the default): the current stream. Set it before the
 * step is captured, e.g. sg_context_create(device, 2, &ctx) and then
 * sg_context_set_communication_stream(ctx, 2). */
sg_result sg_context_set_communication_stream(sg_context ctx, int index);
sg_result sg_context_communication_stream(sg_context ctx, int* out);
/* How cuBLASLt's GEMM algorithms are picked (engine/algorithm_choice.h, the
 * trainer's --gemm-algorithms): "heuristic" (the default: the same bits on
 * every run) or "timed" (the fastest in this process). Set it before the
 * layers run or are captured. The host's GEMMs are the library's own either way. */
sg_result sg_context_set_gemm_algorithms(sg_context ctx, const char* choice);
sg_result sg_context_gemm_algorithms(sg_context ctx, char* buffer, size_t capacity, size_t* length);

/* ---- Tensors -------------------------------------------------------------- */

/* A zero-filled persistent tensor (fixed address for the context's life). */
sg_result sg_tensor_create(sg_context ctx, const char* name, sg_dtype dtype, int rank, const int64_t* dims,
                           sg_tensor* out);
/* A persistent tensor over memory the caller owns (device memory on a cuda
 * context, host memory on a host context); no copy. `strides` (in elements,
 * may be NULL for row-major) must describe a contiguous row-major layout:
 * StepGraph's kernels read dense rows, so a transposed or sliced view is an
 * SG_ERROR_INVALID_ARGUMENT (make it contiguous first). Dimensions of size 1
 * may have any stride.
 * Checked: the tensor's byte count (the product of `dims` times the element
 * size) must fit in int64, and [data, data + bytes) must not pass the end of
 * the address space, whatever `data` is; NULL `data` is refused for a tensor
 * of more than 0 bytes; a cuda context refuses memory that is not device
 * memory.
 * Trusted, since the library cannot see an allocation's size: the caller
 * guarantees that `data` points at memory readable and writable for the
 * tensor's whole byte count (a buffer smaller than dims say is read and
 * written past its end, in copies to and from the host and in every op), and
 * that it stays valid, at the same address, for as long as the tensor or a
 * captured step that reads it is in use. (The Python binding checks the
 * extent where the wrapped object can tell it: see Context.wrap.) */
sg_result sg_tensor_wrap(sg_context ctx, const char* name, sg_dtype dtype, int rank, const int64_t* dims,
                         const int64_t* strides, void* data, sg_tensor* out);
/* A second handle to the same tensor (destroy both). */
sg_result sg_tensor_retain(sg_tensor tensor, sg_tensor* out);
sg_result sg_tensor_destroy(sg_tensor tensor);

sg_result sg_tensor_rank(sg_tensor tensor, int* out);
/* Copies min(rank, capacity) dimensions into dims. */
sg_result sg_tensor_dims(sg_tensor tensor, int64_t* dims, int capacity);
sg_result sg_tensor_dtype(sg_tensor tensor, sg_dtype* out);
sg_result sg_tensor_device(sg_tensor tensor, sg_device* out);
sg_result sg_tensor_storage(sg_tensor tensor, sg_storage* out);
sg_result sg_tensor_numel(sg_tensor tensor, int64_t* out);
sg_result sg_tensor_bytes(sg_tensor tensor, int64_t* out);
/* The data's address (device memory on cuda); an error for a traced value or
 * a tensor whose graph pool was released. For a graph output the address is
 * valid until sg_graph_release_pool: do not read it after that. (Without a
 * release, the pool lives as long as the graph or a handle to one of its
 * outputs.) */
sg_result sg_tensor_data(sg_tensor tensor, void** out);
sg_result sg_tensor_name(sg_tensor tensor, char* buffer, size_t capacity, size_t* length);
sg_result sg_tensor_set_name(sg_tensor tensor, const char* name);
/* Copies exactly sg_tensor_bytes bytes in or out (not while tracing). */
sg_result sg_tensor_copy_from_host(sg_tensor tensor, const void* src, size_t bytes);
sg_result sg_tensor_copy_to_host(sg_tensor tensor, void* dst, size_t bytes);

/* ---- Layers ---------------------------------------------------------------- */

/* FP8 GEMMs (engine/fp8_recipe.h, Note [FP8 Linear] in layers/linear.h): a
 * recipe as a plain value. Fill it with sg_fp8_recipe_default for a scaling,
 * then change fields; a field out of range is an error at layer creation. */
typedef enum sg_fp8_scaling { SG_FP8_CURRENT = 0, SG_FP8_DELAYED = 1, SG_FP8_BLOCK = 2 } sg_fp8_scaling;
typedef struct sg_fp8_recipe {
  sg_fp8_scaling scaling;
  int hybrid;                     /* bool: E5M2 gradients (else E4M3 everywhere) */
  int amax_history_len;           /* delayed: [1, 65536] */
  int amax_most_recent;           /* bool, delayed: the history's newest amax instead of its max */
  int margin;                     /* delayed: [0, 32], scales divided by 2^margin */
  int power_of_two_scales;        /* bool, block */
  int fast_accumulation_forward;  /* bool */
  int fast_accumulation_backward; /* bool */
  int stop_on_non_finite;         /* bool: a non-finite amax stops the run instead of skipping the step */
} sg_fp8_recipe;
/* The engine's recipe for `scaling` (Fp8Recipe::current(), delayed(), block()). */
void sg_fp8_recipe_default(sg_fp8_recipe* recipe, sg_fp8_scaling scaling);

/* Every layer config is versioned (see SG_API_VERSION 9): start from its
 * _default function, then set fields. `fp8` = 1 runs the layer's GEMMs in FP8
 * by `fp8_recipe` (sg_fp8_recipe_default's current scaling by default). */
#define SG_LINEAR_CONFIG_MAGIC 0x53474c49u /* "SGLI" */
#define SG_LINEAR_CONFIG_VERSION 1
typedef struct sg_linear_config {
  size_t size;      /* sizeof(sg_linear_config) where the caller was compiled */
  uint32_t magic;   /* SG_LINEAR_CONFIG_MAGIC */
  uint32_t version; /* SG_LINEAR_CONFIG_VERSION where the caller was compiled */
  /* Version 1. */
  int64_t in_features;
  int64_t out_features;
  int bias; /* bool */
  sg_dtype dtype;
  int dgrad; /* bool: backward computes dx */
  int wgrad; /* bool: backward writes the parameter gradients */
  int fp8;   /* bool */
  sg_fp8_recipe fp8_recipe;
} sg_linear_config;

#define SG_NORM_CONFIG_MAGIC 0x53474e4fu /* "SGNO" */
#define SG_NORM_CONFIG_VERSION 1
typedef struct sg_norm_config {
  size_t size;
  uint32_t magic;   /* SG_NORM_CONFIG_MAGIC */
  uint32_t version; /* SG_NORM_CONFIG_VERSION */
  /* Version 1. */
  sg_norm_kind kind;
  int64_t hidden;
  float eps;
  sg_dtype dtype;
} sg_norm_config;

/* A norm, then a Linear of in_features (the normalized hidden size) to out_features. */
#define SG_LAYERNORM_LINEAR_CONFIG_MAGIC 0x53474e4cu /* "SGNL" */
#define SG_LAYERNORM_LINEAR_CONFIG_VERSION 1
typedef struct sg_layernorm_linear_config {
  size_t size;
  uint32_t magic;   /* SG_LAYERNORM_LINEAR_CONFIG_MAGIC */
  uint32_t version; /* SG_LAYERNORM_LINEAR_CONFIG_VERSION */
  /* Version 1. */
  sg_norm_kind norm;
  float eps;
  int64_t in_features;
  int64_t out_features;
  int bias; /* bool */
  sg_dtype dtype;
  int dgrad; /* bool */
  int wgrad; /* bool */
  int fp8;   /* bool */
  sg_fp8_recipe fp8_recipe;
} sg_layernorm_linear_config;

#define SG_LAYERNORM_MLP_CONFIG_MAGIC 0x53474d4cu /* "SGML" */
#define SG_LAYERNORM_MLP_CONFIG_VERSION 1
typedef struct sg_layernorm_mlp_config {
  size_t size;
  uint32_t magic;   /* SG_LAYERNORM_MLP_CONFIG_MAGIC */
  uint32_t version; /* SG_LAYERNORM_MLP_CONFIG_VERSION */
  /* Version 1. */
  int64_t hidden;
  int64_t ffn;
  sg_norm_kind norm;
  float eps;
  sg_dtype dtype;
  int fp8; /* bool */
  sg_fp8_recipe fp8_recipe;
} sg_layernorm_mlp_config;

/* The residual trunk of a language model, fed activations: residual blocks
 * h = h + LayerNormMLP(h) (or MoE blocks), a final norm and an LM head.
 * experts > 0 makes every moe_every-th block a mixture of experts routing each
 * token to its topk experts (topk 1 or 2, at most experts; split sizes stay on
 * the device); a bad combination is an error at creation.
 * tensor_parallel: NULL, or a world over whose every rank the stack is tensor-
 * and sequence-parallel (layers/residual_stack.h, Note [Tensor-parallel
 * ResidualStack]): each rank holds 1/N of every block's ffn, of the experts and
 * of the vocabulary, its forward takes this rank's rows x [tokens / N, hidden]
 * and gives the logits of every rank's tokens over its vocabulary slice
 * [tokens, vocab / N]; a train step of it (tokens = this rank's rows, no world
 * of its own) trains on each rank's rows, the loss their global mean. Every
 * rank must make the same calls; a world of one gives the plain stack; the
 * layer keeps the world's communicator alive. overlap: how the collectives
 * meet their GEMMs, NULL (bulk), "none", "bulk", "overlap" or four modes
 * (trainer/README.md); only with tensor_parallel. */
#define SG_RESIDUAL_STACK_CONFIG_MAGIC 0x53475253u /* "SGRS" */
#define SG_RESIDUAL_STACK_CONFIG_VERSION 1
typedef struct sg_residual_stack_config {
  size_t size;
  uint32_t magic;   /* SG_RESIDUAL_STACK_CONFIG_MAGIC */
  uint32_t version; /* SG_RESIDUAL_STACK_CONFIG_VERSION */
  /* Version 1. */
  int64_t hidden;
  int64_t ffn;
  int64_t layers;
  int64_t vocab;
  sg_norm_kind norm;
  float eps;
  sg_dtype dtype;
  uint32_t seed;
  int64_t experts;
  int64_t topk;
  int64_t moe_every;
  sg_world tensor_parallel;
  const char* overlap;
} sg_residual_stack_config;

/* The engine's defaults (bf16, eps 1e-5, bias/dgrad/wgrad on, no FP8, ...). */
void sg_linear_config_default(sg_linear_config* config);
void sg_norm_config_default(sg_norm_config* config);
void sg_layernorm_linear_config_default(sg_layernorm_linear_config* config);
void sg_layernorm_mlp_config_default(sg_layernorm_mlp_config* config);
void sg_residual_stack_config_default(sg_residual_stack_config* config);

/* Layers: parameters initialised from `seed`, persistent in the context. */
sg_result sg_linear_create(sg_context ctx, const char* name, const sg_linear_config* config, uint32_t seed,
                           sg_layer* out);
sg_result sg_norm_create(sg_context ctx, const char* name, const sg_norm_config* config, sg_layer* out);
sg_result sg_layernorm_linear_create(sg_context ctx, const char* name, const sg_layernorm_linear_config* config,
                                     uint32_t seed, sg_layer* out);
sg_result sg_layernorm_mlp_create(sg_context ctx, const char* name, const sg_layernorm_mlp_config* config,
                                  uint32_t seed, sg_layer* out);
/* A residual stack is a layer too: forward gives logits [tokens, vocab] from
 * x [tokens, hidden]; backward takes dlogits and gives dx. */
sg_result sg_residual_stack_create(sg_context ctx, const sg_residual_stack_config* config, sg_layer* out);

/* A language model (layers/language_model.h), the trainer's model: an
 * embedding, a residual stack and an LM head, trained by sg_train_step_create
 * on token ids. With heads > 0 a GPT: TransformerLayers with causal attention
 * over packed sequences of `context` tokens, rotary positions, every next
 * token predicted. With heads = 0 the window model: one prediction per
 * example from a window of `context` tokens, by MLP blocks over their
 * concatenated embedding (hidden a multiple of context).
 * It is a layer handle (kind "language_model") for sg_optimizer_create, sg_layer_parameter and sg_layer_check_errors; it has no
 * sg_layer_forward (its input is tokens with their packing: train it with a
 * train step). Bad values and combinations are errors at creation, naming the
 * field. */
#define SG_LANGUAGE_MODEL_CONFIG_MAGIC 0x53474c4du /* "SGLM" */
#define SG_LANGUAGE_MODEL_CONFIG_VERSION 2
typedef struct sg_language_model_config {
  size_t size;      /* sizeof(sg_language_model_config) where the caller was compiled */
  uint32_t magic;   /* SG_LANGUAGE_MODEL_CONFIG_MAGIC */
  uint32_t version; /* SG_LANGUAGE_MODEL_CONFIG_VERSION where the caller was compiled */
  /* Version 1. */
  int64_t vocab;    /* the LM head's width, a multiple of 8 (x N with tensor parallelism) */
  int64_t hidden;
  int64_t ffn;
  int64_t layers;
  int64_t heads;    /* > 0: the GPT; 0: the window model */
  int64_t kv_heads; /* 0: heads; fewer: grouped-query attention */
  int64_t context;  /* tokens per sequence (GPT) or per example (window model) */
  sg_norm_kind norm;
  float eps;
  sg_dtype dtype;   /* bf16, fp16 or fp32 */
  uint32_t seed;
  int64_t experts;  /* > 0: every moe_every-th block routes each token to topk experts */
  int64_t topk;
  int64_t moe_every;
  float rope_base;
  float dropout;            /* in [0, 1): on the stack's input and every attention and MLP output */
  int recompute_activation; /* bool: the MLPs keep fc1's pre-activation only */
  int fp8;                  /* bool: FP8 GEMMs in the blocks, by fp8_recipe */
  sg_fp8_recipe fp8_recipe; /* read with fp8 = 1 (sg_fp8_recipe_default's current scaling by default) */
  int fp8_weight_cache;     /* bool, with fp8: weights quantized once per update, not per GEMM */
  sg_world tensor_parallel; /* NULL (the default) or a world: the model sharded over its ranks */
  const char* overlap;      /* tensor-parallel collectives and GEMMs: NULL (bulk), "none", "bulk",
                             * "overlap" or four modes (trainer/README.md) */
  /* Version 2: */
  sg_world context_parallel; /* NULL (the default) or a world: the GPT's sequences split over its ranks
                              * (the trainer's --cp; its train step's world must be this world, or
                              * data x context parallel) */
} sg_language_model_config;
/* The engine's defaults (a small bf16 GPT: see the function's values). */
void sg_language_model_config_default(sg_language_model_config* config);
sg_result sg_language_model_create(sg_context ctx, const sg_language_model_config* config, sg_layer* out);
sg_result sg_layer_destroy(sg_layer layer);

/* "linear", "norm", "layernorm_linear", "layernorm_mlp", "residual_stack",
 * "language_model". */
sg_result sg_layer_kind(sg_layer layer, char* buffer, size_t capacity, size_t* length);
/* Runs now (eager) or records (inside a capture's step function). `saved` is
 * what backward needs: pass it to backward of the same layer. */
sg_result sg_layer_forward(sg_layer layer, sg_tensor x, sg_tensor* y, sg_saved* saved);
/* Writes every parameter gradient (fp32 main grads, overwritten). *dx is NULL
 * when the layer computes no dx (a Linear with dgrad off). */
sg_result sg_layer_backward(sg_layer layer, sg_saved saved, sg_tensor dy, sg_tensor* dx);
sg_result sg_saved_destroy(sg_saved saved);
/* Error for what the layer counted on the device since it was made: an FP8
 * layer's quantizations that met a non-finite amax (NaN or infinity in an
 * input, weight or gradient) where its recipe's stop_on_non_finite is 1, a
 * residual stack's MoE routing errors. Reads the device (waits for the work so
 * far), so not while a step is captured: call it after a replay or an eager
 * call. A layer with nothing to count returns SG_OK. */
sg_result sg_layer_check_errors(sg_layer layer);

sg_result sg_layer_parameter_count(sg_layer layer, int64_t* out);
/* Parameter `index`: its fp32 master weight, the copy in the layer's dtype that
 * the forward reads (the master itself in fp32), and its fp32 gradient. Any
 * output pointer may be NULL. After writing a master from outside, call
 * sg_layer_sync_parameters so the dtype copies follow. */
sg_result sg_layer_parameter(sg_layer layer, int64_t index, char* name, size_t capacity, size_t* length,
                             sg_tensor* master, sg_tensor* value, sg_tensor* grad);
sg_result sg_layer_sync_parameters(sg_layer layer);

/* ---- Worlds: the processes of a data-parallel run ------------------------- */

/* This process's place among the processes of a run (one per GPU, NCCL's
 * model), read from the environment a launcher sets up:
 *   torchrun  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
 *   srun      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE (or
 *             SLURM_TASKS_PER_NODE); MASTER_ADDR/MASTER_PORT, else the first node;
 *   mpirun    OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE; MASTER_ADDR, MASTER_PORT
 * (in this order; launch/launch_env.h has the details, e.g. torchrun's
 * agent store moving the meeting to MASTER_PORT + 1). None of them set:
 * a world of one (rank 0 of 1) with no communicator and no socket, so the same
 * program runs alone unchanged.
 *
 * With several ranks, every rank meets rank 0 at MASTER_ADDR:MASTER_PORT and
 * waits at most `timeout_seconds` (in [0.001, 604800], a week) for the others.
 * On SG_DEVICE_CUDA the ranks then build an NCCL communicator (rank 0's unique
 * id travels over that connection) and this call makes GPU `local_rank` the
 * current device: call it before sg_context_create. On SG_DEVICE_HOST the
 * collectives run over the same TCP connections (slow; for tests and CI).
 * Every rank must call it with the same device. Inconsistent launcher
 * variables, a local rank without a GPU, a rank that does not come or that
 * passed another device: an error naming the variable or the rank, never a
 * hang. The timeout also bounds each later collective: a rank that died ends
 * the others' next step with an error after at most that long.
 *
 * Lifetime: a train step made with the world (sg_train_step_config::world),
 * and its graphs, hold the world's communicator, like every handle here holds
 * what it uses: sg_world_destroy ends the handle, and the connections to the
 * other ranks close when the last of the world handle, those steps and their
 * graphs is destroyed. A rank whose world closes early ends the other ranks'
 * next collective with an error: keep the world until every rank's last step. */
sg_result sg_world_init(sg_device device, double timeout_seconds, sg_world* out);
sg_result sg_world_destroy(sg_world world);
/* The ranks of `world` that pass the same `color` (>= 0), ordered by `key`
 * and then by rank, as a world of their own (the trainer's --dp x --tp: the
 * tensor-parallel groups are color rank / tp, the data-parallel ones rank %
 * tp). Every rank of `world` must call it. Supported where the world's
 * communicator can split (NCCL on cuda); the host's TCP worlds of several
 * ranks cannot yet (SG_ERROR_UNSUPPORTED). A world of one splits into a world
 * of one. The group keeps `world` alive. */
sg_result sg_world_split(sg_world world, int color, int key, sg_world* out);
/* This process's rank in [0, size), the number of ranks, and its index among
 * the ranks of its host (its GPU on cuda). */
sg_result sg_world_rank(sg_world world, int* out);
sg_result sg_world_size(sg_world world, int* out);
sg_result sg_world_local_rank(sg_world world, int* out);
/* "rank 1 of 2 (local 1 of 2) via torchrun, rendezvous 127.0.0.1:29500;
 * communicator 'world' (rank 1 of 2, host)", for logs. */
sg_result sg_world_describe(sg_world world, char* buffer, size_t capacity, size_t* length);

/* ---- Optimizer and training step ------------------------------------------ */

typedef struct sg_adamw_config {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
} sg_adamw_config;
void sg_adamw_config_default(sg_adamw_config* config);

/* A learning-rate schedule (kernels/lr_schedule.h), computed on the device
 * from the step counter before each update, so a captured step replays with
 * each step's rate: `warmup` steps of linear warmup to `base`, then constant
 * (kind 0), cosine (1) or linear (2) decay to `min_lr` at step `total`. */
typedef struct sg_lr_schedule {
  int kind;
  float base;
  float min_lr;
  int64_t warmup; /* >= 0 */
  int64_t total;  /* >= 0; > warmup for cosine and linear */
} sg_lr_schedule;
/* The rate of the next updates, written from the host between steps: a step
 * captured before takes it without a new capture. An error with a schedule. */
sg_result sg_optimizer_set_lr(sg_optimizer optimizer, float lr);
/* The rate the last update used (with a schedule) or the one set (reads the device). */
sg_result sg_optimizer_lr(sg_optimizer optimizer, float* out);
/* An optimizer's settings, versioned like sg_train_step_config: start from
 * sg_optimizer_config_default (or SG_OPTIMIZER_CONFIG_INITIALIZER), then set
 * fields. */
#define SG_OPTIMIZER_CONFIG_MAGIC 0x53474f50u /* "SGOP" */
#define SG_OPTIMIZER_CONFIG_VERSION 1
typedef struct sg_optimizer_config {
  size_t size;      /* sizeof(sg_optimizer_config) where the caller was compiled */
  uint32_t magic;   /* SG_OPTIMIZER_CONFIG_MAGIC */
  uint32_t version; /* SG_OPTIMIZER_CONFIG_VERSION where the caller was compiled */
  /* Version 1. */
  sg_adamw_config adamw;
  int schedule;               /* bool: the rate follows lr_schedule (its base replaces adamw.lr) */
  sg_lr_schedule lr_schedule;
  int skip_nonfinite;         /* bool: a step whose loss or gradients are NaN or infinite changes
                               * nothing (optim/adamw.h Note [Non-finite steps]); not with ZeRO-1 */
  int loss_scaling;           /* bool: dynamic loss scaling on the device (fp16 models) */
  float loss_scale_initial;   /* powers of two (kernels/step_guard.h LossScaling) */
  float loss_scale_growth_factor;
  float loss_scale_backoff_factor;
  int loss_scale_growth_interval; /* good steps in a row before the scale grows, >= 1 */
  int step_scoped_gradients;  /* bool: gradients live from their backward to their group's update
                               * (Note [Step-scoped gradients]); not with the skip or parallelism */
} sg_optimizer_config;
#define SG_OPTIMIZER_CONFIG_INITIALIZER                                                                  \
  {                                                                                                     \
    sizeof(sg_optimizer_config), SG_OPTIMIZER_CONFIG_MAGIC, SG_OPTIMIZER_CONFIG_VERSION,               \
        {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f}, 0, {0, 1e-3f, 0.0f, 0, 0}, 0, 0, 65536.0f, 2.0f, 0.5f, 2000, 0 \
  }
void sg_optimizer_config_default(sg_optimizer_config* config);
/* AdamW over the parameters of `layer_count` layers (one multi-tensor op)
 * with `config`'s options. */
sg_result sg_optimizer_create(sg_context ctx, const sg_layer* layers, size_t layer_count,
                              const sg_optimizer_config* config, sg_optimizer* out);
/* Steps skipped as non-finite so far, and the loss scale the next step uses
 * (1 without loss scaling); both read the device. */
sg_result sg_optimizer_skipped_steps(sg_optimizer optimizer, int64_t* out);
sg_result sg_optimizer_loss_scale(sg_optimizer optimizer, float* out);
sg_result sg_optimizer_destroy(sg_optimizer optimizer);
sg_result sg_optimizer_step(sg_optimizer optimizer);
/* Steps taken so far (reads the device counter). */
sg_result sg_optimizer_steps_taken(sg_optimizer optimizer, int64_t* out);

/* A whole training step of a residual stack (sg_residual_stack_create) or a
 * language model (sg_language_model_create): forward, softmax cross-entropy,
 * backward, AdamW over `tokens` rows. Its inputs are persistent tensors:
 * for a residual stack x [tokens, hidden] in the model dtype and labels
 * [tokens] int32; for the GPT token ids int32 [tokens, 1] (tokens a multiple
 * of the model's context: tokens / context sequences) and one label per
 * token, the next token (sg_train_step_packing holds the packing); for the
 * window model token ids int32 [tokens, context] (one example per row) and
 * one label per example. */
/* A train step's settings, versioned across the ABI like ncclConfig_t: new
 * fields are appended in later versions, and `size`, `magic` and `version` tell
 * the library which fields the caller knows. Start from
 * sg_train_step_config_default (or SG_TRAIN_STEP_CONFIG_INITIALIZER), then set
 * the fields. A struct that was not initialised that way is refused. */
#define SG_TRAIN_STEP_CONFIG_MAGIC 0x53475453u /* "SGTS" */
#define SG_TRAIN_STEP_CONFIG_VERSION 2
typedef struct sg_train_step_config {
  size_t size;      /* sizeof(sg_train_step_config) where the caller was compiled */
  uint32_t magic;   /* SG_TRAIN_STEP_CONFIG_MAGIC */
  uint32_t version; /* SG_TRAIN_STEP_CONFIG_VERSION where the caller was compiled */
  /* Version 1. */
  int64_t tokens; /* this rank's tokens: x [tokens, hidden], labels [tokens] */
  sg_world world; /* NULL (the default) or a world of one: this process alone.
                   * Otherwise data parallel over the world: each rank trains on
                   * its own `tokens` rows of a global batch of size * tokens, the
                   * gradients are summed across the ranks inside the step, and
                   * the loss is the global mean (the same on every rank). Every
                   * rank must build the same model (same seed and config),
                   * optimizer and step, and capture or run the same steps. */
  /* Version 2. */
  int64_t sequences; /* a GPT's step: 0 (the default) for tokens / context sequences of context
                      * tokens each; > 0 for up to `sequences` sequences of any lengths packed
                      * into the tokens (shape buckets): write each batch's packing into
                      * sg_train_step_packing (it starts as one sequence of every token) */
  int zero1;         /* bool, data parallel: ZeRO-1 (a sharded optimizer: reduce-scatter, update
                      * 1/N, all-gather) instead of all-reducing the gradients */
} sg_train_step_config;
#define SG_TRAIN_STEP_CONFIG_INITIALIZER \
  { sizeof(sg_train_step_config), SG_TRAIN_STEP_CONFIG_MAGIC, SG_TRAIN_STEP_CONFIG_VERSION, 0, NULL, 0, 0 }
void sg_train_step_config_default(sg_train_step_config* config);
/* The step of `model` and `optimizer` as `config` says (tokens and, for data
 * parallelism, a world). The step keeps the world's communicator alive (see
 * sg_world_init). */
sg_result sg_train_step_create(sg_layer model, sg_optimizer optimizer, const sg_train_step_config* config,
                               sg_train_step* out);
sg_result sg_train_step_destroy(sg_train_step step);
sg_result sg_train_step_inputs(sg_train_step step, sg_tensor* x, sg_tensor* labels);
/* The cu_seqlens int32 [sequences + 1] of a model with attention (where each
 * packed sequence of the tokens starts; write another packing of the same
 * tokens between steps or replays); *out is NULL for a model without. */
sg_result sg_train_step_packing(sg_train_step step, sg_tensor* out);
/* One step now (eager), or recorded inside a step function; *loss is a fp32
 * scalar tensor. */
sg_result sg_train_step_run(sg_train_step step, sg_tensor* loss);
/* An error if any label so far was outside [0, vocab) or an MoE block's routing
 * or split sizes went wrong (reads device flags: after a step). */
sg_result sg_train_step_check_errors(sg_train_step step);

/* ---- Captured steps (graphs) -------------------------------------------------- */

/* A step function for sg_capture: calls sg_* functions (they record while a
 * step is traced) and writes up to `capacity` output tensors into `outputs`,
 * their count into *count. The output handles pass to StepGraph (it destroys
 * them): give new ones (sg_tensor_retain) for tensors you keep. Return 0, or
 * non-zero to abandon the capture: it then fails with SG_ERROR_INVALID_ARGUMENT
 * and the message given to sg_step_error, if the function called it. */
typedef int (*sg_step_fn)(void* user, sg_tensor* outputs, size_t capacity, size_t* count);
/* For a failing step function: the message its capture fails with (this thread). */
void sg_step_error(const char* message);

/* Traces `fn` once on `ctx`, plans its memory into one static pool, captures
 * it into CUDA graphs (cuda) or a host plan (host). */
sg_result sg_capture(sg_context ctx, sg_step_fn fn, void* user, sg_pool_report_policy policy, sg_graph* out);
/* The same for a train step: the graph's output 0 is the loss. A data-parallel
 * step is captured by every rank together: before recording, the ranks compare
 * the collectives they would record, and a difference is an error on every
 * rank naming the first that differs. */
sg_result sg_train_step_capture(sg_train_step step, sg_pool_report_policy policy, sg_graph* out);
sg_result sg_graph_destroy(sg_graph graph);

/* Copies sources[i] into static_inputs[i] (persistent tensors the step reads),
 * unless they are the same tensor, then runs every segment once. */
sg_result sg_graph_replay(sg_graph graph, const sg_tensor* static_inputs, const sg_tensor* sources, size_t count);
/* sg_graph_replay, and then each of source_streams[0..stream_count) (cudaStream_t
 * values of the caller, e.g. torch's current stream; NULL is the legacy default
 * stream) waits until the copies have read the sources, so memory the caller's
 * allocator reuses on those streams after the call is not overwritten before it
 * was read. sg_graph_replay returns before the copies run: use this one when the
 * sources' memory may be reused right away. Ignored on a host context. */
sg_result sg_graph_replay_ordered(sg_graph graph, const sg_tensor* static_inputs, const sg_tensor* sources,
                                  size_t count, void* const* source_streams, size_t stream_count);
sg_result sg_graph_output_count(sg_graph graph, size_t* out);
sg_result sg_graph_output(sg_graph graph, size_t index, sg_tensor* out);
sg_result sg_graph_replay_count(sg_graph graph, int64_t* out);
sg_result sg_graph_segment_count(sg_graph graph, size_t* out);
sg_result sg_graph_pool_bytes(sg_graph graph, int64_t* out);
/* The pool report: tensors the step kept in the pool without returning them. */
sg_result sg_graph_pool_report_count(sg_graph graph, size_t* count, int64_t* bytes);
sg_result sg_graph_pool_report(sg_graph graph, char* buffer, size_t capacity, size_t* length);
/* The program and its plan, as text. */
sg_result sg_graph_dump(sg_graph graph, char* buffer, size_t capacity, size_t* length);
/* The trainer's --profile: runs the step once more with a timing mark around
 * every op (a real step: its optimizer update happens as in a replay) and
 * keeps the table of when each op ran (graphs/step_profile.h), which
 * sg_graph_last_profile copies out (as often as needed, without running
 * again). */
sg_result sg_graph_profile(sg_graph graph);
sg_result sg_graph_last_profile(sg_graph graph, char* buffer, size_t capacity, size_t* length);
/* Frees the pool now; later replays and reads of its outputs are errors. */
sg_result sg_graph_release_pool(sg_graph graph);

/* ---- Graph cache ------------------------------------------------------------ */

typedef struct sg_graph_cache_stats {
  int64_t hits;
  int64_t misses;
  int64_t captures;
  int64_t evictions;
  int64_t entries;
  int64_t pool_bytes;
} sg_graph_cache_stats;

/* Captured graphs by key, least recently used evicted beyond max_pool_bytes. */
sg_result sg_graph_cache_create(int64_t max_pool_bytes, sg_graph_cache* out);
sg_result sg_graph_cache_destroy(sg_graph_cache cache);
/* A hit returns the graph stored under `key`; a miss captures `fn` on `ctx`
 * (as sg_capture) and stores it. The key names everything the graph depends
 * on (shapes, configs, and which persistent tensors it reads and writes). */
sg_result sg_graph_cache_get_or_capture(sg_graph_cache cache, const char* key, sg_context ctx, sg_step_fn fn,
                                        void* user, sg_pool_report_policy policy, sg_graph* out);
/* Keys are per context: the same key on another context is another entry. */
sg_result sg_graph_cache_contains(sg_graph_cache cache, const char* key, sg_context ctx, int* out);
sg_result sg_graph_cache_erase(sg_graph_cache cache, const char* key, sg_context ctx);
sg_result sg_graph_cache_clear(sg_graph_cache cache);
sg_result sg_graph_cache_get_stats(sg_graph_cache cache, sg_graph_cache_stats* out);

/* ---- Per-layer graphs for pipeline schedules ------------------------------ */

/* Captures layers[0..layer_count) as one graph per layer, pass and microbatch,
 * in the order `order` gives, all planned into one pool (TransformerEngine's
 * make_graphed_callables with _order). `order` (order_length entries) is
 * TransformerEngine's signed form, counting from 1: +m runs microbatch m's
 * forward, -m its backward; each microbatch's forward runs once and its
 * backward once after it, so there are order_length / 2 microbatches.
 * sample_inputs[i] gives microbatch i's (0-based) input shape and dtype; its
 * values are not read. Each parameter's gradient is summed over the
 * microbatches (sg_graphed_layers_gradient). The graphs must be replayed in
 * the captured order (an error names the graph due otherwise); the handle
 * keeps the layers and the context alive. */
sg_result sg_graphed_layers_capture(sg_context ctx, const sg_layer* layers, size_t layer_count,
                                    const sg_tensor* sample_inputs, const int64_t* order, size_t order_length,
                                    sg_pool_report_policy policy, sg_graphed_layers* out);
sg_result sg_graphed_layers_destroy(sg_graphed_layers graphed);
/* Replays microbatch `microbatch`'s (0-based) forward through every layer,
 * after copying x into its static input (x NULL: none, the input was written
 * in place, see sg_graphed_layers_input). Source streams as for
 * sg_graph_replay_ordered. *y (may be NULL): a new handle to the stage's
 * output, valid until this pass runs again. */
sg_result sg_graphed_layers_forward(sg_graphed_layers graphed, int64_t microbatch, sg_tensor x,
                                    void* const* source_streams, size_t stream_count, sg_tensor* y);
/* The backward, last layer first, after copying dy into the static output
 * gradient; *dx (may be NULL) is NULL where the first layer computes no dx. */
sg_result sg_graphed_layers_backward(sg_graphed_layers graphed, int64_t microbatch, sg_tensor dy,
                                     void* const* source_streams, size_t stream_count, sg_tensor* dx);
/* The static input and output gradient of a microbatch (to write in place). */
sg_result sg_graphed_layers_input(sg_graphed_layers graphed, int64_t microbatch, sg_tensor* out);
sg_result sg_graphed_layers_grad_output(sg_graphed_layers graphed, int64_t microbatch, sg_tensor* out);
/* Every layer's parameters in order: the gradient summed over the microbatches. */
sg_result sg_graphed_layers_gradient_count(sg_graphed_layers graphed, size_t* out);
sg_result sg_graphed_layers_gradient(sg_graphed_layers graphed, size_t index, sg_tensor* out);
sg_result sg_graphed_layers_graph_count(sg_graphed_layers graphed, size_t* out);
/* The pool's bytes and the planner's lower bound for them. */
sg_result sg_graphed_layers_pool_bytes(sg_graphed_layers graphed, int64_t* pool_bytes, int64_t* lower_bound_bytes);
/* The name of the graph due next: "F0 layer 0 (linear)". */
sg_result sg_graphed_layers_next_graph(sg_graphed_layers graphed, char* buffer, size_t capacity, size_t* length);

/* ---- Checkpoints ------------------------------------------------------------ */

/* The whole training state of a language model (sg_language_model_create) or
 * a residual stack and of its optimizer, saved to one file and loaded back
 * (checkpoint/training_state.h): every parameter's fp32 master, AdamW's
 * moments, its step counter, the tally of skipped steps and the loss scale
 * where it keeps them, and the model's other state (FP8 delayed scaling's
 * amax histories and scales, the dropout generator). Steps after a load equal
 * those of the run that saved, bit for bit. The file is the trainer's
 * (--checkpoint): safetensors, with a checksum, written atomically (a crash
 * leaves the previous file whole), read strictly (checkpoint/checkpoint.h).
 *
 * Metadata: string keys and values of the caller's (a script's data position,
 * its settings), saved as given and handed back by sg_checkpoint_load with
 * the library's own entry "stepgraph.step" (the steps the optimizer ran: its
 * updates and the steps it skipped). Keys are non-empty; "stepgraph.step",
 * "stepgraph.checksum" and "stepgraph.checkpoint_set" are the library's. The
 * trainer's checkpoints carry its flags as "config.<flag>" and its data
 * position as "stepgraph.data_position"; a checkpoint the trainer should
 * resume carries those too (python/README.md: "Checkpoints"). Not saved: a
 * rate written by sg_optimizer_set_lr (write it again after a load; a
 * schedule needs nothing), and the caller's data.
 *
 * world: NULL, or a world of one: this process writes and reads the file at
 * `path`. A world of several ranks (every rank calls): where every rank holds
 * the same state, rank 0 writes the file and the others wait until it is
 * written; where the ranks hold different parts (a ZeRO-1 optimizer, a
 * tensor-parallel model), each rank writes its own part beside `path` and
 * the set is committed by a manifest at `path` (Note [Checkpoint sets] in
 * checkpoint/checkpoint_set.h), and each rank loads its own part. Pass the
 * whole world: every rank that holds a part. */
#define SG_CHECKPOINT_CONFIG_MAGIC 0x53474350u /* "SGCP" */
#define SG_CHECKPOINT_CONFIG_VERSION 1
typedef struct sg_checkpoint_config {
  size_t size;      /* sizeof(sg_checkpoint_config) where the caller was compiled */
  uint32_t magic;   /* SG_CHECKPOINT_CONFIG_MAGIC */
  uint32_t version; /* SG_CHECKPOINT_CONFIG_VERSION where the caller was compiled */
  /* Version 1. */
  sg_world world;                     /* see above; NULL: this process alone */
  const char* const* metadata_keys;   /* save: metadata_count keys (load: NULL) */
  const char* const* metadata_values; /* save: their values (load: NULL) */
  size_t metadata_count;
} sg_checkpoint_config;
#define SG_CHECKPOINT_CONFIG_INITIALIZER \
  { sizeof(sg_checkpoint_config), SG_CHECKPOINT_CONFIG_MAGIC, SG_CHECKPOINT_CONFIG_VERSION, NULL, NULL, NULL, 0 }
void sg_checkpoint_config_default(sg_checkpoint_config* config);
/* Saves `model`'s and `optimizer`'s state after the steps run so far (not
 * while a step is traced). The optimizer must be the one made over this
 * model's parameters alone. */
sg_result sg_checkpoint_save(sg_layer model, sg_optimizer optimizer, const char* path,
                             const sg_checkpoint_config* config);
/* Loads the state saved at `path` into `model` and `optimizer`, built as the
 * saving run built them (same config; an error names the tensor whose shape
 * or dtype differs, or that one of them lacks). A corrupt, truncated or
 * foreign file is SG_ERROR_IO naming the file and what is wrong; nothing is
 * loaded then. *metadata (may be NULL): a new handle to the checkpoint's
 * metadata, destroy it with sg_checkpoint_metadata_destroy. A captured step
 * of the model replays from the loaded state: no new capture is needed. */
sg_result sg_checkpoint_load(sg_layer model, sg_optimizer optimizer, const char* path,
                             const sg_checkpoint_config* config, sg_checkpoint_metadata* metadata);
/* The entries in key order: their count, and entry `index`'s key and value
 * (strings as everywhere: buffer, capacity, full length). */
sg_result sg_checkpoint_metadata_count(sg_checkpoint_metadata metadata, size_t* out);
sg_result sg_checkpoint_metadata_entry(sg_checkpoint_metadata metadata, size_t index, char* key,
                                       size_t key_capacity, size_t* key_length, char* value, size_t value_capacity,
                                       size_t* value_length);
sg_result sg_checkpoint_metadata_destroy(sg_checkpoint_metadata metadata);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STEPGRAPH_CAPI_STEPGRAPH_H_ */
