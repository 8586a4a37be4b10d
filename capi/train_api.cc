// The C API's optimizer (AdamW) and whole training step.
#include <cstddef>
#include <cstring>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "capi/handles.h"
#include "capi/versioned_config.h"

using namespace stepgraph;  // NOLINT(google-build-using-namespace): the C entry points below
using capi::require;
using capi::run_guarded;

extern "C" void sg_adamw_config_default(sg_adamw_config* config) {
  if (config == nullptr) return;
  const kernels::AdamWHyper d;
  *config = {d.lr, d.beta1, d.beta2, d.eps, d.weight_decay};
}

namespace {

// AdamW over the parameters of `layers`, with `schedule` when given.
std::shared_ptr<capi::OptimizerState> make_adamw(const char* function, sg_context ctx, const sg_layer* layers,
                                                 size_t layer_count, const sg_adamw_config* config,
                                                 const sg_lr_schedule* schedule) {
  const std::shared_ptr<Context> context = capi::context_of(ctx, function);
  require(config, function, "config");
  SG_CHECK(layer_count > 0, function, ": no layers given; AdamW needs the layers whose parameters it updates");
  require(layers, function, "layers");
  std::optional<kernels::LrSchedule> lr_schedule;
  if (schedule != nullptr) {
    SG_CHECK(schedule->kind >= 0 && schedule->kind <= 2, function, ": schedule->kind must be 0 (constant), 1 "
             "(cosine) or 2 (linear), got ", schedule->kind);
    SG_CHECK(schedule->total >= 0, function, ": schedule->total must be >= 0, got ", schedule->total);
    // A constant schedule has no decay: min_lr and total would be ignored.
    SG_CHECK(schedule->kind != 0 || (schedule->min_lr == 0.0f && schedule->total == 0), function,
             ": schedule->min_lr (", schedule->min_lr, ") and schedule->total (", schedule->total,
             ") set the decay of cosine and linear schedules; a constant one (kind 0) ignores them, so leave them 0");
    lr_schedule = kernels::LrSchedule{.kind = static_cast<kernels::LrScheduleKind>(schedule->kind),
                                      .base = schedule->base,
                                      .min_lr = schedule->min_lr,
                                      .warmup = schedule->warmup,
                                      .total = schedule->total};
  }
  auto state = std::make_shared<capi::OptimizerState>();
  state->ctx = context;
  std::vector<Parameter*> parameters;
  for (size_t i = 0; i < layer_count; ++i) {
    const auto layer = capi::handle_object(layers[i], function, "layers[" + std::to_string(i) + "]");
    SG_CHECK(layer->ctx == context, function, ": layers[", i,
             "] belongs to another context; an optimizer updates the parameters of its own context");
    state->layers.push_back(layer->layer);
    for (Parameter* p : layer->layer->parameters()) parameters.push_back(p);
  }
  const kernels::AdamWHyper hyper{config->lr, config->beta1, config->beta2, config->eps, config->weight_decay};
  state->adamw = std::make_unique<AdamW>(*context, parameters, hyper, lr_schedule);
  return state;
}

sg_optimizer issue_optimizer(std::shared_ptr<capi::OptimizerState> state) {
  return capi::issue_handle(std::make_shared<sg_optimizer_s>(sg_optimizer_s{std::move(state)}));
}

}  // namespace

namespace {

// The size of each version of sg_optimizer_config (index: version).
constexpr std::size_t kOptimizerConfigSizes[] = {0, sizeof(sg_optimizer_config)};
static_assert(std::size(kOptimizerConfigSizes) - 1 == SG_OPTIMIZER_CONFIG_VERSION,
              "a new config version needs its size here");

sg_optimizer_config default_optimizer_config() {
  sg_optimizer_config c = SG_OPTIMIZER_CONFIG_INITIALIZER;
  sg_adamw_config_default(&c.adamw);
  const kernels::LrSchedule schedule;
  c.lr_schedule = {static_cast<int>(schedule.kind), schedule.base, schedule.min_lr, schedule.warmup, schedule.total};
  const kernels::LossScaling scaling;
  c.loss_scale_initial = scaling.initial_scale;
  c.loss_scale_growth_factor = scaling.growth_factor;
  c.loss_scale_backoff_factor = scaling.backoff_factor;
  c.loss_scale_growth_interval = scaling.growth_interval;
  return c;
}

// The body of an optimizer call that writes one value: the handle checked,
// then `out` required, then `*out = read(state)`; an error names `function`.
template <typename T, typename Read>
sg_result read_optimizer(const char* function, sg_optimizer optimizer, T* out, const Read& read) {
  return run_guarded(function, [&] {
    const auto state = capi::handle_object(optimizer, function, "optimizer")->state;
    require(out, function, "out");
    *out = read(*state);
  });
}

}  // namespace

