// One MoE MLP layer's training step (forward + backward) three ways, on the
// same parameters and inputs:
//   graphed        MoEMLP captured once (CapturedStep), replayed: the splits
//                  stay on the device, grouped GEMMs read the offsets;
//   eager_device   the same MoEMLP run eagerly (every kernel launched from the
//                  host, splits still on the device);
//   eager_host_splits  the usual eager MoE: the same routing ops, then the
//                  split sizes copied to the host (a device sync every step)
//                  and one cuBLASLt GEMM per expert and product (fc1, fc2
//                  forward; their dgrad and wgrad with the bias gradient
//                  fused), on row ranges the host computes.
// Median step time with min and max (device events around each step), the
// speedup of graphed over eager_host_splits, and the relative difference of
// the two's outputs (a check that they compute the same layer).
//
//   moe_layer_bench --tokens 8192 --hidden 2048 --ffn 1536 --experts 8,64 --topk 2 --out moe_layer.json
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "engine/context.h"
#include "engine/cuda_check.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "layers/moe_mlp.h"
#include "ops/activation_ops.h"
#include "ops/elementwise_ops.h"
#include "ops/gemm_ops.h"
#include "ops/moe_ops.h"
#include "ops/norm_ops.h"
#include "graphs/captured_step.h"
#include "kernels/gemm.h"

namespace stepgraph {
namespace {

using kernels::GemmDesc;
using kernels::GemmEpilogue;
using kernels::GemmOperands;

constexpr DType kBf16 = DType::kBFloat16;

struct Shape3 {
  std::int64_t tokens, hidden, ffn, experts;
  int topk;
  std::int64_t rows() const { return tokens * topk; }
};

const std::uint8_t* at(const Tensor& t, std::int64_t element_offset) {
  return static_cast<const std::uint8_t*>(t.data()) + element_offset * dtype_size(t.dtype());
}
std::uint8_t* at_mut(const Tensor& t, std::int64_t element_offset) {
  return static_cast<std::uint8_t*>(t.data()) + element_offset * dtype_size(t.dtype());
}

// The eager MoE with host-read splits, on the layer's own parameters (in
// MoEMLP::parameters() order: gamma, beta, router, fc1 w, fc1 b, fc2 w, fc2 b).
// Per-expert outputs and gradients live in buffers made once.
class HostSplitMoE {
 public:
  HostSplitMoE(Context& ctx, MoEMLP& layer, const Shape3& s) : ctx_(ctx), s_(s), p_(layer.parameters()) {
    const std::int64_t R = s.rows(), H = s.hidden, F = s.ffn, E = s.experts;
    pre_ = ctx.persistent("eager.pre", {Shape{R, F}, kBf16});
    out_ = ctx.persistent("eager.out", {Shape{R, H}, kBf16});
    d_act_ = ctx.persistent("eager.d_act", {Shape{R, F}, kBf16});
    d_x_perm_ = ctx.persistent("eager.d_x_perm", {Shape{R, H}, kBf16});
    dw1_ = ctx.persistent("eager.dw1", {Shape{E, F, H}, DType::kFloat32});
    db1_ = ctx.persistent("eager.db1", {Shape{E, F}, DType::kFloat32});
    dw2_ = ctx.persistent("eager.dw2", {Shape{E, H, F}, DType::kFloat32});
    db2_ = ctx.persistent("eager.db2", {Shape{E, H}, DType::kFloat32});
    d_router_ = ctx.persistent("eager.d_router", {Shape{E, H}, DType::kFloat32});
    error_word_ = ctx.persistent("eager.routing_error", {Shape{1}, DType::kInt32});
    workspace_ =
        ctx.persistent("eager.gemm_workspace",
                       {Shape{static_cast<std::int64_t>(kernels::gemm_workspace_bytes() / 4)}, DType::kFloat32});
  }

