// Token embedding gather and its deterministic backward. CPU: the host
// references against direct formulas (the gather is exact; the backward's
// fp32 sums in position order, against double sums), out-of-range tokens, and
// the argument checks. GPU: both kernels against the host reference bit for
// bit per dtype and size class (dims that are not a multiple of a warp, dims
// spanning several column blocks, more positions than one token tile, small
// vocabularies with many repeats, vocabulary slices), into NaN-poisoned
// outputs. The backward's tiles, column chunks and access paths: one row
// named across many token tiles in every dtype, a ragged dim across a column
// chunk boundary, several vectorized chunks, misaligned pointers, slices with
// out-of-range tokens, a slice no token names, and a 32000 x 2048 table.
// Vocabulary slices: N slices' lookups sum to the whole table's, bit for bit,
// and their gradients are its rows.
#include "kernels/embedding.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/stream.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using testing::DeviceArray;
using testing::expect_invalid_argument;
using testing::HostArray;
using testing::random_array;

constexpr DType kBf16 = DType::kBFloat16;
constexpr DType kFp16 = DType::kFloat16;
constexpr DType kFp32 = DType::kFloat32;

std::vector<std::int32_t> random_tokens(std::int64_t n, std::int64_t vocab, std::mt19937& rng) {
  std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(vocab - 1));
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(n));
  for (auto& t : tokens) t = pick(rng);
  return tokens;
}

std::vector<std::uint8_t> bytes_of(const HostArray& array) { return array.bytes; }

// ---------------------------------------------------------------------------
// Host references (no GPU needed).

TEST(EmbeddingTest, Bf16HostForwardConcatenatesTheWindowsRows) {
  testing::SeededRng rng;
  const EmbeddingDesc desc{.dtype = kBf16, .vocab = 11, .dim = 5, .rows = 7, .width = 3};
  const HostArray table = random_array(kBf16, desc.vocab * desc.dim, rng);
  const std::vector<std::int32_t> tokens = random_tokens(desc.positions(), desc.vocab, rng);
  HostArray out(kBf16, desc.positions() * desc.dim);
  std::int32_t flag = 0;
  host::embedding_forward(desc, table.data(), tokens.data(), out.data(), &flag);
  EXPECT_EQ(flag, 0);
  for (std::int64_t r = 0; r < desc.rows; ++r) {
    for (std::int64_t w = 0; w < desc.width; ++w) {
      const std::int32_t token = tokens[r * desc.width + w];
      for (std::int64_t d = 0; d < desc.dim; ++d) {
        // out is [rows, width * dim]: row r, column w * dim + d.
        ASSERT_EQ(out.get(r * desc.width * desc.dim + w * desc.dim + d), table.get(token * desc.dim + d))
            << "row " << r << " window position " << w << " column " << d;
      }
    }
  }
}

TEST(EmbeddingTest, Fp32HostForwardZeroesAndFlagsOutOfRangeTokens) {
  testing::SeededRng rng;
  const EmbeddingDesc desc{.dtype = kFp32, .vocab = 4, .dim = 3, .rows = 2, .width = 2};
  const HostArray table = random_array(kFp32, desc.vocab * desc.dim, rng, 1.0f, 2.0f);
  const std::vector<std::int32_t> tokens = {1, 4, -1, 3};  // 4 and -1 are outside [0, 4)
  HostArray out(kFp32, desc.positions() * desc.dim);
  std::int32_t flag = 0;
  host::embedding_forward(desc, table.data(), tokens.data(), out.data(), &flag);
  EXPECT_EQ(flag, 1);
  for (std::int64_t d = 0; d < desc.dim; ++d) {
    EXPECT_EQ(out.get(0 * 3 + d), table.get(1 * 3 + d));
    EXPECT_EQ(out.get(1 * 3 + d), 0.0f);
    EXPECT_EQ(out.get(2 * 3 + d), 0.0f);
    EXPECT_EQ(out.get(3 * 3 + d), table.get(3 * 3 + d));
  }
}

