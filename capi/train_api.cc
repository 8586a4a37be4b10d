// The C API's optimizer (AdamW) and whole training step.
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "capi/handles.h"

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
sg_result create_adamw(const char* function, sg_context ctx, const sg_layer* layers, size_t layer_count,
                       const sg_adamw_config* config, const sg_lr_schedule* schedule, sg_optimizer* out) {
  return run_guarded(function, [&] {
    const std::shared_ptr<Context> context = capi::context_of(ctx, function);
    require(config, function, "config");
    require(out, function, "out");
    *out = nullptr;
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
    *out = capi::issue_handle(std::make_shared<sg_optimizer_s>(sg_optimizer_s{std::move(state)}));
  });
}

}  // namespace

extern "C" sg_result sg_adamw_create(sg_context ctx, const sg_layer* layers, size_t layer_count,
                                     const sg_adamw_config* config, sg_optimizer* out) {
  return create_adamw(__func__, ctx, layers, layer_count, config, nullptr, out);
}

extern "C" sg_result sg_adamw_create_scheduled(sg_context ctx, const sg_layer* layers, size_t layer_count,
                                               const sg_adamw_config* config, const sg_lr_schedule* schedule,
                                               sg_optimizer* out) {
  if (schedule == nullptr) {
    return run_guarded(__func__, [&, function = __func__] { require(schedule, function, "schedule"); });
  }
  return create_adamw(__func__, ctx, layers, layer_count, config, schedule, out);
}

extern "C" sg_result sg_optimizer_set_lr(sg_optimizer optimizer, float lr) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto state = capi::handle_object(optimizer, function, "optimizer")->state;
    state->adamw->set_lr(*state->ctx, lr);
  });
}

extern "C" sg_result sg_optimizer_lr(sg_optimizer optimizer, float* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto state = capi::handle_object(optimizer, function, "optimizer")->state;
    require(out, function, "out");
    *out = state->adamw->lr(*state->ctx);
  });
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
  return run_guarded(__func__, [&, function = __func__] {
    const auto state = capi::handle_object(optimizer, function, "optimizer")->state;
    require(out, function, "out");
    *out = state->adamw->steps_taken(*state->ctx);
  });
}

namespace {

// A train step of `model` and `optimizer` over `tokens` rows, data parallel over `world` when it has a communicator.
sg_train_step create_train_step(const char* function, sg_layer model, sg_optimizer optimizer, std::int64_t tokens,
                                std::shared_ptr<capi::WorldState> world) {
  const auto m = capi::handle_object(model, function, "model");
  const auto o = capi::handle_object(optimizer, function, "optimizer");
  SG_CHECK(m->ctx == o->state->ctx, function, ": the model and the optimizer belong to different contexts");
  auto state = std::make_shared<capi::TrainStepState>();
  state->ctx = m->ctx;
  state->model = m->layer;
  state->optimizer = o->state;
  state->world = std::move(world);
  Communicator* data_parallel = state->world != nullptr ? state->world->comm.get() : nullptr;
  state->step = std::make_unique<TrainStep>(*state->ctx, capi::residual_stack_of(*m), *state->optimizer->adamw, tokens,
                                            data_parallel);
  return capi::issue_handle(std::make_shared<sg_train_step_s>(sg_train_step_s{std::move(state)}));
}

// The size of each version of sg_train_step_config (index: version).
constexpr std::size_t kTrainStepConfigSize[] = {0, sizeof(sg_train_step_config)};
constexpr std::uint32_t kTrainStepConfigVersions = std::size(kTrainStepConfigSize) - 1;
static_assert(kTrainStepConfigVersions == SG_TRAIN_STEP_CONFIG_VERSION, "a new config version needs its size here");

// Which fields of `config` the caller knows (its version); an Error for a
// struct that was not initialised or that this library cannot read.
void check_config_header(const sg_train_step_config& config, const char* function) {
  SG_CHECK(config.magic == SG_TRAIN_STEP_CONFIG_MAGIC, function, ": config was not initialised (magic 0x", std::hex,
           config.magic, ", expected 0x", SG_TRAIN_STEP_CONFIG_MAGIC, std::dec,
           "); start from sg_train_step_config_default or SG_TRAIN_STEP_CONFIG_INITIALIZER");
  SG_CHECK(config.version >= 1 && config.version <= kTrainStepConfigVersions, function, ": config version ",
           config.version, " is not one this library reads (1 to ", kTrainStepConfigVersions,
           "); the caller was built against another stepgraph.h (a newer one?)");
  SG_CHECK(config.size == kTrainStepConfigSize[config.version], function, ": config size ", config.size,
           " does not match version ", config.version, " (", kTrainStepConfigSize[config.version],
           " bytes); set size = sizeof(sg_train_step_config) as sg_train_step_config_default does");
}

}  // namespace

extern "C" sg_result sg_train_step_create(sg_layer model, sg_optimizer optimizer, int64_t tokens, sg_train_step* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(out, function, "out");
    *out = nullptr;
    *out = create_train_step(function, model, optimizer, tokens, nullptr);
  });
}

extern "C" void sg_train_step_config_default(sg_train_step_config* config) {
  if (config == nullptr) return;
  *config = SG_TRAIN_STEP_CONFIG_INITIALIZER;
}

extern "C" sg_result sg_train_step_create_with_config(sg_layer model, sg_optimizer optimizer,
                                                      const sg_train_step_config* config, sg_train_step* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(out, function, "out");
    *out = nullptr;
    require(config, function, "config");
    check_config_header(*config, function);
    std::shared_ptr<capi::WorldState> world;
    if (config->world != nullptr) world = capi::handle_object(config->world, function, "config->world")->state;
    *out = create_train_step(function, model, optimizer, config->tokens, std::move(world));
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
