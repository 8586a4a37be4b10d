// The C API's layers: the four dense layers and the ResidualStack behind one
// AnyLayer (their configs: capi/layer_configs.cc), forward/backward with an
// opaque saved state, parameters.
#include <memory>
#include <optional>
#include <string>
#include <type_traits>

#include "capi/handles.h"
#include "capi/layer_configs.h"
#include "engine/fp8_recipe.h"
#include "layers/comm_gemm_overlap.h"
#include "layers/layernorm_linear.h"
#include "layers/layernorm_mlp.h"
#include "layers/linear.h"
#include "layers/norm.h"
#include "layers/residual_stack.h"

namespace stepgraph::capi {
namespace {

template <typename L>
using LayerAdapter = AnyLayerOf<L>;

}  // namespace

void check_moe_fields(std::int64_t experts, std::int64_t topk, std::int64_t moe_every, const char* function) {
  // Without experts no block routes: topk and moe_every would be ignored.
  const ResidualStackConfig defaults;
  SG_CHECK(experts != 0 || (topk == defaults.topk && moe_every == defaults.moe_every), function, ": config topk (",
           topk, ") and moe_every (", moe_every,
           ") apply to mixture-of-experts blocks, and experts is 0; set experts > 0, or leave them at their defaults (",
           defaults.topk, ", ", defaults.moe_every, ")");
}

std::optional<Fp8Recipe> to_fp8_recipe(const sg_fp8_recipe* r, const char* function) {
  if (r == nullptr) return std::nullopt;
  SG_CHECK(r->scaling == SG_FP8_CURRENT || r->scaling == SG_FP8_DELAYED || r->scaling == SG_FP8_BLOCK,
           "sg_fp8_recipe: scaling ", static_cast<int>(r->scaling), " is not SG_FP8_CURRENT, SG_FP8_DELAYED or "
           "SG_FP8_BLOCK");
  Fp8Recipe recipe;
  recipe.scaling = static_cast<Fp8Scaling>(r->scaling);
  recipe.formats = to_flag(r->hybrid, function, "recipe hybrid") ? Fp8Formats::kHybrid : Fp8Formats::kE4M3;
  recipe.amax_history_len = r->amax_history_len;
  recipe.amax_reduction = to_flag(r->amax_most_recent, function, "recipe amax_most_recent") ? AmaxReduction::kMostRecent
                                                                                            : AmaxReduction::kMax;
  recipe.margin = r->margin;
  recipe.power_of_two_scales = to_flag(r->power_of_two_scales, function, "recipe power_of_two_scales");
  recipe.fast_accumulation_forward =
      to_flag(r->fast_accumulation_forward, function, "recipe fast_accumulation_forward");
  recipe.fast_accumulation_backward =
      to_flag(r->fast_accumulation_backward, function, "recipe fast_accumulation_backward");
  recipe.on_non_finite = to_flag(r->stop_on_non_finite, function, "recipe stop_on_non_finite")
                             ? NonFiniteAmax::kStop
                             : NonFiniteAmax::kSkipStep;
  // Fields another scaling reads (engine/fp8_recipe.h: ignored otherwise) keep the defaults, so
  // that a value set there is not dropped silently.
  const Fp8Recipe defaults;
  SG_CHECK(recipe.scaling == Fp8Scaling::kDelayed ||
               (recipe.amax_history_len == defaults.amax_history_len &&
                recipe.amax_reduction == defaults.amax_reduction && recipe.margin == defaults.margin),
           function, ": recipe amax_history_len (", recipe.amax_history_len, "), amax_most_recent and margin (",
           recipe.margin, ") apply to delayed scaling only; leave them at sg_fp8_recipe_default's values");
  SG_CHECK(recipe.scaling == Fp8Scaling::kBlock || recipe.power_of_two_scales == defaults.power_of_two_scales, function,
           ": recipe power_of_two_scales applies to block scaling only; leave it at 1");
  recipe.check();
  return recipe;
}

sg_fp8_recipe from_fp8_recipe(const Fp8Recipe& r) {
  return {static_cast<sg_fp8_scaling>(r.scaling),
          r.formats == Fp8Formats::kHybrid ? 1 : 0,
          r.amax_history_len,
          r.amax_reduction == AmaxReduction::kMostRecent ? 1 : 0,
          r.margin,
          r.power_of_two_scales ? 1 : 0,
          r.fast_accumulation_forward ? 1 : 0,
          r.fast_accumulation_backward ? 1 : 0,
          r.on_non_finite == NonFiniteAmax::kStop ? 1 : 0};
}

namespace {

// A layer L(ctx, args...) behind a new handle; it keeps `keeps` alive.
template <typename L, typename... Args>
void make_layer_keeping(sg_context ctx, sg_layer* out, const char* function, std::shared_ptr<const void> keeps,
                        Args&&... args) {
  const std::shared_ptr<Context> context = capi::context_of(ctx, function);
  require(out, function, "out");
  *out = nullptr;
  auto layer = std::make_shared<LayerAdapter<L>>(*context, std::forward<Args>(args)...);
  layer->keeps = std::move(keeps);
  *out = capi::issue_handle(std::make_shared<sg_layer_s>(sg_layer_s{context, std::move(layer)}));
}

template <typename L, typename... Args>
void make_layer(sg_context ctx, sg_layer* out, const char* function, Args&&... args) {
  make_layer_keeping<L>(ctx, out, function, nullptr, std::forward<Args>(args)...);
}

const char* checked_name(const char* name, const char* function) {
  require(name, function, "name");
  SG_CHECK(name[0] != '\0', function, ": name is empty; layers name their parameters after it");
  return name;
}

Parameter& parameter_at(const sg_layer_s& layer, int64_t index, const char* function) {
  std::vector<Parameter*> parameters = layer.layer->parameters();
  SG_CHECK(index >= 0 && index < static_cast<int64_t>(parameters.size()), function, ": parameter index ", index,
           " is outside [0, ", parameters.size(), ") for this ", layer.layer->kind(), " layer");
  return *parameters[static_cast<std::size_t>(index)];
}

// What the layer counted on the device: non-finite FP8 amaxes where its
// recipe says stop, a stack's MoE routing errors.
void check_layer_errors(Context& ctx, AnyLayer& layer) {
  if (auto* linear = dynamic_cast<LayerAdapter<Linear>*>(&layer)) {
    linear->layer().check_errors(ctx);
  } else if (auto* norm_linear = dynamic_cast<LayerAdapter<LayerNormLinear>*>(&layer)) {
    norm_linear->layer().linear().check_errors(ctx);
  } else if (auto* mlp = dynamic_cast<LayerAdapter<LayerNormMLP>*>(&layer)) {
    for (const Linear* fc : mlp->layer().fp8_linears()) fc->check_errors(ctx);
  } else if (auto* stack = dynamic_cast<LayerAdapter<ResidualStack>*>(&layer)) {
    stack->layer().check_errors(ctx);
  } else if (LanguageModel* model = language_model_of(layer)) {
    model->check_errors(ctx);
  }
}

}  // namespace

ResidualStack& residual_stack_of(const sg_layer_s& layer) {
  auto* adapter = dynamic_cast<LayerAdapter<ResidualStack>*>(layer.layer.get());
  SG_CHECK(adapter != nullptr, "a train step needs a residual stack (sg_residual_stack_create), got a ",
           layer.layer->kind(), " layer");
  return adapter->layer();
}

}  // namespace stepgraph::capi