extern "C" void sg_optimizer_config_default(sg_optimizer_config* config) {
  if (config != nullptr) *config = default_optimizer_config();
}

extern "C" sg_result sg_optimizer_create(sg_context ctx, const sg_layer* layers, size_t layer_count,
                                         const sg_optimizer_config* config, sg_optimizer* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(config, function, "config");
    require(out, function, "out");
    *out = nullptr;
    const sg_optimizer_config c =
        capi::read_versioned_config(*config, default_optimizer_config(), kOptimizerConfigSizes,
                                    SG_OPTIMIZER_CONFIG_MAGIC, function, "sg_optimizer_config",
                                    "sg_optimizer_config_default or SG_OPTIMIZER_CONFIG_INITIALIZER");
    const bool scheduled = capi::to_flag(c.schedule, function, "config->schedule");
    const bool skip = capi::to_flag(c.skip_nonfinite, function, "config->skip_nonfinite");
    const bool scaling = capi::to_flag(c.loss_scaling, function, "config->loss_scaling");
    const bool step_scoped = capi::to_flag(c.step_scoped_gradients, function, "config->step_scoped_gradients");
    const sg_optimizer_config defaults = default_optimizer_config();
    // Fields that would be ignored keep their defaults, so that a value set there is not dropped silently.
    SG_CHECK(scaling || (c.loss_scale_initial == defaults.loss_scale_initial &&
                         c.loss_scale_growth_factor == defaults.loss_scale_growth_factor &&
                         c.loss_scale_backoff_factor == defaults.loss_scale_backoff_factor &&
                         c.loss_scale_growth_interval == defaults.loss_scale_growth_interval),
             function, ": config->loss_scale_* set dynamic loss scaling, and config->loss_scaling is 0; set it to 1 "
             "or leave them at sg_optimizer_config_default's values");
    SG_CHECK(!scaling || skip, function, ": config->loss_scaling skips the steps whose scaled gradients overflow, "
             "and config->skip_nonfinite is 0; set skip_nonfinite = 1 too");
    SG_CHECK(c.loss_scale_growth_interval >= 1, function, ": config->loss_scale_growth_interval must be >= 1, got ",
             c.loss_scale_growth_interval);
    if (!scheduled) {
      const sg_lr_schedule& s = c.lr_schedule;
      const sg_lr_schedule& d = defaults.lr_schedule;
      SG_CHECK(s.kind == d.kind && s.base == d.base && s.min_lr == d.min_lr && s.warmup == d.warmup &&
                   s.total == d.total,
               function, ": config->lr_schedule is set, and config->schedule is 0; set schedule = 1 to use it");
    }
    std::shared_ptr<capi::OptimizerState> state =
        make_adamw(function, ctx, layers, layer_count, &c.adamw, scheduled ? &c.lr_schedule : nullptr);
    AdamW& adamw = *state->adamw;
    if (skip) adamw.set_skip_nonfinite(*state->ctx, true);
    if (scaling) {
      adamw.set_loss_scaling(*state->ctx, kernels::LossScaling{.initial_scale = c.loss_scale_initial,
                                                               .growth_factor = c.loss_scale_growth_factor,
                                                               .backoff_factor = c.loss_scale_backoff_factor,
                                                               .growth_interval = c.loss_scale_growth_interval});
    }
    if (step_scoped) adamw.use_step_scoped_gradients(*state->ctx);
    *out = issue_optimizer(std::move(state));
  });
}