TEST(EmbeddingTest, Bf16HostBackwardSumsEachTokensRowsInPositionOrder) {
  testing::SeededRng rng;
  const EmbeddingDesc desc{.dtype = kBf16, .vocab = 9, .dim = 6, .rows = 40, .width = 4};
  const HostArray dout = random_array(kBf16, desc.positions() * desc.dim, rng);
  std::vector<std::int32_t> tokens = random_tokens(desc.positions(), desc.vocab - 1, rng);  // row 8 never used
  tokens[5] = 99;                                                                           // skipped
  std::vector<float> dtable(static_cast<std::size_t>(desc.vocab * desc.dim), NAN);
  host::embedding_backward(desc, dout.data(), tokens.data(), dtable.data());
  for (std::int64_t v = 0; v < desc.vocab; ++v) {
    for (std::int64_t d = 0; d < desc.dim; ++d) {
      float sequential = 0.0f;
      double exact = 0.0;
      for (std::int64_t p = 0; p < desc.positions(); ++p) {
        if (tokens[p] != v) continue;
        sequential += dout.get(p * desc.dim + d);
        exact += dout.get(p * desc.dim + d);
      }
      const float got = dtable[v * desc.dim + d];
      EXPECT_EQ(got, sequential) << "row " << v << " column " << d;
      EXPECT_NEAR(got, exact, 1e-5 * (1.0 + std::abs(exact)));
      if (v == desc.vocab - 1) {
        EXPECT_EQ(got, 0.0f) << "a row no token names must be zero";
      }
    }
  }
}

// Note [Vocabulary slice of an embedding]: N slices' outputs summed in fp32
// (any order) are the whole table's bits, the signed zeros of the table
// included; each slice's gradient is the whole gradient's rows, bit for bit.
TEST(EmbeddingTest, Bf16HostSlicesSumToTheWholeTableAndTheirGradientsAreItsRows) {
  testing::SeededRng rng;
  constexpr std::int64_t kSlices = 3;
  const EmbeddingDesc whole{.dtype = kBf16, .vocab = 12, .dim = 5, .rows = 30, .width = 2};
  HostArray table = random_array(kBf16, whole.vocab * whole.dim, rng);
  table.set(4 * whole.dim + 1, -0.0f);  // signed zeros survive the sum
  table.set(7 * whole.dim + 2, 0.0f);
  const HostArray dout = random_array(kBf16, whole.positions() * whole.dim, rng);
  std::vector<std::int32_t> tokens = random_tokens(whole.positions(), whole.vocab, rng);
  tokens[3] = 4;
  tokens[8] = 7;
  tokens[11] = static_cast<std::int32_t>(whole.vocab);  // outside every slice: zeros and the flag
  tokens[17] = -2;
  HostArray want(kBf16, whole.positions() * whole.dim);
  std::int32_t want_flag = 0;
  host::embedding_forward(whole, table.data(), tokens.data(), want.data(), &want_flag);
  EXPECT_EQ(want_flag, 1);
  std::vector<float> want_dtable(static_cast<std::size_t>(whole.vocab * whole.dim));
  host::embedding_backward(whole, dout.data(), tokens.data(), want_dtable.data());

  std::vector<HostArray> outs;
  const std::int64_t rows = whole.vocab / kSlices;
  for (std::int64_t s = 0; s < kSlices; ++s) {
    EmbeddingDesc slice = whole;
    slice.vocab = rows;
    slice.vocab_offset = s * rows;
    slice.full_vocab = whole.vocab;
    HostArray slice_table(kBf16, rows * whole.dim);
    std::memcpy(slice_table.data(), table.bytes.data() + s * rows * whole.dim * 2, slice_table.bytes.size());
    outs.emplace_back(kBf16, whole.positions() * whole.dim);
    std::int32_t flag = 0;
    host::embedding_forward(slice, slice_table.data(), tokens.data(), outs.back().data(), &flag);
    EXPECT_EQ(flag, 1) << "slice " << s << ": a token outside the vocabulary flags every slice";
    std::vector<float> dtable(static_cast<std::size_t>(rows * whole.dim), NAN);
    host::embedding_backward(slice, dout.data(), tokens.data(), dtable.data());
    const std::vector<float> want_rows(want_dtable.begin() + s * rows * whole.dim,
                                       want_dtable.begin() + (s + 1) * rows * whole.dim);
    EXPECT_EQ(std::memcmp(dtable.data(), want_rows.data(), dtable.size() * sizeof(float)), 0)
        << "slice " << s << "'s gradient is not the whole table's rows";
  }
  for (const bool reversed : {false, true}) {
    HostArray sum(kBf16, want.numel);
    for (std::int64_t i = 0; i < want.numel; ++i) {
      float acc = outs[reversed ? kSlices - 1 : 0].get(i);
      for (std::int64_t k = 1; k < kSlices; ++k) acc += outs[reversed ? kSlices - 1 - k : k].get(i);
      sum.set(i, acc);
    }
    EXPECT_EQ(sum.bytes, want.bytes) << "the slices' sum" << (reversed ? " in reverse order" : "")
                                     << " is not the whole table's lookup bit for bit";
  }
}

