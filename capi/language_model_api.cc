// The C API's language model (layers/language_model.h): its versioned config
// and the layer handle it lives behind. A train step takes it like a
// residual stack (capi/train_api.cc).
#include <any>
#include <cstddef>
#include <memory>
#include <string_view>
#include <utility>

#include "capi/handles.h"
#include "capi/layer_configs.h"
#include "capi/versioned_config.h"
#include "layers/comm_gemm_overlap.h"
#include "layers/language_model.h"

namespace stepgraph::capi {
namespace {

// A LanguageModel behind the layer interface: parameters and errors for
// optimizers and sg_layer_*; no forward of its own, since its input is
// tokens with their packing and error flag, which a TrainStep owns.
class LanguageModelLayer final : public AnyLayer {
 public:
  LanguageModelLayer(Context& ctx, const LanguageModelConfig& config, Communicator* tensor_parallel,
                     Communicator* context_parallel)
      : model_(ctx, config, tensor_parallel, context_parallel) {}

  std::string_view kind() const override { return "language_model"; }
  std::pair<Tensor, std::any> forward(Context&, const Tensor&) override { refuse("forward"); }
  Tensor backward(Context&, const std::any&, const Tensor&) override { refuse("backward"); }
  std::vector<Parameter*> parameters() override { return model_.parameters(); }
  LanguageModel& model() { return model_; }

 private:
  [[noreturn]] static void refuse(const char* pass) {
    SG_THROW(ErrorCode::kUnsupported, "sg_layer_", pass, ": a language model's input is token ids with their "
             "packing, which its train step holds: it has no ", pass, " of its own; train it with a train step "
             "(sg_train_step_create; TrainStep in Python) and run or capture the step");
  }

  LanguageModel model_;
};

// The size of each version of sg_language_model_config (index: version).
constexpr std::size_t kConfigSizes[] = {0, offsetof(sg_language_model_config, context_parallel),
                                        sizeof(sg_language_model_config)};
static_assert(std::size(kConfigSizes) - 1 == SG_LANGUAGE_MODEL_CONFIG_VERSION,
              "a new config version needs its size here");

sg_language_model_config default_config() {
  const LanguageModelConfig d{.model = {.heads = 4}, .context = 64};
  auto c = with_header<sg_language_model_config>(SG_LANGUAGE_MODEL_CONFIG_MAGIC, SG_LANGUAGE_MODEL_CONFIG_VERSION);
  set_stack_fields(c, d.model);
  c.heads = d.model.heads;
  c.kv_heads = d.model.kv_heads;
  c.context = d.context;
  c.rope_base = d.model.rope_base;
  c.dropout = d.model.dropout;
  c.recompute_activation = d.model.recompute_activation ? 1 : 0;
  c.fp8 = 0;
  c.fp8_recipe = from_fp8_recipe(Fp8Recipe::current());
  c.fp8_weight_cache = 0;
  c.tensor_parallel = nullptr;
  c.context_parallel = nullptr;
  c.overlap = nullptr;
  return c;
}

LanguageModelConfig to_config(const sg_language_model_config& c, const char* function) {
  const ResidualStackConfig defaults;
  check_moe_fields(c.experts, c.topk, c.moe_every, function);
  SG_CHECK(c.heads != 0 || (c.kv_heads == 0 && c.rope_base == defaults.rope_base), function, ": config kv_heads (",
           c.kv_heads, ") and rope_base (", c.rope_base,
           ") apply to attention, and heads is 0 (the window model); set heads > 0, or leave them at their defaults");
  const bool fp8 = to_flag(c.fp8, function, "config fp8");
  const bool cache = to_flag(c.fp8_weight_cache, function, "config fp8_weight_cache");
  SG_CHECK(fp8 || !cache, function, ": config fp8_weight_cache applies to FP8 GEMMs, and fp8 is 0; set fp8 = 1");
  LanguageModelConfig config{.model = stack_fields(c, function), .context = c.context};
  config.model.heads = c.heads;
  config.model.kv_heads = c.kv_heads;
  config.model.rope_base = c.rope_base;
  config.model.overlap = c.overlap != nullptr ? MLPOverlap::parse(c.overlap) : MLPOverlap{};
  config.model.recompute_activation = to_flag(c.recompute_activation, function, "config recompute_activation");
  config.model.dropout = c.dropout;
  if (fp8) {
    config.model.fp8 = to_fp8_recipe(&c.fp8_recipe, function);
    config.model.fp8->cache_weights = cache;
  }
  return config;
}

}  // namespace

LanguageModel* language_model_of(AnyLayer& layer) {
  auto* adapter = dynamic_cast<LanguageModelLayer*>(&layer);
  return adapter != nullptr ? &adapter->model() : nullptr;
}

}  // namespace stepgraph::capi

using namespace stepgraph;  // NOLINT(google-build-using-namespace): the C entry points below

extern "C" void sg_language_model_config_default(sg_language_model_config* config) {
  if (config != nullptr) *config = capi::default_config();
}

extern "C" sg_result sg_language_model_create(sg_context ctx, const sg_language_model_config* config,
                                              sg_layer* out) {
  return capi::run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<Context> context = capi::context_of(ctx, function);
    capi::require(config, function, "config");
    capi::require(out, function, "out");
    *out = nullptr;
    const sg_language_model_config c =
        capi::read_versioned_config(*config, capi::default_config(), capi::kConfigSizes,
                                    SG_LANGUAGE_MODEL_CONFIG_MAGIC, function, "sg_language_model_config",
                                    "sg_language_model_config_default");
    std::shared_ptr<capi::WorldState> world;
    if (c.tensor_parallel != nullptr) {
      world = capi::handle_object(c.tensor_parallel, function, "config->tensor_parallel")->state;
    }
    SG_CHECK(c.overlap == nullptr || world != nullptr, function, ": config overlap (\"", c.overlap,
             "\") sets how tensor-parallel collectives meet their GEMMs, and tensor_parallel is NULL; pass a world "
             "or leave overlap NULL");
    Communicator* tensor_parallel = world != nullptr ? world->comm.get() : nullptr;  // null: a world of one
    std::shared_ptr<capi::WorldState> context_world;
    if (c.context_parallel != nullptr) {
      context_world = capi::handle_object(c.context_parallel, function, "config->context_parallel")->state;
    }
    Communicator* context_parallel = context_world != nullptr ? context_world->comm.get() : nullptr;
    auto layer = std::make_shared<capi::LanguageModelLayer>(*context, capi::to_config(c, function), tensor_parallel,
                                                            context_parallel);
    // The layer keeps both worlds' communicators alive.
    layer->keeps = std::make_shared<std::pair<std::shared_ptr<capi::WorldState>, std::shared_ptr<capi::WorldState>>>(
        world, context_world);
    *out = capi::issue_handle(std::make_shared<sg_layer_s>(sg_layer_s{context, std::move(layer)}));
  });
}