extern "C" sg_result sg_optimizer_skipped_steps(sg_optimizer optimizer, int64_t* out) {
  return read_optimizer(__func__, optimizer, out, [](const capi::OptimizerState& state) {
    return state.adamw->skips_nonfinite() ? state.adamw->skipped_steps(*state.ctx) : 0;
  });
}

extern "C" sg_result sg_optimizer_loss_scale(sg_optimizer optimizer, float* out) {
  return read_optimizer(__func__, optimizer, out, [](const capi::OptimizerState& state) {
    return state.adamw->scales_loss() ? state.adamw->loss_scale(*state.ctx) : 1.0f;
  });
}

extern "C" sg_result sg_optimizer_set_lr(sg_optimizer optimizer, float lr) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto state = capi::handle_object(optimizer, function, "optimizer")->state;
    state->adamw->set_lr(*state->ctx, lr);
  });
}

extern "C" sg_result sg_optimizer_lr(sg_optimizer optimizer, float* out) {
  return read_optimizer(__func__, optimizer, out,
                        [](const capi::OptimizerState& state) { return state.adamw->lr(*state.ctx); });
}

extern "C" sg_result sg_optimizer_destroy(sg_optimizer optimizer) {
  return capi::destroy_handle(optimizer, __func__, "optimizer");
}

extern "C" sg_result sg_optimizer_step(sg_optimizer optimizer) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto state = capi::handle_object(optimizer, function, "optimizer")->state;
    state->adamw->step(*state->ctx);
  });
}

extern "C" sg_result sg_optimizer_steps_taken(sg_optimizer optimizer, int64_t* out) {
  return read_optimizer(__func__, optimizer, out,
                        [](const capi::OptimizerState& state) { return state.adamw->steps_taken(*state.ctx); });
}

namespace {

// The size of each version of sg_train_step_config (index: version).
constexpr std::size_t kTrainStepConfigSizes[] = {0, offsetof(sg_train_step_config, sequences),
                                                 sizeof(sg_train_step_config)};
static_assert(std::size(kTrainStepConfigSizes) - 1 == SG_TRAIN_STEP_CONFIG_VERSION,
              "a new config version needs its size here");

// The TrainStep of a language model over config.tokens rows (see stepgraph.h).
std::unique_ptr<TrainStep> language_model_step(const char* function, Context& ctx, LanguageModel& model,
                                               AdamW& optimizer, const sg_train_step_config& config,
                                               Communicator* data_parallel, DataParallelMode mode) {
  const LanguageModelConfig& m = model.config();
  SG_CHECK(config.tokens > 0, function, ": config->tokens must be > 0, got ", config.tokens);
  SG_CHECK(config.sequences >= 0, function, ": config->sequences must be >= 0, got ", config.sequences);
  SG_CHECK(data_parallel == nullptr || data_parallel != model.stack().tensor_parallel(), function,
           ": config->world is the model's tensor-parallel world; one world cannot be both: make the model "
           "tensor parallel over the whole world and leave config->world NULL, or data parallel alone");
  if (!m.sequence_model()) {
    SG_CHECK(config.sequences == 0, function, ": config->sequences (", config.sequences,
             ") packs a GPT's sequences, and this is the window model (heads = 0), one example per row; leave it 0");
    return std::make_unique<TrainStep>(ctx, model, optimizer, config.tokens, data_parallel, mode);
  }
  if (config.sequences > 0) {
    return std::make_unique<TrainStep>(ctx, model, optimizer,
                                       TrainStep::PackedTokens{.tokens = config.tokens, .sequences = config.sequences},
                                       data_parallel, mode);
  }
  SG_CHECK(config.tokens % m.context == 0, function, ": config->tokens (", config.tokens,
           ") must be a multiple of the model's context (", m.context,
           "): the step trains on tokens / context sequences of context tokens; or set config->sequences for "
           "sequences of any lengths");
  return std::make_unique<TrainStep>(ctx, model, optimizer, config.tokens / m.context, data_parallel, mode);
}

// A train step of `model` and `optimizer` as `config` says; `world` is config->world's.
sg_train_step create_train_step(const char* function, sg_layer model, sg_optimizer optimizer,
                                const sg_train_step_config& config, std::shared_ptr<capi::WorldState> world) {
  const auto m = capi::handle_object(model, function, "model");
  const auto o = capi::handle_object(optimizer, function, "optimizer");
  SG_CHECK(m->ctx == o->state->ctx, function, ": the model and the optimizer belong to different contexts");
  const bool zero1 = capi::to_flag(config.zero1, function, "config->zero1");
  auto state = std::make_shared<capi::TrainStepState>();
  state->ctx = m->ctx;
  state->model = m->layer;
  state->optimizer = o->state;
  state->world = std::move(world);
  Communicator* data_parallel = state->world != nullptr ? state->world->comm.get() : nullptr;
  SG_CHECK(!zero1 || data_parallel != nullptr, function,
           ": config->zero1 shards the optimizer over a data-parallel world, and config->world has one rank (or is "
           "NULL); pass a world of several ranks or leave zero1 0");
  const DataParallelMode mode = zero1 ? DataParallelMode::kZero1 : DataParallelMode::kAllReduce;
  if (LanguageModel* language_model = capi::language_model_of(*m->layer)) {
    state->step = language_model_step(function, *state->ctx, *language_model, *state->optimizer->adamw, config,
                                      data_parallel, mode);
  } else {
    SG_CHECK(config.sequences == 0, function, ": config->sequences (", config.sequences,
             ") packs the sequences of a language model with attention; a residual stack has none, leave it 0");
    state->step = std::make_unique<TrainStep>(*state->ctx, capi::residual_stack_of(*m), *state->optimizer->adamw,
                                              config.tokens, data_parallel, mode);
  }
  return capi::issue_handle(std::make_shared<sg_train_step_s>(sg_train_step_s{std::move(state)}));
}

}  // namespace

