#include "ops/row_ops.h"

#include <cstring>
#include <string>

#include "engine/error.h"
#include "kernels/elementwise.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {
namespace {

struct EmptyParams {
  TensorMeta meta;
  bool operator==(const EmptyParams&) const = default;
  std::string to_string() const {
    return std::string(dtype_name(meta.dtype)) + " " + meta.shape.to_string();
  }
};

struct RowParams {
  std::int64_t first_row = 0;
  bool operator==(const RowParams&) const = default;
  std::string to_string() const { return "first_row=" + std::to_string(first_row); }
};

std::vector<TensorMeta> check_empty(const OpParams& params, std::span<const TensorMeta> inputs) {
  SG_CHECK(inputs.empty(), "op empty takes no inputs, got ", inputs.size());
  const TensorMeta& meta = params.as<EmptyParams>().meta;
  for (std::int64_t d : meta.shape.dims()) SG_CHECK(d >= 0, "op empty: negative dimension in ", meta.shape);
  return {meta};
}

std::vector<TensorMeta> check_copy_rows(const OpParams& params, std::span<const TensorMeta> inputs) {
  SG_CHECK(inputs.size() == 2, "op copy_rows_ takes dst and src, got ", inputs.size(), " inputs");
  const TensorMeta& dst = inputs[0];
  const TensorMeta& src = inputs[1];
  const std::int64_t first = params.as<RowParams>().first_row;
  SG_CHECK(dst.dtype == src.dtype, "op copy_rows_: dst is ", dtype_name(dst.dtype), " but src is ",
           dtype_name(src.dtype));
  SG_CHECK(dst.shape.rank() >= 1 && dst.shape.rank() == src.shape.rank(), "op copy_rows_: dst ", dst.shape,
           " and src ", src.shape, " need the same rank (at least 1)");
  for (int d = 1; d < dst.shape.rank(); ++d) {
    SG_CHECK(dst.shape.dim(d) == src.shape.dim(d), "op copy_rows_: rows of dst ", dst.shape, " and src ", src.shape,
             " differ in width");
  }
  SG_CHECK(first >= 0 && first + src.shape.dim(0) <= dst.shape.dim(0), "op copy_rows_: rows [", first, ", ",
           first + src.shape.dim(0), ") do not fit in dst ", dst.shape);
  return {};
}

std::byte* window(const KernelArgs& a, std::int64_t first_row) {
  const TensorMeta& dst = a.input_metas[0];
  const std::int64_t row_bytes = dst.shape.dim(0) > 0 ? dst.bytes() / dst.shape.dim(0) : 0;
  return static_cast<std::byte*>(a.inputs[0]) + first_row * row_bytes;
}

}  // namespace

const OpDef& empty_op() {
  static const OpDef op{
      .name = "empty",
      .check = check_empty,
      // Memory only: the planner gives the value its place, no work runs.
      .launch_cuda = [](const OpParams&, const KernelArgs&, CUstream_st*) {},
      .run_host = [](const OpParams&, const KernelArgs&) {},
  };
  return op;
}
SG_REGISTER_OP(empty_op);

const OpDef& copy_rows_inplace_op() {
  static const OpDef op{
      .name = "copy_rows_",
      .check = check_copy_rows,
      .mutated_inputs = {0},
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const auto bytes = static_cast<std::size_t>(a.input_metas[1].bytes());
            kernels::launch_copy_bytes(window(a, params.as<RowParams>().first_row), a.inputs[1], bytes, stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto bytes = static_cast<std::size_t>(a.input_metas[1].bytes());
            if (bytes > 0) std::memcpy(window(a, params.as<RowParams>().first_row), a.inputs[1], bytes);
          },
  };
  return op;
}
SG_REGISTER_OP(copy_rows_inplace_op);

Tensor empty(Context& ctx, const TensorMeta& meta) { return ctx.call(empty_op(), EmptyParams{meta}, {}).front(); }

void copy_rows_(Context& ctx, const Tensor& dst, const Tensor& src, std::int64_t first_row) {
  ctx.call(copy_rows_inplace_op(), RowParams{first_row}, {dst, src});
}

}  // namespace stepgraph::ops