TEST(EmbeddingTest, ChecksRejectBadDescriptions) {
  const EmbeddingDesc good{.dtype = kBf16, .vocab = 8, .dim = 4, .rows = 2, .width = 3};
  EXPECT_NO_THROW(check_embedding(good));
  EmbeddingDesc bad = good;
  bad.dtype = DType::kInt32;
  expect_invalid_argument([&] { check_embedding(bad); }, "dtype");
  bad = good;
  bad.vocab = 0;
  expect_invalid_argument([&] { check_embedding(bad); }, "must be > 0");
  bad = good;
  bad.width = -1;
  expect_invalid_argument([&] { check_embedding(bad); }, "must be > 0");
  bad = good;
  bad.rows = std::int64_t{1} << 30;
  expect_invalid_argument([&] { check_embedding(bad); }, "2^31");
  bad = good;
  bad.vocab_offset = 4;
  bad.full_vocab = 10;  // ids [4, 12) are not inside [0, 10)
  expect_invalid_argument([&] { check_embedding(bad); }, "must lie inside the vocabulary [0, 10)");
  bad.full_vocab = 0;  // the whole table: no offset
  expect_invalid_argument([&] { check_embedding(bad); }, "must lie inside the vocabulary [0, 8)");
  bad = good;
  bad.vocab_offset = 8;
  bad.full_vocab = 16;
  EXPECT_NO_THROW(check_embedding(bad));
  expect_invalid_argument([&] { launch_embedding_forward(good, nullptr, nullptr, nullptr, nullptr, nullptr); }, "null");
  expect_invalid_argument([&] { launch_embedding_backward(good, nullptr, nullptr, nullptr, nullptr); }, "null");
}

// The backward's grid holds a dim of up to 65535 chunks of 2048 columns; a
// wider table is refused before anything is launched (the pointers are
// never read), so this runs without a GPU.
TEST(EmbeddingTest, BackwardRefusesMoreColumnChunksThanTheGridHolds) {
  const EmbeddingDesc wide{.dtype = kBf16, .vocab = 1, .dim = std::int64_t{2048} * 65536, .rows = 1, .width = 1};
  ASSERT_NO_THROW(check_embedding(wide));
  float unused = 0.0f;
  const std::int32_t token = 0;
  expect_invalid_argument([&] { launch_embedding_backward(wide, &unused, &token, &unused, nullptr); },
                          "more than the grid's 65535");
}

// ---------------------------------------------------------------------------
// GPU: the kernels against the host reference, bit for bit.

struct Case {
  DType dtype;
  std::int64_t vocab, dim, rows, width;
  // A vocabulary slice: the table holds ids [vocab_offset, vocab_offset +
  // vocab) of full_vocab (0: the whole table).
  std::int64_t vocab_offset = 0, full_vocab = 0;
};