extern "C" void sg_train_step_config_default(sg_train_step_config* config) {
  if (config == nullptr) return;
  *config = SG_TRAIN_STEP_CONFIG_INITIALIZER;
}

extern "C" sg_result sg_train_step_create(sg_layer model, sg_optimizer optimizer, const sg_train_step_config* config,
                                          sg_train_step* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(out, function, "out");
    *out = nullptr;
    require(config, function, "config");
    const sg_train_step_config c = capi::read_versioned_config(
        *config, sg_train_step_config(SG_TRAIN_STEP_CONFIG_INITIALIZER), kTrainStepConfigSizes,
        SG_TRAIN_STEP_CONFIG_MAGIC, function, "sg_train_step_config",
        "sg_train_step_config_default or SG_TRAIN_STEP_CONFIG_INITIALIZER");
    std::shared_ptr<capi::WorldState> world;
    if (c.world != nullptr) world = capi::handle_object(c.world, function, "config->world")->state;
    *out = create_train_step(function, model, optimizer, c, std::move(world));
  });
}

extern "C" sg_result sg_train_step_destroy(sg_train_step step) { return capi::destroy_handle(step, __func__, "step"); }

extern "C" sg_result sg_train_step_inputs(sg_train_step step, sg_tensor* x, sg_tensor* labels) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<capi::TrainStepState> state = capi::handle_object(step, function, "step")->state;
    const capi::TrainStepState& s = *state;
    if (x != nullptr) *x = capi::new_tensor_handle(s.ctx, s.step->inputs());
    if (labels != nullptr) *labels = capi::new_tensor_handle(s.ctx, s.step->labels());
  });
}

extern "C" sg_result sg_train_step_packing(sg_train_step step, sg_tensor* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<capi::TrainStepState> state = capi::handle_object(step, function, "step")->state;
    require(out, function, "out");
    *out = capi::new_tensor_handle(state->ctx, state->step->packing());
  });
}

extern "C" sg_result sg_train_step_run(sg_train_step step, sg_tensor* loss) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<capi::TrainStepState> state = capi::handle_object(step, function, "step")->state;
    require(loss, function, "loss");
    *loss = nullptr;
    const capi::TrainStepState& s = *state;
    *loss = capi::new_tensor_handle(s.ctx, (*s.step)(*s.ctx).at(0));
  });
}

extern "C" sg_result sg_train_step_check_errors(sg_train_step step) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<capi::TrainStepState> state = capi::handle_object(step, function, "step")->state;
    state->step->check_errors(*state->ctx);
  });
}