using namespace stepgraph;  // NOLINT(google-build-using-namespace): the C entry points below
using capi::require;
using capi::run_guarded;

extern "C" void sg_fp8_recipe_default(sg_fp8_recipe* recipe, sg_fp8_scaling scaling) {
  if (recipe == nullptr) return;
  *recipe = capi::from_fp8_recipe(scaling == SG_FP8_DELAYED ? Fp8Recipe::delayed()
                                  : scaling == SG_FP8_BLOCK ? Fp8Recipe::block()
                                                            : Fp8Recipe::current());
  recipe->scaling = scaling;  // an unknown value stays, for the layer to refuse by name
}

extern "C" sg_result sg_linear_create(sg_context ctx, const char* name, const sg_linear_config* config, uint32_t seed,
                                      sg_layer* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(config, function, "config");
    capi::make_layer<Linear>(ctx, out, function, capi::checked_name(name, function),
                             capi::read_linear_config(*config, function), seed);
  });
}

extern "C" sg_result sg_norm_create(sg_context ctx, const char* name, const sg_norm_config* config, sg_layer* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(config, function, "config");
    capi::make_layer<Norm>(ctx, out, function, capi::checked_name(name, function),
                           capi::read_norm_config(*config, function));
  });
}

extern "C" sg_result sg_layernorm_linear_create(sg_context ctx, const char* name,
                                                const sg_layernorm_linear_config* config, uint32_t seed,
                                                sg_layer* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(config, function, "config");
    capi::make_layer<LayerNormLinear>(ctx, out, function, capi::checked_name(name, function),
                                      capi::read_layernorm_linear_config(*config, function), seed);
  });
}

