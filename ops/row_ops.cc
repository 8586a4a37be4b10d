#include "ops/row_ops.h"

#include <cstring>
#include <string>

#include "engine/error.h"
#include "kernels/elementwise.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {
namespace {

struct EmptyParams {
  TensorMeta meta;
  bool operator==(const EmptyParams&) const = default;
  std::string to_string() const { return std::string(dtype_name(meta.dtype)) + " " + meta.shape.to_string(); }
};

struct RowParams {
  std::int64_t first_row = 0;
  bool operator==(const RowParams&) const = default;
  std::string to_string() const { return "first_row=" + std::to_string(first_row); }
};

constexpr std::string_view kEmpty = "empty";
constexpr std::string_view kCopyRows = "copy_rows_";

std::vector<TensorMeta> check_empty(const OpParams& params, std::span<const TensorMeta> inputs) {
  bind_metas<NoOperands>(kEmpty, params.as<EmptyParams>(), inputs);
  const TensorMeta& meta = params.as<EmptyParams>().meta;
  for (std::int64_t d : meta.shape.dims()) SG_CHECK(d >= 0, "op empty: negative dimension in ", meta.shape);
  return {meta};
}

std::vector<TensorMeta> check_copy_rows(const OpParams& params, std::span<const TensorMeta> inputs) {
  const RowParams& p = params.as<RowParams>();
  const auto o = bind_metas<CopyOperands>(kCopyRows, p, inputs);
  const TensorMeta& dst = o.dst;
  const TensorMeta& src = o.src;
  const std::int64_t first = p.first_row;
  SG_CHECK(dst.dtype == src.dtype, "op copy_rows_: dst is ", dtype_name(dst.dtype), " but src is ",
           dtype_name(src.dtype));
  SG_CHECK(dst.shape.rank() >= 1 && dst.shape.rank() == src.shape.rank(), "op copy_rows_: dst ", dst.shape, " and src ",
           src.shape, " need the same rank (at least 1)");
  for (int d = 1; d < dst.shape.rank(); ++d) {
    SG_CHECK(dst.shape.dim(d) == src.shape.dim(d), "op copy_rows_: rows of dst ", dst.shape, " and src ", src.shape,
             " differ in width");
  }
  SG_CHECK(first >= 0 && first + src.shape.dim(0) <= dst.shape.dim(0), "op copy_rows_: rows [", first, ", ",
           first + src.shape.dim(0), ") do not fit in dst ", dst.shape);
  return {};
}

std::byte* window(const Operand& dst, std::int64_t first_row) {
  const std::int64_t row_bytes = dst.shape().dim(0) > 0 ? dst.meta->bytes() / dst.shape().dim(0) : 0;
  return dst.as<std::byte>() + first_row * row_bytes;
}

}  // namespace

const OpDef& empty_op() {
  static const OpDef op{
      .name = kEmpty,
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
      .name = kCopyRows,
      .check = check_copy_rows,
      .mutated_inputs_for = written_inputs_of<CopyOperands, RowParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const RowParams& p = params.as<RowParams>();
            const auto o = bind_args<CopyOperands>(p, a);
            const auto bytes = static_cast<std::size_t>(o.src.meta->bytes());
            kernels::launch_copy_bytes(window(o.dst, p.first_row), o.src.data, bytes, stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const RowParams& p = params.as<RowParams>();
            const auto o = bind_args<CopyOperands>(p, a);
            const auto bytes = static_cast<std::size_t>(o.src.meta->bytes());
            if (bytes > 0) std::memcpy(window(o.dst, p.first_row), o.src.data, bytes);
          },
  };
  return op;
}
SG_REGISTER_OP(copy_rows_inplace_op);

Tensor empty(Context& ctx, const TensorMeta& meta) {
  const EmptyParams params{meta};
  return ctx.call(empty_op(), params, flatten(kEmpty, params, NoOperands<Tensor>{})).front();
}

void copy_rows_(Context& ctx, const Tensor& dst, const Tensor& src, std::int64_t first_row) {
  const RowParams params{first_row};
  ctx.call(copy_rows_inplace_op(), params,
           flatten(kCopyRows, params, CopyOperands<Tensor>{.dst = dst, .src = src}));
}

}  // namespace stepgraph::ops
