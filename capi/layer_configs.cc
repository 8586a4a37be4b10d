// The C API's layer configs: each one versioned (capi/versioned_config.h),
// its defaults from the engine's config, and its reading into the engine's
// config with every field checked.
#include <cstddef>
#include <iterator>
#include <optional>

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

// The size of each version of a config (index: version; 0 unused).
constexpr std::size_t kLinearSizes[] = {0, sizeof(sg_linear_config)};
constexpr std::size_t kNormSizes[] = {0, sizeof(sg_norm_config)};
constexpr std::size_t kLayerNormLinearSizes[] = {0, sizeof(sg_layernorm_linear_config)};
constexpr std::size_t kLayerNormMLPSizes[] = {0, sizeof(sg_layernorm_mlp_config)};
constexpr std::size_t kResidualStackSizes[] = {0, sizeof(sg_residual_stack_config)};
static_assert(std::size(kLinearSizes) - 1 == SG_LINEAR_CONFIG_VERSION &&
                  std::size(kNormSizes) - 1 == SG_NORM_CONFIG_VERSION &&
                  std::size(kLayerNormLinearSizes) - 1 == SG_LAYERNORM_LINEAR_CONFIG_VERSION &&
                  std::size(kLayerNormMLPSizes) - 1 == SG_LAYERNORM_MLP_CONFIG_VERSION &&
                  std::size(kResidualStackSizes) - 1 == SG_RESIDUAL_STACK_CONFIG_VERSION,
              "a new config version needs its size here");

// The recipe when `fp8` is 1, none when 0 (an error naming the field otherwise).
std::optional<Fp8Recipe> fp8_of(int fp8, const sg_fp8_recipe& recipe, const char* function) {
  return to_flag(fp8, function, "config fp8") ? to_fp8_recipe(&recipe, function) : std::nullopt;
}

}  // namespace

sg_norm_kind from_norm_kind(kernels::NormKind kind) {
  return kind == kernels::NormKind::kLayerNorm ? SG_NORM_LAYERNORM : SG_NORM_RMSNORM;
}

sg_linear_config default_linear_config() {
  const LinearConfig d;
  auto c = with_header<sg_linear_config>(SG_LINEAR_CONFIG_MAGIC, SG_LINEAR_CONFIG_VERSION);
  c.in_features = d.in_features;
  c.out_features = d.out_features;
  c.bias = d.bias ? 1 : 0;
  c.dtype = from_dtype(d.dtype);
  c.dgrad = d.dgrad ? 1 : 0;
  c.wgrad = d.wgrad ? 1 : 0;
  c.fp8_recipe = from_fp8_recipe(Fp8Recipe::current());
  return c;
}

sg_norm_config default_norm_config() {
  const NormConfig d;
  auto c = with_header<sg_norm_config>(SG_NORM_CONFIG_MAGIC, SG_NORM_CONFIG_VERSION);
  c.kind = from_norm_kind(d.kind);
  c.hidden = d.hidden;
  c.eps = d.eps;
  c.dtype = from_dtype(d.dtype);
  return c;
}

sg_layernorm_linear_config default_layernorm_linear_config() {
  const LayerNormLinearConfig d;
  const sg_linear_config linear = default_linear_config();
  auto c = with_header<sg_layernorm_linear_config>(SG_LAYERNORM_LINEAR_CONFIG_MAGIC,
                                                   SG_LAYERNORM_LINEAR_CONFIG_VERSION);
  c.norm = from_norm_kind(d.norm);
  c.eps = d.eps;
  c.in_features = d.linear.in_features;
  c.out_features = d.linear.out_features;
  c.bias = d.linear.bias ? 1 : 0;
  c.dtype = from_dtype(d.linear.dtype);
  c.dgrad = d.linear.dgrad ? 1 : 0;
  c.wgrad = d.linear.wgrad ? 1 : 0;
  c.fp8_recipe = linear.fp8_recipe;
  return c;
}

sg_layernorm_mlp_config default_layernorm_mlp_config() {
  const LayerNormMLPConfig d;
  auto c = with_header<sg_layernorm_mlp_config>(SG_LAYERNORM_MLP_CONFIG_MAGIC, SG_LAYERNORM_MLP_CONFIG_VERSION);
  c.hidden = d.hidden;
  c.ffn = d.ffn;
  c.norm = from_norm_kind(d.norm);
  c.eps = d.eps;
  c.dtype = from_dtype(d.dtype);
  c.fp8_recipe = from_fp8_recipe(Fp8Recipe::current());
  return c;
}

sg_residual_stack_config default_residual_stack_config() {
  const ResidualStackConfig d;
  auto c = with_header<sg_residual_stack_config>(SG_RESIDUAL_STACK_CONFIG_MAGIC, SG_RESIDUAL_STACK_CONFIG_VERSION);
  set_stack_fields(c, d);
  return c;
}