  // One step; returns {y, dx}.
  std::vector<Tensor> operator()(const Tensor& x, const Tensor& dy) {
    const ops::NormParams norm{kernels::NormKind::kLayerNorm, 1e-5f};
    const ops::NormForward normed = ops::norm_forward(ctx_, norm, x, p_[0]->value, p_[1]->value);
    const Tensor logits = ops::gemm(ctx_, normed.y, p_[2]->value, {.trans_b = true, .out_dtype = kBf16}).d;
    const ops::RouterResult routed = ops::router_topk(ctx_, logits, s_.topk);
    const ops::MoEPlan plan = ops::moe_plan(ctx_, routed.experts, error_word_, s_.experts);
    splits_ = ctx_.to_vector<std::int32_t>(plan.splits);  // the host read: waits for the device
    const Tensor x_perm = ops::moe_permute(ctx_, normed.y, plan.sources);

    const std::int64_t H = s_.hidden, F = s_.ffn;
    for_each_expert([&](std::int64_t e, std::int64_t first, std::int64_t n) {  // fc1 (+bias)
      gemm({.m = n, .n = F, .k = H, .trans_b = true, .epilogue = GemmEpilogue::kBias},
           {.a = at(x_perm, first * H),
            .b = at(p_[3]->value, e * F * H),
            .d = at_mut(pre_, first * F),
            .bias = at(p_[4]->value, e * F)});
    });
    const Tensor act = ops::gelu(ctx_, pre_);
    for_each_expert([&](std::int64_t e, std::int64_t first, std::int64_t n) {  // fc2 (+bias)
      gemm({.m = n, .n = H, .k = F, .trans_b = true, .epilogue = GemmEpilogue::kBias},
           {.a = at(act, first * F),
            .b = at(p_[5]->value, e * H * F),
            .d = at_mut(out_, first * H),
            .bias = at(p_[6]->value, e * H)});
    });
    const Tensor y = ops::moe_unpermute(ctx_, out_, plan.positions, routed.gates);

    const ops::UnpermuteGrads unpermuted = ops::moe_unpermute_backward(ctx_, dy, out_, plan.positions, routed.gates);
    for_each_expert([&](std::int64_t e, std::int64_t first, std::int64_t n) {  // fc2 wgrad (+bias grad), dgrad
      gemm({.m = H, .n = F, .k = n, .trans_a = true, .d_type = DType::kFloat32, .epilogue = GemmEpilogue::kBiasGradOfA},
           {.a = at(unpermuted.dy_perm, first * H),
            .b = at(act, first * F),
            .d = at_mut(dw2_, e * H * F),
            .bias_grad = at_mut(db2_, e * H)});
      gemm({.m = n, .n = F, .k = H},
           {.a = at(unpermuted.dy_perm, first * H), .b = at(p_[5]->value, e * H * F), .d = at_mut(d_act_, first * F)});
    });
    const Tensor d_pre = ops::gelu_backward(ctx_, d_act_, pre_);
    for_each_expert([&](std::int64_t e, std::int64_t first, std::int64_t n) {  // fc1 wgrad (+bias grad), dgrad
      gemm({.m = F, .n = H, .k = n, .trans_a = true, .d_type = DType::kFloat32, .epilogue = GemmEpilogue::kBiasGradOfA},
           {.a = at(d_pre, first * F),
            .b = at(x_perm, first * H),
            .d = at_mut(dw1_, e * F * H),
            .bias_grad = at_mut(db1_, e * F)});
      gemm({.m = n, .n = H, .k = F},
           {.a = at(d_pre, first * F), .b = at(p_[3]->value, e * F * H), .d = at_mut(d_x_perm_, first * H)});
    });
    const Tensor d_normed_experts = ops::moe_unpermute(ctx_, d_x_perm_, plan.positions);
    const Tensor d_logits = ops::router_topk_backward(ctx_, unpermuted.dgates, logits, routed);
    ops::gemm_into_(ctx_, d_router_, d_logits, normed.y, {.trans_a = true, .out_dtype = DType::kFloat32});
    const Tensor d_normed_router = ops::gemm(ctx_, d_logits, p_[2]->value, {.out_dtype = kBf16}).d;
    const Tensor d_normed = ops::residual_add(ctx_, d_normed_experts, d_normed_router);
    const ops::NormBackward dx = ops::norm_backward(ctx_, norm, d_normed, x, normed.mean, normed.rstd, p_[0]->value);
    return {y, dx.dx};
  }