void expect_device_matches_host(const Case& c) {
  testing::SeededRng rng;
  const EmbeddingDesc desc{.dtype = c.dtype,
                           .vocab = c.vocab,
                           .dim = c.dim,
                           .rows = c.rows,
                           .width = c.width,
                           .vocab_offset = c.vocab_offset,
                           .full_vocab = c.full_vocab};
  const HostArray table = random_array(c.dtype, desc.vocab * desc.dim, rng);
  const HostArray dout = random_array(c.dtype, desc.positions() * desc.dim, rng);
  // Every id of the vocabulary: a slice sees tokens of the other slices too.
  std::vector<std::int32_t> tokens = random_tokens(desc.positions(), desc.valid_ids(), rng);
  HostArray token_array(DType::kInt32, desc.positions());
  std::memcpy(token_array.data(), tokens.data(), tokens.size() * sizeof(std::int32_t));

  HostArray want_out(c.dtype, desc.positions() * desc.dim);
  std::int32_t want_flag = 0;
  host::embedding_forward(desc, table.data(), tokens.data(), want_out.data(), &want_flag);
  std::vector<float> want_dtable(static_cast<std::size_t>(desc.vocab * desc.dim));
  host::embedding_backward(desc, dout.data(), tokens.data(), want_dtable.data());

  DeviceArray d_table(table), d_dout(dout), d_tokens(token_array);
  DeviceArray d_out(want_out.bytes.size()), d_dtable(want_dtable.size() * sizeof(float));
  DeviceArray d_flag(sizeof(std::int32_t));
  d_out.poison();
  d_dtable.poison();
  d_flag.upload(HostArray(DType::kInt32, 1));
  Stream stream;
  launch_embedding_forward(desc, d_table.get(), d_tokens.as<std::int32_t>(), d_out.get(), d_flag.as<std::int32_t>(),
                           stream.get());
  launch_embedding_backward(desc, d_dout.get(), d_tokens.as<std::int32_t>(), d_dtable.as<float>(), stream.get());
  EXPECT_EQ(bytes_of(d_out.download(c.dtype, want_out.numel)), want_out.bytes) << "forward differs from the host";
  EXPECT_EQ(d_flag.download(DType::kInt32, 1).get(0), 0.0f);
  const HostArray got_dtable = d_dtable.download(kFp32, static_cast<std::int64_t>(want_dtable.size()));
  EXPECT_EQ(std::memcmp(got_dtable.data(), want_dtable.data(), want_dtable.size() * sizeof(float)), 0)
      << "backward differs from the host's fp32 sums in position order";

  // Out of range: zeros (+0.0 from the first slice, -0.0 from the others)
  // and the flag on the device too.
  tokens[0] = static_cast<std::int32_t>(desc.valid_ids());
  std::memcpy(token_array.data(), tokens.data(), tokens.size() * sizeof(std::int32_t));
  d_tokens.upload(token_array);
  launch_embedding_forward(desc, d_table.get(), d_tokens.as<std::int32_t>(), d_out.get(), d_flag.as<std::int32_t>(),
                           stream.get());
  const HostArray flagged = d_out.download(c.dtype, want_out.numel);
  EXPECT_EQ(d_flag.download(DType::kInt32, 1).get(0), 1.0f);
  for (std::int64_t d = 0; d < desc.dim; ++d) {
    EXPECT_EQ(flagged.get(d), 0.0f);
    EXPECT_EQ(std::signbit(flagged.get(d)), desc.vocab_offset != 0) << "column " << d;
  }
  HostArray want_flagged(c.dtype, desc.positions() * desc.dim);
  host::embedding_forward(desc, table.data(), tokens.data(), want_flagged.data(), &want_flag);
  EXPECT_EQ(flagged.bytes, want_flagged.bytes) << "forward with an out-of-range token differs from the host";
}

TEST(EmbeddingCudaTest, Bf16SmallDimManyRepeatsMatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  expect_device_matches_host({kBf16, 8, 16, 256, 8});
}

TEST(EmbeddingCudaTest, Fp16RaggedDimSeveralColumnBlocksMatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  expect_device_matches_host({kFp16, 37, 300, 33, 3});
}

TEST(EmbeddingCudaTest, Fp32MorePositionsThanOneTileMatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  expect_device_matches_host({kFp32, 1000, 64, 700, 4});
}

TEST(EmbeddingCudaTest, Bf16LargeVocabMatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  expect_device_matches_host({kBf16, 4096, 128, 512, 8});
}

TEST(EmbeddingCudaTest, Bf16VocabularySliceMatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  expect_device_matches_host({kBf16, 256, 96, 300, 1, /*vocab_offset=*/512, /*full_vocab=*/1024});
}

TEST(EmbeddingCudaTest, Fp32FirstVocabularySliceMatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  expect_device_matches_host({kFp32, 100, 33, 2500, 1, /*vocab_offset=*/0, /*full_vocab=*/400});
}

