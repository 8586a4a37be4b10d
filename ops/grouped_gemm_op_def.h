// The op definition the grouped GEMMs share, 16-bit (grouped_gemm_ops.cc) and
// FP8 (grouped_fp8_ops.cc). Each of those files gives, for each of its
// operand structs (Note [Named operands] in ops/operands.h):
//
//   GroupedGemmDesc describe_call(const GroupedGemmParams&, const Operands<F>&);
//       // its shape checks, then the kernel's description of the call
//   GroupedGemmOperands pointers_of(const Operands<Operand>&, const KernelArgs&);
//
// in its own anonymous namespace, where argument-dependent lookup finds them;
// the check, the launcher, the host reference and the OpDef around them are
// written once, here.
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "engine/op.h"
#include "kernels/grouped_gemm.h"
#include "ops/operands.h"

namespace stepgraph::ops::grouped_gemm_op {

template <typename Params, template <typename> class Operands, const std::string_view& kName>
std::vector<TensorMeta> check(const OpParams& params, std::span<const TensorMeta> inputs) {
  const Params& p = params.as<Params>();
  const kernels::GroupedGemmDesc d = describe_call(p, bind_metas<Operands>(kName, p, inputs));
  switch (d.kind) {
    case kernels::GroupedGemmKind::kForward: return {{Shape{d.tokens, d.n}, d.out_type}};
    case kernels::GroupedGemmKind::kDgrad: return {{Shape{d.tokens, d.k}, d.out_type}};
    case kernels::GroupedGemmKind::kWgrad: return {};  // written into dw
  }
  return {};
}

template <typename Params, template <typename> class Operands>
void launch(const OpParams& params, const KernelArgs& args, CUstream_st* stream) {
  const Params& p = params.as<Params>();
  const auto o = bind_args<Operands>(p, args);
  kernels::launch_grouped_gemm(describe_call(p, o), pointers_of(o, args), stream);
}

template <typename Params, template <typename> class Operands>
void run_host(const OpParams& params, const KernelArgs& args) {
  const Params& p = params.as<Params>();
  const auto o = bind_args<Operands>(p, args);
  kernels::host::grouped_gemm(describe_call(p, o), pointers_of(o, args));
}

// The op named kName over Operands, with the grouped GEMMs' params
// (GroupedGemmParams); the inputs it writes in place (wgrad's dw) come from
// the operands' uses.
template <typename Params, template <typename> class Operands, const std::string_view& kName>
OpDef define() {
  return {
      .name = kName,
      .check = check<Params, Operands, kName>,
      .mutated_inputs_for = written_inputs_of<Operands, Params>,
      .launch_cuda = launch<Params, Operands>,
      .run_host = run_host<Params, Operands>,
  };
}

}  // namespace stepgraph::ops::grouped_gemm_op
