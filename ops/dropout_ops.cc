#include "ops/dropout_ops.h"

#include <cstdio>

#include "engine/error.h"
#include "kernels/dropout.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {
namespace {

const TensorMeta kState{Shape{2}, DType::kInt64};

struct AdvanceParams {
  std::int64_t draws = 0;
  bool operator==(const AdvanceParams&) const = default;
  std::string to_string() const { return std::to_string(draws) + " draws"; }
};

kernels::DropoutDesc desc_of(const DropoutParams& p, const TensorMeta& x) {
  return {.count = x.numel(), .p = p.p, .dtype = x.dtype, .offset = p.offset};
}

template <typename F>
struct DropoutOperands {
  F x;
  F state;  // int64 [2] {seed, counter}
};

template <typename F, typename V>
void visit_operands(const DropoutParams&, DropoutOperands<F>& o, V& v) {
  v({"x"}, o.x);
  v({"state"}, o.state);
}

template <typename F>
struct AdvanceOperands {
  F state;  // int64 [2], written
};

template <typename F, typename V>
void visit_operands(const AdvanceParams&, AdvanceOperands<F>& o, V& v) {
  v({.name = "state", .use = Use::kWrite}, o.state);
}

constexpr std::string_view kDropout = "dropout";
constexpr std::string_view kAdvance = "rng_advance_";

}  // namespace

std::string DropoutParams::to_string() const {
  char text[64];
  std::snprintf(text, sizeof(text), "p=%g, offset=%lld", static_cast<double>(p), static_cast<long long>(offset));
  return text;
}

const OpDef& dropout_op() {
  static const OpDef op{
      .name = kDropout,
      .check =
          [](const OpParams& params, std::span<const TensorMeta> inputs) {
            const auto& p = params.as<DropoutParams>();
            const auto o = bind_metas<DropoutOperands>(kDropout, p, inputs);
            SG_CHECK(o.state == kState, "op dropout: the state must be int64 [2] {seed, counter}, got ", o.state.shape,
                     " ", dtype_name(o.state.dtype));
            kernels::check_dropout(desc_of(p, o.x));
            return std::vector<TensorMeta>{o.x};
          },
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const auto& p = params.as<DropoutParams>();
            const auto o = bind_args<DropoutOperands>(p, a);
            kernels::launch_dropout(desc_of(p, *o.x.meta), o.x.data, a.outputs[0], o.state.as<const std::int64_t>(),
                                    stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<DropoutParams>();
            const auto o = bind_args<DropoutOperands>(p, a);
            kernels::host::dropout(desc_of(p, *o.x.meta), o.x.data, a.outputs[0], o.state.as<const std::int64_t>());
          },
  };
  return op;
}
SG_REGISTER_OP(dropout_op);

const OpDef& rng_advance_op() {
  static const OpDef op{
      .name = kAdvance,
      .check =
          [](const OpParams& params, std::span<const TensorMeta> inputs) {
            const auto& p = params.as<AdvanceParams>();
            SG_CHECK(bind_metas<AdvanceOperands>(kAdvance, p, inputs).state == kState,
                     "op rng_advance_ takes the state, int64 [2]");
            SG_CHECK(p.draws >= 0, "op rng_advance_: draws must be >= 0");
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = written_inputs_of<AdvanceOperands, AdvanceParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const auto& p = params.as<AdvanceParams>();
            kernels::launch_rng_advance(bind_args<AdvanceOperands>(p, a).state.as<std::int64_t>(), p.draws, stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<AdvanceParams>();
            kernels::host::rng_advance(bind_args<AdvanceOperands>(p, a).state.as<std::int64_t>(), p.draws);
          },
  };
  return op;
}
SG_REGISTER_OP(rng_advance_op);

Tensor dropout(Context& ctx, const Tensor& x, const Tensor& state, const DropoutParams& params) {
  return ctx.call(dropout_op(), params, flatten(kDropout, params, DropoutOperands<Tensor>{.x = x, .state = state}))
      .at(0);
}

void rng_advance_(Context& ctx, const Tensor& state, std::int64_t draws) {
  const AdvanceParams params{draws};
  ctx.call(rng_advance_op(), params, flatten(kAdvance, params, AdvanceOperands<Tensor>{state}));
}

}  // namespace stepgraph::ops
