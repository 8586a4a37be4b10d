// The C API's optimizer (AdamW) and whole training step.
#include <memory>
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

extern "C" sg_result sg_adamw_create(sg_context ctx, const sg_layer* layers, size_t layer_count,
                                     const sg_adamw_config* config, sg_optimizer* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(ctx, function, "ctx");
    require(config, function, "config");
    require(out, function, "out");
    *out = nullptr;
    SG_CHECK(layer_count > 0, function, ": no layers given; AdamW needs the layers whose parameters it updates");
    require(layers, function, "layers");
    auto state = std::make_shared<capi::OptimizerState>();
    state->ctx = ctx->ctx;
    std::vector<Parameter*> parameters;
    for (size_t i = 0; i < layer_count; ++i) {
      SG_CHECK(layers[i] != nullptr, function, ": layers[", i, "] is NULL");
      SG_CHECK(layers[i]->ctx == ctx->ctx, function, ": layers[", i,
               "] belongs to another context; an optimizer updates the parameters of its own context");
      state->layers.push_back(layers[i]->layer);
      for (Parameter* p : layers[i]->layer->parameters()) parameters.push_back(p);
    }
    const kernels::AdamWHyper hyper{config->lr, config->beta1, config->beta2, config->eps, config->weight_decay};
    state->adamw = std::make_unique<AdamW>(*ctx->ctx, parameters, hyper);
    *out = new sg_optimizer_s{std::move(state)};
  });
}

extern "C" sg_result sg_optimizer_destroy(sg_optimizer optimizer) {
  return run_guarded(__func__, [&, function = __func__] { delete optimizer; });
}

extern "C" sg_result sg_optimizer_step(sg_optimizer optimizer) {
  return run_guarded(__func__, [&, function = __func__] {
    require(optimizer, function, "optimizer");
    optimizer->state->adamw->step(*optimizer->state->ctx);
  });
}

extern "C" sg_result sg_optimizer_steps_taken(sg_optimizer optimizer, int64_t* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(optimizer, function, "optimizer");
    require(out, function, "out");
    *out = optimizer->state->adamw->steps_taken(*optimizer->state->ctx);
  });
}

extern "C" sg_result sg_train_step_create(sg_layer model, sg_optimizer optimizer, int64_t tokens, sg_train_step* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(model, function, "model");
    require(optimizer, function, "optimizer");
    require(out, function, "out");
    *out = nullptr;
    SG_CHECK(model->ctx == optimizer->state->ctx, function,
             ": the model and the optimizer belong to different contexts");
    auto state = std::make_shared<capi::TrainStepState>();
    state->ctx = model->ctx;
    state->model = model->layer;
    state->optimizer = optimizer->state;
    state->step =
        std::make_unique<TrainStep>(*state->ctx, capi::residual_stack_of(*model), *state->optimizer->adamw, tokens);
    *out = new sg_train_step_s{std::move(state)};
  });
}

extern "C" sg_result sg_train_step_destroy(sg_train_step step) {
  return run_guarded(__func__, [&, function = __func__] { delete step; });
}

extern "C" sg_result sg_train_step_inputs(sg_train_step step, sg_tensor* x, sg_tensor* labels) {
  return run_guarded(__func__, [&, function = __func__] {
    require(step, function, "step");
    const capi::TrainStepState& s = *step->state;
    if (x != nullptr) *x = capi::new_tensor_handle(s.ctx, s.step->inputs());
    if (labels != nullptr) *labels = capi::new_tensor_handle(s.ctx, s.step->labels());
  });
}

extern "C" sg_result sg_train_step_run(sg_train_step step, sg_tensor* loss) {
  return run_guarded(__func__, [&, function = __func__] {
    require(step, function, "step");
    require(loss, function, "loss");
    *loss = nullptr;
    const capi::TrainStepState& s = *step->state;
    *loss = capi::new_tensor_handle(s.ctx, (*s.step)(*s.ctx).at(0));
  });
}

extern "C" sg_result sg_train_step_check_errors(sg_train_step step) {
  return run_guarded(__func__, [&, function = __func__] {
    require(step, function, "step");
    step->state->step->check_errors(*step->state->ctx);
  });
}
