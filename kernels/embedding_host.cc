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
  SG_CHECK(desc.full_vocab >= 0 && desc.full_vocab < kLimit && desc.vocab_offset >= 0 &&
               desc.vocab_offset + desc.vocab <= desc.valid_ids(),
           "embedding: the table's ids [", desc.vocab_offset, ", ", desc.vocab_offset + desc.vocab,
           ") must lie inside the vocabulary [0, ", desc.valid_ids(),
           ") (full_vocab below 2^31; 0 means the table is the whole vocabulary)");
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
  // Note [Vocabulary slice of an embedding]: -0.0 where another slice owns
  // the token, +0.0 (the first slice) or -0.0 where none does.
  const bool first_slice = desc.vocab_offset == 0;
  for (std::int64_t p = 0; p < desc.positions(); ++p) {
    const std::int64_t token = tokens[p];
    const std::int64_t row = token - desc.vocab_offset;
    std::uint8_t* dst = out_bytes + static_cast<std::size_t>(p) * row_bytes;
    if (row >= 0 && row < desc.vocab) {
      std::memcpy(dst, table_bytes + static_cast<std::size_t>(row) * row_bytes, row_bytes);
      continue;
    }
    const bool outside = token < 0 || token >= desc.valid_ids();
    if (outside) *error_flag = 1;
    if (outside && first_slice) {
      std::memset(dst, 0, row_bytes);
    } else {
      for (std::int64_t d = 0; d < desc.dim; ++d) store_from_float(desc.dtype, dst, d, -0.0f);
    }
  }
}

void embedding_backward(const EmbeddingDesc& desc, const void* dout, const std::int32_t* tokens, float* dtable) {
  check_embedding(desc);
  check_pointers("host embedding_backward", {dout, tokens, dtable});
  std::memset(dtable, 0, static_cast<std::size_t>(desc.vocab * desc.dim) * sizeof(float));
  // Position by position in increasing order: every dtable element receives
  // its terms in the device's order (each add is one fp32 rounding).
  for (std::int64_t p = 0; p < desc.positions(); ++p) {
    const std::int64_t local = tokens[p] - desc.vocab_offset;  // the token's row in this table
    if (local < 0 || local >= desc.vocab) continue;
    float* row = dtable + local * desc.dim;
    for (std::int64_t d = 0; d < desc.dim; ++d) row[d] += load_as_float(desc.dtype, dout, p * desc.dim + d);
  }
}

}  // namespace host
}  // namespace stepgraph::kernels