// ---------------------------------------------------------------------------
// GPU: the backward's tiles, column chunks and access paths, against the host
// bit for bit (Note [Deterministic embedding backward]). Its tiles hold 1024
// tokens; its blocks 2048 columns, 8 a thread (16-byte accesses where dim is
// a multiple of 8 and dout and dtable are 16-byte aligned); a grid of up to
// 132 blocks (vocab x column chunks) keeps 16 rows of loads in flight a
// thread, a larger one 4.

// `count` tokens: about half name `row`, so its sums run across every tile;
// the rest are any id of [0, valid_ids) plus every 97th outside it (skipped).
std::vector<std::int32_t> tokens_naming_one_row_often(std::int64_t count, std::int64_t valid_ids, std::int32_t row,
                                                      std::mt19937& rng) {
  std::vector<std::int32_t> tokens = random_tokens(count, valid_ids, rng);
  const std::int32_t outside[] = {-1, static_cast<std::int32_t>(valid_ids), std::numeric_limits<std::int32_t>::max(),
                                  std::numeric_limits<std::int32_t>::min()};
  for (std::size_t p = 0; p < tokens.size(); ++p) {
    if (p % 97 == 13) {
      tokens[p] = outside[p % 4];
    } else if (rng() % 2 == 0) {
      tokens[p] = row;
    }
  }
  return tokens;
}

// The backward alone into a NaN-poisoned dtable, against the host bit for
// bit. `misaligned`: dout and dtable start one element past a 16-byte
// boundary, which forces the scalar path whatever dim is.
void expect_backward_matches_host(const EmbeddingDesc& desc, const std::vector<std::int32_t>& tokens,
                                  bool misaligned = false) {
  testing::SeededRng rng;
  ASSERT_EQ(static_cast<std::int64_t>(tokens.size()), desc.positions());
  const HostArray dout = random_array(desc.dtype, desc.positions() * desc.dim, rng);
  std::vector<float> want(static_cast<std::size_t>(desc.vocab * desc.dim));
  host::embedding_backward(desc, dout.data(), tokens.data(), want.data());

  const std::size_t dout_shift = misaligned ? dtype_size(desc.dtype) : 0;
  const std::size_t dtable_shift = misaligned ? sizeof(float) : 0;
  const std::size_t dtable_bytes = want.size() * sizeof(float);
  DeviceArray d_dout(dout.bytes.size() + dout_shift), d_dtable(dtable_bytes + dtable_shift);
  DeviceArray d_tokens(tokens.size() * sizeof(std::int32_t));
  auto* dout_at = static_cast<std::uint8_t*>(d_dout.get()) + dout_shift;
  auto* dtable_at = reinterpret_cast<float*>(static_cast<std::uint8_t*>(d_dtable.get()) + dtable_shift);
  SG_CUDA_CHECK(cudaMemcpy(dout_at, dout.data(), dout.bytes.size(), cudaMemcpyHostToDevice));
  SG_CUDA_CHECK(cudaMemcpy(d_tokens.get(), tokens.data(), d_tokens.bytes(), cudaMemcpyHostToDevice));
  d_dtable.poison();
  Stream stream;
  launch_embedding_backward(desc, dout_at, d_tokens.as<std::int32_t>(), dtable_at, stream.get());
  stream.synchronize();
  std::vector<float> got(want.size());
  SG_CUDA_CHECK(cudaMemcpy(got.data(), dtable_at, dtable_bytes, cudaMemcpyDeviceToHost));
  for (std::int64_t v = 0; v < desc.vocab; ++v) {
    const std::size_t row = static_cast<std::size_t>(v * desc.dim);
    const std::size_t row_bytes = static_cast<std::size_t>(desc.dim) * sizeof(float);
    if (std::memcmp(got.data() + row, want.data() + row, row_bytes) == 0) continue;
    for (std::int64_t d = 0; d < desc.dim; ++d) {
      ASSERT_EQ(std::memcmp(&got[row + d], &want[row + d], sizeof(float)), 0)
          << "row " << v << " column " << d << ": device " << got[row + d] << ", host " << want[row + d]
          << " (the host's fp32 sum in position order)";
    }
  }
}