LinearConfig read_linear_config(const sg_linear_config& config, const char* function) {
  const sg_linear_config c = read_versioned_config(config, default_linear_config(), kLinearSizes,
                                                   SG_LINEAR_CONFIG_MAGIC, function, "sg_linear_config",
                                                   "sg_linear_config_default");
  return {.in_features = c.in_features,
          .out_features = c.out_features,
          .bias = to_flag(c.bias, function, "config bias"),
          .dtype = to_dtype(c.dtype),
          .dgrad = to_flag(c.dgrad, function, "config dgrad"),
          .wgrad = to_flag(c.wgrad, function, "config wgrad"),
          .fp8 = fp8_of(c.fp8, c.fp8_recipe, function)};
}

NormConfig read_norm_config(const sg_norm_config& config, const char* function) {
  const sg_norm_config c = read_versioned_config(config, default_norm_config(), kNormSizes, SG_NORM_CONFIG_MAGIC,
                                                 function, "sg_norm_config", "sg_norm_config_default");
  return {to_norm_kind(c.kind), c.hidden, checked_eps(c.eps, function, "config eps"), to_dtype(c.dtype)};
}

LayerNormLinearConfig read_layernorm_linear_config(const sg_layernorm_linear_config& config, const char* function) {
  const sg_layernorm_linear_config c =
      read_versioned_config(config, default_layernorm_linear_config(), kLayerNormLinearSizes,
                            SG_LAYERNORM_LINEAR_CONFIG_MAGIC, function, "sg_layernorm_linear_config",
                            "sg_layernorm_linear_config_default");
  return {to_norm_kind(c.norm), checked_eps(c.eps, function, "config eps"),
          LinearConfig{.in_features = c.in_features,
                       .out_features = c.out_features,
                       .bias = to_flag(c.bias, function, "config bias"),
                       .dtype = to_dtype(c.dtype),
                       .dgrad = to_flag(c.dgrad, function, "config dgrad"),
                       .wgrad = to_flag(c.wgrad, function, "config wgrad"),
                       .fp8 = fp8_of(c.fp8, c.fp8_recipe, function)}};
}

LayerNormMLPConfig read_layernorm_mlp_config(const sg_layernorm_mlp_config& config, const char* function) {
  const sg_layernorm_mlp_config c =
      read_versioned_config(config, default_layernorm_mlp_config(), kLayerNormMLPSizes, SG_LAYERNORM_MLP_CONFIG_MAGIC,
                            function, "sg_layernorm_mlp_config", "sg_layernorm_mlp_config_default");
  LayerNormMLPConfig out{c.hidden, c.ffn, to_norm_kind(c.norm), checked_eps(c.eps, function, "config eps"),
                         to_dtype(c.dtype)};
  out.fp8 = fp8_of(c.fp8, c.fp8_recipe, function);
  return out;
}

sg_residual_stack_config read_residual_stack_config(const sg_residual_stack_config& config, const char* function) {
  const sg_residual_stack_config c =
      read_versioned_config(config, default_residual_stack_config(), kResidualStackSizes,
                            SG_RESIDUAL_STACK_CONFIG_MAGIC, function, "sg_residual_stack_config",
                            "sg_residual_stack_config_default");
  check_moe_fields(c.experts, c.topk, c.moe_every, function);
  SG_CHECK(c.overlap == nullptr || c.tensor_parallel != nullptr, function, ": config overlap (\"", c.overlap,
           "\") sets how tensor-parallel collectives meet their GEMMs, and tensor_parallel is NULL; pass a world "
           "or leave overlap NULL");
  return c;
}

ResidualStackConfig to_residual_stack_config(const sg_residual_stack_config& c, const char* function) {
  ResidualStackConfig config = stack_fields(c, function);
  config.overlap = c.overlap != nullptr ? MLPOverlap::parse(c.overlap) : MLPOverlap{};
  return config;
}

}  // namespace stepgraph::capi

using namespace stepgraph;  // NOLINT(google-build-using-namespace): the C entry points below

extern "C" void sg_linear_config_default(sg_linear_config* config) {
  if (config != nullptr) *config = capi::default_linear_config();
}

extern "C" void sg_norm_config_default(sg_norm_config* config) {
  if (config != nullptr) *config = capi::default_norm_config();
}

extern "C" void sg_layernorm_linear_config_default(sg_layernorm_linear_config* config) {
  if (config != nullptr) *config = capi::default_layernorm_linear_config();
}

extern "C" void sg_layernorm_mlp_config_default(sg_layernorm_mlp_config* config) {
  if (config != nullptr) *config = capi::default_layernorm_mlp_config();
}

extern "C" void sg_residual_stack_config_default(sg_residual_stack_config* config) {
  if (config != nullptr) *config = capi::default_residual_stack_config();
}