 private:
  template <typename F>
  void for_each_expert(F&& f) {
    std::int64_t first = 0;
    for (std::int64_t e = 0; e < s_.experts; ++e) {
      const std::int64_t n = splits_[e];
      if (n > 0) f(e, first, n);
      first += n;
    }
  }

  void gemm(GemmDesc desc, GemmOperands operands) {
    desc.a_type = kBf16;
    desc.b_type = kBf16;
    if (desc.d_type != DType::kFloat32) desc.d_type = kBf16;
    operands.workspace = workspace_.data();
    kernels::launch_gemm(desc, operands, ctx_.cuda_stream(0));
  }

  Context& ctx_;
  Shape3 s_;
  std::vector<Parameter*> p_;
  std::vector<std::int32_t> splits_;
  Tensor pre_, out_, d_act_, d_x_perm_, dw1_, db1_, dw2_, db2_, d_router_, error_word_, workspace_;
};

std::vector<float> floats_of(Context& ctx, const Tensor& t) {
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(t.bytes()));
  ctx.copy_to_host(t, bytes.data(), bytes.size());
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) out[i] = load_as_float(t.dtype(), bytes.data(), i);
  return out;
}

double rms(const std::vector<float>& a) {
  double sum = 0;
  for (const float v : a) sum += static_cast<double>(v) * v;
  return std::sqrt(sum / std::max<double>(1.0, static_cast<double>(a.size())));
}

double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

nlohmann::json run_config(const Shape3& s, int warmup, int repeats) {
  Context ctx(Device::kCuda);
  MoEMLP layer(ctx, "moe", {.hidden = s.hidden, .ffn = s.ffn, .experts = s.experts, .topk = s.topk, .dtype = kBf16},
               17);
  const Tensor x = ctx.persistent("x", {Shape{s.tokens, s.hidden}, kBf16});
  const Tensor dy = ctx.persistent("dy", {Shape{s.tokens, s.hidden}, kBf16});
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (const Tensor& t : {x, dy}) {
    std::vector<std::uint16_t> values(static_cast<std::size_t>(t.numel()));
    for (auto& v : values) v = float_to_bf16(uniform(rng));
    ctx.copy_from_host(t, values.data(), values.size() * sizeof(std::uint16_t));
  }
  auto step = [&] {
    const MoEMLP::Forward f = layer.forward(ctx, {x});
    return std::vector<Tensor>{f.y, layer.backward(ctx, f.saved, {dy})};
  };
  auto captured = CapturedStep::capture(ctx, step, {.pool_report_policy = PoolReportPolicy::kError});
  HostSplitMoE host_splits(ctx, layer, s);
  cudaStream_t stream = ctx.cuda_stream(0);

  const bench::Summary graphed = bench::time_launches(stream, warmup, repeats, [&] { captured->replay(); });
  const bench::Summary eager_device = bench::time_launches(stream, warmup, repeats, [&] { step(); });
  const bench::Summary eager_host = bench::time_launches(stream, warmup, repeats, [&] { host_splits(x, dy); });
  layer.check_errors(ctx);

  captured->replay();
  const std::vector<float> graph_y = floats_of(ctx, captured->outputs()[0]);
  const std::vector<float> graph_dx = floats_of(ctx, captured->outputs()[1]);
  const std::vector<Tensor> eager_out = host_splits(x, dy);
  const std::vector<float> eager_y = floats_of(ctx, eager_out[0]);
  const std::vector<float> eager_dx = floats_of(ctx, eager_out[1]);
  const double y_diff = relative_difference(eager_y, graph_y);
  const double dx_diff = relative_difference(eager_dx, graph_dx);
  // The difference means something only on outputs that are not zero.
  SG_CHECK(rms(graph_y) > 0 && rms(graph_dx) > 0 && rms(eager_y) > 0 && rms(eager_dx) > 0,
           "moe_layer_bench: an output is all zeros (rms y ", rms(graph_y), ", dx ", rms(graph_dx), ")");

  // GEMM work of the step: fc1, fc2 forward; their dgrad and wgrad (2 flops per MAC).
  const double flops = 2.0 * 3.0 * 2.0 * static_cast<double>(s.rows()) * s.hidden * s.ffn;
  auto print = [&](const char* name, const bench::Summary& t) {
    std::cout << "  " << name << ": median " << t.median_us << " us (min " << t.min_us << ", max " << t.max_us << "), "
              << flops / (t.median_us * 1e-6) / 1e12 << " TFLOP/s (expert GEMMs)\n";
  };
  std::cout << "tokens " << s.tokens << ", hidden " << s.hidden << ", ffn " << s.ffn << ", experts " << s.experts
            << ", top-" << s.topk << " (fwd+bwd, bf16):\n";
  print("graphed (device splits)", graphed);
  print("eager (device splits)", eager_device);
  print("eager (host-read splits, per-expert cuBLASLt)", eager_host);
  std::cout << "  graphed / eager host-split speedup: " << eager_host.median_us / graphed.median_us
            << "x; output difference y " << y_diff << ", dx " << dx_diff << " (rms y " << rms(graph_y) << ", dx "
            << rms(graph_dx) << ")\n";
  return {{"tokens", s.tokens},
          {"hidden", s.hidden},
          {"ffn", s.ffn},
          {"experts", s.experts},
          {"topk", s.topk},
          {"expert_gemm_flops", flops},
          {"graphed", bench::to_json(graphed)},
          {"eager_device_splits", bench::to_json(eager_device)},
          {"eager_host_splits", bench::to_json(eager_host)},
          {"speedup_graphed_over_eager_host_splits", eager_host.median_us / graphed.median_us},
          {"rms_y", rms(graph_y)},
          {"rms_dx", rms(graph_dx)},
          {"relative_difference_y", y_diff},
          {"relative_difference_dx", dx_diff}};
}

