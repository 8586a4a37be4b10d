#include "engine/host_reduce.h"

#include <cstring>

#include "engine/error.h"
#include "engine/half_precision.h"

namespace stepgraph {
namespace {

template <typename T>
T combine(T a, T b, ReduceOp op) {
  return op == ReduceOp::kSum ? static_cast<T>(a + b) : (b > a ? b : a);
}

}  // namespace

void reduce_on_host(std::byte* out, const std::vector<const void*>& sources, std::int64_t first, std::int64_t count,
                    DType dtype, ReduceOp op) {
  SG_CHECK(!is_fp8(dtype), "host reduction: fp8 values cannot be reduced, got ", dtype_name(dtype));
  switch (dtype) {
    case DType::kInt32:
    case DType::kInt64: {
      for (std::int64_t i = 0; i < count; ++i) {
        if (dtype == DType::kInt32) {
          std::int32_t acc = static_cast<const std::int32_t*>(sources[0])[first + i];
          for (std::size_t r = 1; r < sources.size(); ++r) {
            acc = combine(acc, static_cast<const std::int32_t*>(sources[r])[first + i], op);
          }
          std::memcpy(out + i * 4, &acc, 4);
        } else {
          std::int64_t acc = static_cast<const std::int64_t*>(sources[0])[first + i];
          for (std::size_t r = 1; r < sources.size(); ++r) {
            acc = combine(acc, static_cast<const std::int64_t*>(sources[r])[first + i], op);
          }
          std::memcpy(out + i * 8, &acc, 8);
        }
      }
      return;
    }
    default:
      // fp32 adds in fp32; bf16 and fp16 add in fp32 and round once.
      for (std::int64_t i = 0; i < count; ++i) {
        float acc = load_as_float(dtype, sources[0], first + i);
        for (std::size_t r = 1; r < sources.size(); ++r)
          acc = combine(acc, load_as_float(dtype, sources[r], first + i), op);
        store_from_float(dtype, out, i, acc);
      }
  }
}

}  // namespace stepgraph