extern "C" sg_result sg_layernorm_mlp_create(sg_context ctx, const char* name, const sg_layernorm_mlp_config* config,
                                             uint32_t seed, sg_layer* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(config, function, "config");
    capi::make_layer<LayerNormMLP>(ctx, out, function, capi::checked_name(name, function),
                                   capi::read_layernorm_mlp_config(*config, function), seed);
  });
}

extern "C" sg_result sg_residual_stack_create(sg_context ctx, const sg_residual_stack_config* config, sg_layer* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(config, function, "config");
    const sg_residual_stack_config c = capi::read_residual_stack_config(*config, function);
    std::shared_ptr<capi::WorldState> world;
    if (c.tensor_parallel != nullptr) {
      world = capi::handle_object(c.tensor_parallel, function, "config->tensor_parallel")->state;
    }
    Communicator* tensor_parallel = world != nullptr ? world->comm.get() : nullptr;  // null: a world of one
    capi::make_layer_keeping<ResidualStack>(ctx, out, function, world, capi::to_residual_stack_config(c, function),
                                            tensor_parallel);
  });
}

extern "C" sg_result sg_layer_destroy(sg_layer layer) {
  return capi::destroy_handle(layer, __func__, "layer");
}

extern "C" sg_result sg_layer_kind(sg_layer layer, char* buffer, size_t capacity, size_t* length) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto l = capi::handle_object(layer, function, "layer");
    capi::copy_string(l->layer->kind(), buffer, capacity, length);
  });
}

extern "C" sg_result sg_layer_forward(sg_layer layer, sg_tensor x, sg_tensor* y, sg_saved* saved) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto l = capi::handle_object(layer, function, "layer");
    const auto input = capi::handle_object(x, function, "x");
    require(y, function, "y");
    require(saved, function, "saved");
    *y = nullptr;
    *saved = nullptr;
    auto [output, state] = l->layer->forward(*l->ctx, input->tensor);
    auto saved_object = std::make_shared<sg_saved_s>(sg_saved_s{l->layer, std::move(state)});
    *y = capi::new_tensor_handle(l->ctx, std::move(output));
    *saved = capi::issue_handle(std::move(saved_object));
  });
}

extern "C" sg_result sg_layer_backward(sg_layer layer, sg_saved saved, sg_tensor dy, sg_tensor* dx) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto l = capi::handle_object(layer, function, "layer");
    const auto s = capi::handle_object(saved, function, "saved");
    const auto gradient = capi::handle_object(dy, function, "dy");
    require(dx, function, "dx");
    *dx = nullptr;
    SG_CHECK(s->layer == l->layer, function, ": the saved state comes from the forward of another ",
             s->layer->kind(), " layer; pass the saved state of this layer's own forward");
    *dx = capi::new_tensor_handle(l->ctx, l->layer->backward(*l->ctx, s->saved, gradient->tensor));
  });
}

extern "C" sg_result sg_saved_destroy(sg_saved saved) {
  return capi::destroy_handle(saved, __func__, "saved");
}

extern "C" sg_result sg_layer_parameter_count(sg_layer layer, int64_t* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto l = capi::handle_object(layer, function, "layer");
    require(out, function, "out");
    *out = static_cast<int64_t>(l->layer->parameters().size());
  });
}

extern "C" sg_result sg_layer_parameter(sg_layer layer, int64_t index, char* name, size_t capacity, size_t* length,
                                        sg_tensor* master, sg_tensor* value, sg_tensor* grad) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto l = capi::handle_object(layer, function, "layer");
    const Parameter& p = capi::parameter_at(*l, index, function);
    capi::copy_string(p.name, name, capacity, length);
    if (master != nullptr) *master = capi::new_tensor_handle(l->ctx, p.master);
    if (value != nullptr) *value = capi::new_tensor_handle(l->ctx, p.value);
    if (grad != nullptr) *grad = capi::new_tensor_handle(l->ctx, p.grad);
  });
}

extern "C" sg_result sg_layer_sync_parameters(sg_layer layer) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto l = capi::handle_object(layer, function, "layer");
    for (const Parameter* p : l->layer->parameters()) sync_copy_from_master(*l->ctx, *p);
  });
}

extern "C" sg_result sg_layer_check_errors(sg_layer layer) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto l = capi::handle_object(layer, function, "layer");
    SG_CHECK_CODE(!l->ctx->tracing(), ErrorCode::kInvalidState, function,
                  ": called while a step is being captured; it reads the device's counters, so call it after a "
                  "replay (or an eager call)");
    capi::check_layer_errors(*l->ctx, *l->layer);
  });
}
