// Host references of the embedding kernels (contract in embedding.h): the
// same gather, and the backward's fp32 sums in the device's order (see
// Note [Deterministic embedding backward]), so host and device agree bit for bit.
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "kernels/embedding.h"

namespace stepgraph::kernels {

void check_embedding(const EmbeddingDesc& desc) {
  SG_CHECK(desc.dtype == DType::kFloat32 || desc.dtype == DType::kBFloat16 || desc.dtype == DType::kFloat16,
           "embedding: dtype ", dtype_name(desc.dtype), " is not supported; use bf16, fp16 or fp32");
  SG_CHECK(desc.vocab > 0 && desc.dim > 0 && desc.rows > 0 && desc.width > 0,
           "embedding: vocab, dim, rows and width must be > 0, got ", desc.vocab, ", ", desc.dim, ", ", desc.rows, ", ",
           desc.width);
  constexpr std::int64_t kLimit = std::int64_t{1} << 31;
  SG_CHECK(desc.vocab < kLimit / desc.dim && desc.positions() < kLimit / desc.dim && desc.rows < kLimit / desc.width,
           "embedding: vocab * dim (", desc.vocab, " * ", desc.dim, ") and rows * width * dim (", desc.rows, " * ",
           desc.width, " * ", desc.dim, ") must stay below 2^31");
}

namespace host {
namespace {

void check_pointers(const char* op, std::initializer_list<const void*> pointers) {
  for (const void* pointer : pointers) SG_CHECK(pointer != nullptr, op, ": a pointer argument is null");
}

}  // namespace

void embedding_forward(const EmbeddingDesc& desc, const void* table, const std::int32_t* tokens, void* out,
                       std::int32_t* error_flag) {
  check_embedding(desc);
  check_pointers("host embedding_forward", {table, tokens, out, error_flag});
  const std::size_t row_bytes = static_cast<std::size_t>(desc.dim) * dtype_size(desc.dtype);
  const auto* table_bytes = static_cast<const std::uint8_t*>(table);
  auto* out_bytes = static_cast<std::uint8_t*>(out);
  for (std::int64_t p = 0; p < desc.positions(); ++p) {
    const std::int32_t token = tokens[p];
    std::uint8_t* dst = out_bytes + static_cast<std::size_t>(p) * row_bytes;
    if (token < 0 || token >= desc.vocab) {
      std::memset(dst, 0, row_bytes);
      *error_flag = 1;
      continue;
    }
    std::memcpy(dst, table_bytes + static_cast<std::size_t>(token) * row_bytes, row_bytes);
  }
}

void embedding_backward(const EmbeddingDesc& desc, const void* dout, const std::int32_t* tokens, float* dtable) {
  check_embedding(desc);
  check_pointers("host embedding_backward", {dout, tokens, dtable});
  std::memset(dtable, 0, static_cast<std::size_t>(desc.vocab * desc.dim) * sizeof(float));
  // Position by position in increasing order: every dtable element receives
  // its terms in the device's order (each add is one fp32 rounding).
  for (std::int64_t p = 0; p < desc.positions(); ++p) {
    const std::int32_t token = tokens[p];
    if (token < 0 || token >= desc.vocab) continue;
    float* row = dtable + token * desc.dim;
    for (std::int64_t d = 0; d < desc.dim; ++d) row[d] += load_as_float(desc.dtype, dout, p * desc.dim + d);
  }
}

}  // namespace host
}  // namespace stepgraph::kernels
