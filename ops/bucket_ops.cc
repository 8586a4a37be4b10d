#include "ops/bucket_ops.h"

#include <cstring>
#include <string>

#include "engine/error.h"
#include "kernels/elementwise.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {
namespace {

struct PackParams {
  std::int64_t padded_numel = 0;
  bool operator==(const PackParams&) const = default;
  std::string to_string() const { return "padded=" + std::to_string(padded_numel); }
};

template <typename F>
struct UnpackOperands {
  F packed;
  std::vector<F> targets;  // written, in order
};

template <typename F, typename V>
void visit_operands(const NoParams&, UnpackOperands<F>& o, V& v) {
  v({"packed"}, o.packed);
  v.list("targets", o.targets, kRestOfInputs);
  for (std::size_t i = 0; i < o.targets.size(); ++i) {
    v({.name = "targets", .index = static_cast<std::int64_t>(i), .use = Use::kWrite}, o.targets[i]);
  }
}

constexpr std::string_view kPack = "pack";
constexpr std::string_view kUnpack = "unpack_";

template <typename F>
std::int64_t total_numel(const std::vector<F>& tensors) {
  std::int64_t total = 0;
  for (const F& t : tensors) total += meta_of(t).numel();
  return total;
}

void check_one_dtype(std::string_view op, const std::vector<TensorMeta>& metas) {
  SG_CHECK(!metas.empty(), "op ", op, " needs at least one tensor");
  for (std::size_t i = 1; i < metas.size(); ++i) {
    SG_CHECK(metas[i].dtype == metas[0].dtype, "op ", op, ": tensor ", i, " is ", dtype_name(metas[i].dtype),
             " but tensor 0 is ", dtype_name(metas[0].dtype), "; a bucket holds one dtype");
  }
}

// Copies between the flat bytes and the tensors, in order: a callback per range.
template <typename Copy>
void for_each_range(const std::vector<Operand>& tensors, std::size_t element, const Copy& copy) {
  std::size_t offset = 0;
  for (const Operand& t : tensors) {
    const auto bytes = static_cast<std::size_t>(t.numel()) * element;
    copy(t, offset, bytes);
    offset += bytes;
  }
}

void pack_run(const KernelArgs& a, CUstream_st* stream) {
  const auto o = bind_args<ReadList>(PackParams{}, a);
  const std::size_t element = dtype_size(o.tensors.at(0).dtype());
  auto* flat = static_cast<std::byte*>(a.outputs[0]);
  const auto used = static_cast<std::size_t>(total_numel(o.tensors)) * element;
  const auto length = static_cast<std::size_t>(a.output_metas[0].numel()) * element;
  for_each_range(o.tensors, element, [&](const Operand& t, std::size_t offset, std::size_t bytes) {
    if (stream != nullptr) {
      kernels::launch_copy_bytes(flat + offset, t.data, bytes, stream);
    } else if (bytes > 0) {
      std::memcpy(flat + offset, t.data, bytes);
    }
  });
  if (stream != nullptr) {
    kernels::launch_zero_bytes(flat + used, length - used, stream);
  } else if (length > used) {
    std::memset(flat + used, 0, length - used);
  }
}

void unpack_run(const KernelArgs& a, CUstream_st* stream) {
  const auto o = bind_args<UnpackOperands>(NoParams{}, a);
  const std::size_t element = dtype_size(o.packed.dtype());
  const auto* flat = static_cast<const std::byte*>(o.packed.data);
  for_each_range(o.targets, element, [&](const Operand& t, std::size_t offset, std::size_t bytes) {
    if (stream != nullptr) {
      kernels::launch_copy_bytes(t.data, flat + offset, bytes, stream);
    } else if (bytes > 0) {
      std::memcpy(t.data, flat + offset, bytes);
    }
  });
}

}  // namespace

const OpDef& pack_op() {
  static const OpDef op{
      .name = kPack,
      .check =
          [](const OpParams& params, std::span<const TensorMeta> in) {
            const auto& p = params.as<PackParams>();
            const auto o = bind_metas<ReadList>(kPack, p, in);
            check_one_dtype(kPack, o.tensors);
            SG_CHECK(p.padded_numel >= total_numel(o.tensors), "op pack: padded length ", p.padded_numel,
                     " is shorter than the ", total_numel(o.tensors), " elements of its tensors");
            return std::vector<TensorMeta>{{Shape{p.padded_numel}, o.tensors[0].dtype}};
          },
      .launch_cuda = [](const OpParams&, const KernelArgs& a, CUstream_st* s) { pack_run(a, s); },
      .run_host = [](const OpParams&, const KernelArgs& a) { pack_run(a, nullptr); },
  };
  return op;
}
SG_REGISTER_OP(pack_op);

const OpDef& unpack_inplace_op() {
  static const OpDef op{
      .name = kUnpack,
      .check =
          [](const OpParams&, std::span<const TensorMeta> in) {
            const auto o = bind_metas<UnpackOperands>(kUnpack, NoParams{}, in);
            SG_CHECK(!o.targets.empty(), "op unpack_ takes the packed tensor and at least one target");
            std::vector<TensorMeta> all{o.packed};
            all.insert(all.end(), o.targets.begin(), o.targets.end());
            check_one_dtype(kUnpack, all);
            SG_CHECK(o.packed.numel() >= total_numel(o.targets), "op unpack_: the packed tensor holds ",
                     o.packed.numel(), " elements, its targets ", total_numel(o.targets));
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = written_inputs_of<UnpackOperands, NoParams>,
      .launch_cuda = [](const OpParams&, const KernelArgs& a, CUstream_st* s) { unpack_run(a, s); },
      .run_host = [](const OpParams&, const KernelArgs& a) { unpack_run(a, nullptr); },
  };
  return op;
}
SG_REGISTER_OP(unpack_inplace_op);

Tensor pack(Context& ctx, const std::vector<Tensor>& tensors, std::int64_t padded_numel) {
  const PackParams params{padded_numel};
  return ctx.call(pack_op(), params, flatten(kPack, params, ReadList<Tensor>{tensors}))[0];
}

void unpack_(Context& ctx, const Tensor& packed, const std::vector<Tensor>& tensors) {
  ctx.call(unpack_inplace_op(), NoParams{},
           flatten(kUnpack, NoParams{}, UnpackOperands<Tensor>{.packed = packed, .targets = tensors}));
}

}  // namespace stepgraph::ops