int run(const Shape3& base, const std::vector<std::int64_t>& experts, int warmup, int repeats,
        const std::string& out_path) {
  const DeviceProperties device = device_properties(0);
  std::cout << "device: " << describe(device) << "\n";
  nlohmann::json rows = nlohmann::json::array();
  for (const std::int64_t e : experts) {
    Shape3 s = base;
    s.experts = e;
    rows.push_back(run_config(s, warmup, repeats));
  }
  bench::write_json(
      out_path,
      {{"benchmark", "moe_layer"}, {"device", device.name}, {"warmup", warmup}, {"repeats", repeats}, {"rows", rows}});
  return EXIT_SUCCESS;
}

}  // namespace
}  // namespace stepgraph

int main(int argc, char** argv) {
  CLI::App app{"MoE layer step: graphed with device splits vs eager with host-read splits and per-expert GEMMs"};
  stepgraph::Shape3 shape{8192, 2048, 1536, 8, 2};
  std::vector<std::int64_t> experts = {8, 64};
  int warmup = 5;
  int repeats = 30;
  std::string out;
  app.add_option("--tokens", shape.tokens, "tokens per step")->check(CLI::PositiveNumber);
  app.add_option("--hidden", shape.hidden, "hidden size")->check(CLI::PositiveNumber);
  app.add_option("--ffn", shape.ffn, "per-expert ffn size")->check(CLI::PositiveNumber);
  app.add_option("--experts", experts, "expert counts, one row each (e.g. 8,64)")->delimiter(',');
  app.add_option("--topk", shape.topk, "experts per token (1 or 2)")->check(CLI::Range(1, 2));
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--repeats", repeats, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--out", out, "JSON result file");
  CLI11_PARSE(app, argc, argv);
  return stepgraph::bench::run_main("moe_layer_bench",
                                    [&] { return stepgraph::run(shape, experts, warmup, repeats, out); });
}
