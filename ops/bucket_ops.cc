#include "ops/bucket_ops.h"

#include <cstring>
#include <string>

#include "engine/error.h"
#include "kernels/elementwise.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {
namespace {

struct PackParams {
  std::int64_t padded_numel = 0;
  bool operator==(const PackParams&) const = default;
  std::string to_string() const { return "padded=" + std::to_string(padded_numel); }
};

std::int64_t total_numel(std::span<const TensorMeta> metas) {
  std::int64_t total = 0;
  for (const TensorMeta& meta : metas) total += meta.numel();
  return total;
}

void check_one_dtype(std::string_view op, std::span<const TensorMeta> metas) {
  SG_CHECK(!metas.empty(), "op ", op, " needs at least one tensor");
  for (std::size_t i = 1; i < metas.size(); ++i) {
    SG_CHECK(metas[i].dtype == metas[0].dtype, "op ", op, ": tensor ", i, " is ", dtype_name(metas[i].dtype),
             " but tensor 0 is ", dtype_name(metas[0].dtype), "; a bucket holds one dtype");
  }
}

// Copies between `flat` and the tensors, in order: a callback per range.
template <typename Copy>
void for_each_range(std::span<const TensorMeta> metas, std::size_t element, const Copy& copy) {
  std::size_t offset = 0;
  for (std::size_t i = 0; i < metas.size(); ++i) {
    const auto bytes = static_cast<std::size_t>(metas[i].numel()) * element;
    copy(i, offset, bytes);
    offset += bytes;
  }
}

void pack_run(const KernelArgs& a, CUstream_st* stream) {
  const std::size_t element = dtype_size(a.input_metas[0].dtype);
  auto* flat = static_cast<std::byte*>(a.outputs[0]);
  const auto used = static_cast<std::size_t>(total_numel(a.input_metas)) * element;
  const auto length = static_cast<std::size_t>(a.output_metas[0].numel()) * element;
  for_each_range(a.input_metas, element, [&](std::size_t i, std::size_t offset, std::size_t bytes) {
    if (stream != nullptr) {
      kernels::launch_copy_bytes(flat + offset, a.inputs[i], bytes, stream);
    } else if (bytes > 0) {
      std::memcpy(flat + offset, a.inputs[i], bytes);
    }
  });
  if (stream != nullptr) {
    kernels::launch_zero_bytes(flat + used, length - used, stream);
  } else if (length > used) {
    std::memset(flat + used, 0, length - used);
  }
}

void unpack_run(const KernelArgs& a, CUstream_st* stream) {
  const std::size_t element = dtype_size(a.input_metas[0].dtype);
  const auto* flat = static_cast<const std::byte*>(a.inputs[0]);
  const std::span<const TensorMeta> targets = a.input_metas.subspan(1);
  for_each_range(targets, element, [&](std::size_t i, std::size_t offset, std::size_t bytes) {
    if (stream != nullptr) {
      kernels::launch_copy_bytes(a.inputs[i + 1], flat + offset, bytes, stream);
    } else if (bytes > 0) {
      std::memcpy(a.inputs[i + 1], flat + offset, bytes);
    }
  });
}

std::vector<int> all_but_first(const OpParams&, std::size_t count) {
  std::vector<int> indices;
  for (std::size_t i = 1; i < count; ++i) indices.push_back(static_cast<int>(i));
  return indices;
}

}  // namespace

const OpDef& pack_op() {
  static const OpDef op{
      .name = "pack",
      .check =
          [](const OpParams& p, std::span<const TensorMeta> in) {
            check_one_dtype("pack", in);
            const std::int64_t padded = p.as<PackParams>().padded_numel;
            SG_CHECK(padded >= total_numel(in), "op pack: padded length ", padded, " is shorter than the ",
                     total_numel(in), " elements of its tensors");
            return std::vector<TensorMeta>{{Shape{padded}, in[0].dtype}};
          },
      .launch_cuda = [](const OpParams&, const KernelArgs& a, CUstream_st* s) { pack_run(a, s); },
      .run_host = [](const OpParams&, const KernelArgs& a) { pack_run(a, nullptr); },
  };
  return op;
}
SG_REGISTER_OP(pack_op);

const OpDef& unpack_inplace_op() {
  static const OpDef op{
      .name = "unpack_",
      .check =
          [](const OpParams&, std::span<const TensorMeta> in) {
            check_one_dtype("unpack_", in);
            SG_CHECK(in.size() >= 2, "op unpack_ takes the packed tensor and at least one target");
            SG_CHECK(in[0].numel() >= total_numel(in.subspan(1)), "op unpack_: the packed tensor holds ", in[0].numel(),
                     " elements, its targets ", total_numel(in.subspan(1)));
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = all_but_first,
      .launch_cuda = [](const OpParams&, const KernelArgs& a, CUstream_st* s) { unpack_run(a, s); },
      .run_host = [](const OpParams&, const KernelArgs& a) { unpack_run(a, nullptr); },
  };
  return op;
}
SG_REGISTER_OP(unpack_inplace_op);

Tensor pack(Context& ctx, const std::vector<Tensor>& tensors, std::int64_t padded_numel) {
  return ctx.call(pack_op(), PackParams{padded_numel}, tensors)[0];
}

void unpack_(Context& ctx, const Tensor& packed, const std::vector<Tensor>& tensors) {
  std::vector<Tensor> inputs{packed};
  inputs.insert(inputs.end(), tensors.begin(), tensors.end());
  ctx.call(unpack_inplace_op(), NoParams{}, std::move(inputs));
}

}  // namespace stepgraph::ops