TEST(EmbeddingCudaTest, EveryDtypeOneRowNamedAcrossManyTilesBothGridsMatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  for (const DType dtype : {kBf16, kFp16, kFp32}) {
    for (const std::int64_t vocab : {64, 200}) {  // 64 blocks: 16 rows in flight; 200: 4
      SCOPED_TRACE(std::string(dtype_name(dtype)) + ", vocab " + std::to_string(vocab));
      testing::SeededRng rng;
      // 5003 positions: four full tiles and a ragged fifth; dim 2048: one
      // whole vectorized chunk.
      const EmbeddingDesc desc{.dtype = dtype, .vocab = vocab, .dim = 2048, .rows = 5003, .width = 1};
      expect_backward_matches_host(desc, tokens_naming_one_row_often(desc.positions(), desc.vocab, 3, rng));
    }
  }
}

TEST(EmbeddingCudaTest, Fp16RaggedDimAcrossAColumnChunkBoundaryBothGridsMatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  for (const std::int64_t vocab : {20, 70}) {  // 40 blocks: 16 rows in flight; 140: 4
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    testing::SeededRng rng;
    // dim 2053: not a multiple of the vector width (the scalar path), and a
    // second chunk of 5 columns.
    const EmbeddingDesc desc{.dtype = kFp16, .vocab = vocab, .dim = 2053, .rows = 500, .width = 3};
    expect_backward_matches_host(desc, tokens_naming_one_row_often(desc.positions(), desc.vocab, 19, rng));
  }
}

TEST(EmbeddingCudaTest, Fp32VectorizedThreeColumnChunksMatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  // dim 4104 = 2 * 2048 + 8: the last chunk is one thread's vector.
  const EmbeddingDesc desc{.dtype = kFp32, .vocab = 30, .dim = 4104, .rows = 11, .width = 100};
  expect_backward_matches_host(desc, tokens_naming_one_row_often(desc.positions(), desc.vocab, 0, rng));
}

TEST(EmbeddingCudaTest, Bf16MisalignedDoutAndDtableMatchHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  const EmbeddingDesc desc{.dtype = kBf16, .vocab = 50, .dim = 256, .rows = 40, .width = 64};
  expect_backward_matches_host(desc, tokens_naming_one_row_often(desc.positions(), desc.vocab, 7, rng),
                               /*misaligned=*/true);
}

TEST(EmbeddingCudaTest, Fp16VocabularySliceWithOutOfRangeTokensMatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  // Ids [600, 900) of 1200: tokens of the other slices and outside [0, 1200)
  // are skipped; row 0 of the slice (id 600) is named across every tile.
  const EmbeddingDesc desc{
      .dtype = kFp16, .vocab = 300, .dim = 96, .rows = 1000, .width = 3, .vocab_offset = 600, .full_vocab = 1200};
  expect_backward_matches_host(desc, tokens_naming_one_row_often(desc.positions(), desc.valid_ids(), 600, rng));
}

TEST(EmbeddingCudaTest, Bf16NoTokenInTheSliceGivesAZeroTable) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  const EmbeddingDesc desc{
      .dtype = kBf16, .vocab = 16, .dim = 64, .rows = 3, .width = 700, .vocab_offset = 16, .full_vocab = 32};
  std::vector<std::int32_t> tokens = random_tokens(desc.positions(), desc.vocab_offset, rng);  // ids below 16
  tokens[5] = -7;
  tokens[9] = 32;
  expect_backward_matches_host(desc, tokens);
}

// A GPT's shape (vocab 32000, dim 2048) over one microbatch of 2048 tokens:
// the 262 MB table is written once, and the many unnamed rows are +0.0.
TEST(EmbeddingCudaTest, Bf16Vocab32000Dim2048Positions2048MatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  const EmbeddingDesc desc{.dtype = kBf16, .vocab = 32000, .dim = 2048, .rows = 1, .width = 2048};
  std::vector<std::int32_t> tokens = random_tokens(desc.positions(), desc.vocab, rng);
  for (std::size_t p = 0; p < tokens.size(); p += 5) tokens[p] = 1;  // a frequent token, as a text's "the"
  expect_backward_matches_host(desc, tokens);
}

}  // namespace
}  // namespace stepgraph::kernels
