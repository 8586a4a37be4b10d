// Segment attention's CUDA kernels (Note [Segment attention] in
// kernels/attention.h) and the context-parallel plan kernel
// (kernels/context_parallel_plan.h) against their host references. The
// plain kernels (fp32, head dim 40) and the tensor-core ones (bf16 and fp16
// at head dims 64 and 128): MHA/GQA/MQA, causal and full, the tables of CP
// ranks (N = 2 and 4, first and last rank) over random packings with a
// sequence over every rank's chunks and a one-token sequence, and tables
// with shared, unread, empty and too-short kv ranges; self-attention written
// as segments equals the self-attention kernels (bit for bit on the plain
// kernels in fp32; on the tensor cores the forward bit for bit, the
// gradients within tolerance: dQ's partial sums cut the keys in other
// tiles), and a context-parallel rank's forward on the tensor cores equals
// one rank's bit for bit; two launches give the same bits; a garbage
// segment table or cu_seqlens on the device is read as a valid one and never
// faults; argument checks and the choice of path (these run without a GPU
// too).
//
// Tolerances (max |got - want| / max |want| per tensor), attention_test's:
// the plain kernels add in fp32 in other orders than the reference (online
// softmax, warp sums): ~1e-6 in fp32, we allow 1e-4; the tensor-core
// kernels round P and dS to 16 bits before their products and outputs are
// stored in bf16/fp16: we allow 2e-2 and 4e-3.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/stream.h"
#include "kernels/attention.h"
#include "kernels/context_parallel_plan.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using testing::DeviceArray;
using testing::expect_invalid_argument;
using testing::HostArray;
using testing::int32s;
using testing::random_array;
using testing::SeededRng;

std::vector<std::int32_t> int_values(const HostArray& a) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(a.numel));
  std::memcpy(out.data(), a.data(), out.size() * sizeof(std::int32_t));
  return out;
}

struct Table {
  std::vector<std::int32_t> q_offsets, kv_ranges;
};

// Self-attention over the packing `cu` written as segments: each sequence
// its own queries and its own keys.
Table self_attention_table(const std::vector<std::int32_t>& cu) {
  Table t{cu, {}};
  for (std::size_t s = 0; s + 1 < cu.size(); ++s) {
    t.kv_ranges.push_back(cu[s]);
    t.kv_ranges.push_back(cu[s + 1]);
  }
  return t;
}

using Inputs = testing::AttentionInputs;

Inputs random_inputs(const SegmentAttentionDesc& d, std::mt19937& rng) {
  const AttentionDesc& a = d.attention;
  const std::int64_t nq = a.tokens * a.heads * a.head_dim, nkv = d.kv_tokens * a.kv_heads * a.head_dim;
  return {random_array(a.dtype, nq, rng, -2.0f, 2.0f), random_array(a.dtype, nkv, rng, -2.0f, 2.0f),
          random_array(a.dtype, nkv, rng), random_array(a.dtype, nq, rng)};
}

using Results = testing::AttentionResults;

// Forward then backward on the device; `table` goes to the device as it is.
Results run_device(const SegmentAttentionDesc& d, const Inputs& in, const Table& table) {
  const AttentionDesc& a = d.attention;
  const std::int64_t nq = a.tokens * a.heads * a.head_dim, nkv = d.kv_tokens * a.kv_heads * a.head_dim;
  const std::size_t es = dtype_size(a.dtype);
  DeviceArray q(in.q), k(in.k), v(in.v), dout(in.dout), q_offsets(int32s(table.q_offsets)),
      kv_ranges(int32s(table.kv_ranges));
  DeviceArray out(nq * es), lse(a.heads * a.tokens * 4), dq(nq * es), dk(nkv * es), dv(nkv * es);
  DeviceArray workspace(segment_attention_backward_workspace_bytes(d));
  for (DeviceArray* x : {&out, &lse, &dq, &dk, &dv, &workspace}) x->poison();
  Stream stream;
  launch_segment_attention_forward(d, q.get(), k.get(), v.get(), q_offsets.as<std::int32_t>(),
                                   kv_ranges.as<std::int32_t>(), out.get(), lse.as<float>(), stream.get());
  launch_segment_attention_backward(d, q.get(), k.get(), v.get(), out.get(), lse.as<float>(), dout.get(),
                                    q_offsets.as<std::int32_t>(), kv_ranges.as<std::int32_t>(), dq.get(), dk.get(),
                                    dv.get(), workspace.get(), stream.get());
  stream.synchronize();
  return {out.download(a.dtype, nq), lse.download(DType::kFloat32, a.heads * a.tokens), dq.download(a.dtype, nq),
          dk.download(a.dtype, nkv), dv.download(a.dtype, nkv)};
}

Results run_host(const SegmentAttentionDesc& d, const Inputs& in, const Table& table) {
  const AttentionDesc& a = d.attention;
  const std::int64_t nq = a.tokens * a.heads * a.head_dim, nkv = d.kv_tokens * a.kv_heads * a.head_dim;
  Results r{HostArray(a.dtype, nq), HostArray(DType::kFloat32, a.heads * a.tokens), HostArray(a.dtype, nq),
            HostArray(a.dtype, nkv), HostArray(a.dtype, nkv)};
  host::segment_attention_forward(d, in.q.data(), in.k.data(), in.v.data(), table.q_offsets.data(),
                                  table.kv_ranges.data(), r.out.data(), static_cast<float*>(r.lse.data()));
  host::segment_attention_backward(d, in.q.data(), in.k.data(), in.v.data(), r.out.data(),
                                   static_cast<const float*>(r.lse.data()), in.dout.data(), table.q_offsets.data(),
                                   table.kv_ranges.data(), r.dq.data(), r.dk.data(), r.dv.data());
  return r;
}

std::vector<std::int32_t> random_offsets(std::mt19937& rng, std::int32_t tokens) {
  std::vector<std::int32_t> cu{0};
  while (cu.back() < tokens) {
    const std::int32_t l = (rng() % 4 == 0) ? 1 : 1 + static_cast<std::int32_t>(rng() % 90);
    cu.push_back(std::min(tokens, cu.back() + l));
  }
  return cu;
}

// Rank `rank`'s plan (host reference) over the packing `cu` of `tokens`.
Table plan_table(const std::vector<std::int32_t>& cu, int ranks, int rank, bool causal) {
  const ContextParallelPlanDesc d{.tokens = cu.back(),
                                  .sequences = static_cast<std::int64_t>(cu.size()) - 1,
                                  .ranks = ranks,
                                  .rank = rank,
                                  .causal = causal};
  Table t{std::vector<std::int32_t>(static_cast<std::size_t>(d.segments() + 1)),
          std::vector<std::int32_t>(static_cast<std::size_t>(2 * d.segments()))};
  std::vector<std::int32_t> positions(static_cast<std::size_t>(d.local_tokens()));
  host::context_parallel_plan(d, cu.data(), t.q_offsets.data(), t.kv_ranges.data(), positions.data());
  return t;
}

SegmentAttentionDesc desc_of(DType dtype, std::int64_t heads, std::int64_t kv_heads, std::int64_t dim, bool causal,
                             const Table& t, std::int64_t kv_tokens) {
  return {.attention = {.dtype = dtype,
                        .tokens = t.q_offsets.back(),
                        .sequences = static_cast<std::int64_t>(t.q_offsets.size()) - 1,
                        .heads = heads,
                        .kv_heads = kv_heads,
                        .head_dim = dim,
                        .causal = causal},
          .kv_tokens = kv_tokens};
}

TEST(SegmentAttentionTest, fp32_bf16_fp16_d40_d64_d128_mha_gqa_mqa_context_parallel_tables) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  const struct {
    DType dtype;
    std::int64_t dim;
  } rows[] = {{DType::kFloat32, 40}, {DType::kBFloat16, 64}, {DType::kFloat16, 128}, {DType::kBFloat16, 128}};
  const std::pair<std::int64_t, std::int64_t> layouts[] = {{4, 4}, {8, 2}, {4, 1}};
  for (const auto& row : rows) {
    for (const auto& [heads, kv_heads] : layouts) {
      for (const bool causal : {true, false}) {
        const int ranks = 2 + static_cast<int>(rng() % 2) * 2;  // 2 or 4
        const int rank = static_cast<int>(rng() % ranks);
        const std::vector<std::int32_t> cu = random_offsets(rng, 384);
        const Table t = plan_table(cu, ranks, rank, causal);
        const SegmentAttentionDesc d = desc_of(row.dtype, heads, kv_heads, row.dim, causal, t, cu.back());
        SCOPED_TRACE(std::string(dtype_name(row.dtype)) + " D=" + std::to_string(row.dim) +
                     " H=" + std::to_string(heads) + "/" + std::to_string(kv_heads) + (causal ? " causal" : " full") +
                     " cp" + std::to_string(ranks) + " rank " + std::to_string(rank));
        const Inputs in = random_inputs(d, rng);
        testing::expect_attention_close(run_device(d, in, t), run_host(d, in, t), row.dtype);
      }
    }
  }
}

TEST(SegmentAttentionTest, shared_unread_short_and_empty_ranges_fp32_and_bf16) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  // Keys 0-4 read by segments 0 and 2, key 9 by none, segment 3's first two
  // queries see no key when causal, segment 1 empty.
  const Table t{{0, 2, 2, 5, 9}, {0, 5, 7, 7, 0, 9, 10, 12}};
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (const bool causal : {true, false}) {
      const SegmentAttentionDesc d = desc_of(dtype, 4, 2, 40, causal, t, 12);
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (causal ? " causal" : " full"));
      const Inputs in = random_inputs(d, rng);
      const Results got = run_device(d, in, t);
      testing::expect_attention_close(got, run_host(d, in, t), dtype);
      const std::vector<float> dk = got.dk.to_floats();
      for (std::int64_t e = 9 * 2 * 40; e < 10 * 2 * 40; ++e) EXPECT_EQ(dk[e], 0.0f) << "key 9 is read by no query";
    }
  }
}

TEST(SegmentAttentionTest, self_attention_as_segments_equals_the_plain_kernels_bit_for_bit_fp32) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  const std::vector<std::int32_t> cu = random_offsets(rng, 300);
  const Table t = self_attention_table(cu);
  for (const bool causal : {true, false}) {
    const SegmentAttentionDesc d = desc_of(DType::kFloat32, 4, 2, 40, causal, t, cu.back());
    ASSERT_FALSE(attention_uses_tensor_cores(d.attention));
    const Inputs in = random_inputs(d, rng);
    const Results seg = run_device(d, in, t);
    const AttentionDesc& a = d.attention;
    const std::int64_t nq = a.tokens * a.heads * a.head_dim, nkv = a.tokens * a.kv_heads * a.head_dim;
    DeviceArray q(in.q), k(in.k), v(in.v), dout(in.dout), cu_dev(int32s(cu));
    DeviceArray out(nq * 4), lse(a.heads * a.tokens * 4), dq(nq * 4), dk(nkv * 4), dv(nkv * 4);
    DeviceArray workspace(attention_backward_workspace_bytes(a));
    Stream stream;
    launch_attention_forward(a, q.get(), k.get(), v.get(), cu_dev.as<std::int32_t>(), out.get(), lse.as<float>(),
                             stream.get());
    launch_attention_backward(a, q.get(), k.get(), v.get(), out.get(), lse.as<float>(), dout.get(),
                              cu_dev.as<std::int32_t>(), dq.get(), dk.get(), dv.get(), workspace.get(), stream.get());
    stream.synchronize();
    const std::string mode = causal ? "causal" : "full";
    EXPECT_EQ(seg.out.bytes, out.download(a.dtype, nq).bytes) << mode;
    EXPECT_EQ(seg.lse.bytes, lse.download(DType::kFloat32, a.heads * a.tokens).bytes) << mode;
    EXPECT_EQ(seg.dq.bytes, dq.download(a.dtype, nq).bytes) << mode;
    EXPECT_EQ(seg.dk.bytes, dk.download(a.dtype, nkv).bytes) << mode;
    EXPECT_EQ(seg.dv.bytes, dv.download(a.dtype, nkv).bytes) << mode;
  }
}

// A packing of 2 N c tokens for context parallelism: a one-token sequence and
// short random ones (up to 90 tokens) from the start, then one sequence from
// inside the first chunk to inside the last (over every rank's chunks), then
// random ones up to 150 tokens.
std::vector<std::int32_t> spanning_packing(std::mt19937& rng, int ranks, std::int32_t chunk) {
  const std::int32_t tokens = 2 * ranks * chunk;
  const std::int32_t start = chunk - 1 - static_cast<std::int32_t>(rng() % (chunk / 2));
  const std::int32_t end = tokens - chunk + 1 + static_cast<std::int32_t>(rng() % (chunk / 2));
  std::vector<std::int32_t> cu{0, 1};
  while (cu.back() < start) cu.push_back(std::min(start, cu.back() + 1 + static_cast<std::int32_t>(rng() % 90)));
  cu.push_back(end);
  while (cu.back() < tokens) cu.push_back(std::min(tokens, cu.back() + 1 + static_cast<std::int32_t>(rng() % 150)));
  return cu;
}

// The tensor-core path over context-parallel plans: chunks of 168 (N = 2)
// and 136 (N = 4) tokens, more than a tile of 128 and not multiples of 64;
// the first rank's pieces are short and read few keys, the last rank's are
// whole chunks reading up to the sequence's first chunk's keys.
TEST(SegmentAttentionTest, tensor_cores_bf16_fp16_d64_d128_mha_gqa_context_parallel_n2_n4_first_last_rank) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  const struct {
    DType dtype;
    std::int64_t dim, heads, kv_heads;
  } rows[] = {{DType::kBFloat16, 64, 4, 4},
              {DType::kBFloat16, 128, 8, 2},
              {DType::kFloat16, 64, 8, 2},
              {DType::kFloat16, 128, 4, 4}};
  for (const auto& row : rows) {
    for (const bool causal : {true, false}) {
      for (const int ranks : {2, 4}) {
        for (const int rank : {0, ranks - 1}) {
          const std::vector<std::int32_t> cu = spanning_packing(rng, ranks, ranks == 2 ? 168 : 136);
          const Table t = plan_table(cu, ranks, rank, causal);
          const SegmentAttentionDesc d = desc_of(row.dtype, row.heads, row.kv_heads, row.dim, causal, t, cu.back());
          ASSERT_TRUE(segment_attention_uses_tensor_cores(d));
          SCOPED_TRACE(std::string(dtype_name(row.dtype)) + " D=" + std::to_string(row.dim) +
                       " H=" + std::to_string(row.heads) + "/" + std::to_string(row.kv_heads) +
                       (causal ? " causal" : " full") + " cp" + std::to_string(ranks) + " rank " +
                       std::to_string(rank) + " sequences " + std::to_string(cu.size() - 1));
          const Inputs in = random_inputs(d, rng);
          testing::expect_attention_close(run_device(d, in, t), run_host(d, in, t), row.dtype);
        }
      }
    }
  }
}

// Hand-made ranges on the tensor cores: keys 130-139 read by segments 0, 2
// and 4, keys 310-319 by none; segment 1 has no queries (its range is
// skipped), segment 2 more queries than keys (its first 30 see none when
// causal), segment 3 an empty range (a tile that sees no key), segment 5 200
// queries over 10 keys (its first query tile of 128 sees none when causal).
TEST(SegmentAttentionTest, tensor_cores_overlapping_empty_and_unseen_ranges_bf16_fp16_d64_d128) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  const Table t{{0, 100, 100, 250, 260, 400, 600}, {0, 150, 5, 7, 20, 140, 200, 200, 130, 300, 300, 310}};
  const struct {
    DType dtype;
    std::int64_t dim, heads, kv_heads;
  } rows[] = {{DType::kBFloat16, 128, 4, 2}, {DType::kFloat16, 64, 2, 2}};
  for (const auto& row : rows) {
    for (const bool causal : {true, false}) {
      const SegmentAttentionDesc d = desc_of(row.dtype, row.heads, row.kv_heads, row.dim, causal, t, 320);
      SCOPED_TRACE(std::string(dtype_name(row.dtype)) + " D=" + std::to_string(row.dim) +
                   (causal ? " causal" : " full"));
      const Inputs in = random_inputs(d, rng);
      const Results got = run_device(d, in, t);
      testing::expect_attention_close(got, run_host(d, in, t), row.dtype);
      const std::vector<float> dk = got.dk.to_floats(), dv = got.dv.to_floats();
      const std::int64_t row_elems = row.kv_heads * row.dim;
      for (std::int64_t e = 310 * row_elems; e < 320 * row_elems; ++e) {
        ASSERT_EQ(dk[e], 0.0f) << "keys 310-319 are read by no query";
        ASSERT_EQ(dv[e], 0.0f) << "keys 310-319 are read by no query";
      }
      const std::vector<float> lse = got.lse.to_floats();
      for (std::int64_t h = 0; h < row.heads; ++h) {
        EXPECT_EQ(lse[h * 600 + 255], -INFINITY) << "segment 3's range is empty";
        if (causal) {
          EXPECT_EQ(lse[h * 600 + 400], -INFINITY) << "segment 5's first query sees no key";
        }
      }
    }
  }
}

// Self-attention written as segments on the tensor cores: the same forward
// kernel over the same tiles (bit for bit); the backward's dQ sums the keys
// in tiles of the kv tokens, not of each sequence (within tolerance).
TEST(SegmentAttentionTest, self_attention_as_segments_on_tensor_cores_bf16_d128_fp16_d64) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  const std::vector<std::int32_t> cu = random_offsets(rng, 700);
  const Table t = self_attention_table(cu);
  const struct {
    DType dtype;
    std::int64_t dim, heads, kv_heads;
  } rows[] = {{DType::kBFloat16, 128, 8, 2}, {DType::kFloat16, 64, 4, 4}};
  for (const auto& row : rows) {
    for (const bool causal : {true, false}) {
      const SegmentAttentionDesc d = desc_of(row.dtype, row.heads, row.kv_heads, row.dim, causal, t, cu.back());
      ASSERT_TRUE(attention_uses_tensor_cores(d.attention));
      SCOPED_TRACE(std::string(dtype_name(row.dtype)) + " D=" + std::to_string(row.dim) +
                   (causal ? " causal" : " full"));
      const Inputs in = random_inputs(d, rng);
      const Results seg = run_device(d, in, t);
      const AttentionDesc& a = d.attention;
      const std::int64_t nq = a.tokens * a.heads * a.head_dim, nkv = a.tokens * a.kv_heads * a.head_dim;
      const std::size_t es = dtype_size(a.dtype);
      DeviceArray q(in.q), k(in.k), v(in.v), dout(in.dout), cu_dev(int32s(cu));
      DeviceArray out(nq * es), lse(a.heads * a.tokens * 4), dq(nq * es), dk(nkv * es), dv(nkv * es);
      DeviceArray workspace(attention_backward_workspace_bytes(a));
      Stream stream;
      launch_attention_forward(a, q.get(), k.get(), v.get(), cu_dev.as<std::int32_t>(), out.get(), lse.as<float>(),
                               stream.get());
      launch_attention_backward(a, q.get(), k.get(), v.get(), out.get(), lse.as<float>(), dout.get(),
                                cu_dev.as<std::int32_t>(), dq.get(), dk.get(), dv.get(), workspace.get(), stream.get());
      stream.synchronize();
      const Results self{out.download(a.dtype, nq), lse.download(DType::kFloat32, a.heads * a.tokens),
                         dq.download(a.dtype, nq), dk.download(a.dtype, nkv), dv.download(a.dtype, nkv)};
      EXPECT_EQ(seg.out.bytes, self.out.bytes);
      EXPECT_EQ(seg.lse.bytes, self.lse.bytes);
      testing::expect_attention_close(seg, self, row.dtype);
    }
  }
}

// A context-parallel rank's forward on the tensor cores gives one rank's
// bits (Note [Context-parallel attention by all-gather] in
// layers/context_parallel_attention.h): its pieces' key ranges start at their
// sequences' starts, so a query reads the same key tiles, in the same order,
// as in the self-attention kernel over the whole batch; the tiles past its
// last key (its query tile ends elsewhere) are masked whole and leave its
// sums as they are (rescale by 2^0, add zeros).
TEST(SegmentAttentionTest, tensor_cores_context_parallel_forward_equals_one_rank_bit_for_bit) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  const struct {
    DType dtype;
    std::int64_t dim, heads, kv_heads;
  } rows[] = {{DType::kBFloat16, 128, 8, 2}, {DType::kFloat16, 64, 4, 4}};
  for (const auto& row : rows) {
    for (const bool causal : {true, false}) {
      for (const int ranks : {2, 4}) {
        const std::int32_t chunk = ranks == 2 ? 168 : 136;
        const std::vector<std::int32_t> cu = spanning_packing(rng, ranks, chunk);
        const std::int64_t tokens = cu.back();
        const AttentionDesc whole{.dtype = row.dtype,
                                  .tokens = tokens,
                                  .sequences = static_cast<std::int64_t>(cu.size()) - 1,
                                  .heads = row.heads,
                                  .kv_heads = row.kv_heads,
                                  .head_dim = row.dim,
                                  .causal = causal};
        const std::size_t es = dtype_size(row.dtype);
        const std::size_t q_row = static_cast<std::size_t>(row.heads * row.dim) * es;
        const HostArray q = random_array(row.dtype, tokens * row.heads * row.dim, rng, -2.0f, 2.0f);
        const HostArray k = random_array(row.dtype, tokens * row.kv_heads * row.dim, rng, -2.0f, 2.0f);
        const HostArray v = random_array(row.dtype, tokens * row.kv_heads * row.dim, rng);
        DeviceArray q_dev(q), k_dev(k), v_dev(v), cu_dev(int32s(cu));
        DeviceArray out(tokens * q_row), lse(whole.heads * tokens * 4);
        Stream stream;
        launch_attention_forward(whole, q_dev.get(), k_dev.get(), v_dev.get(), cu_dev.as<std::int32_t>(), out.get(),
                                 lse.as<float>(), stream.get());
        stream.synchronize();
        const HostArray want_out = out.download(row.dtype, tokens * row.heads * row.dim);
        const std::vector<float> want_lse = lse.download(DType::kFloat32, whole.heads * tokens).to_floats();
        for (int rank = 0; rank < ranks; ++rank) {
          SCOPED_TRACE(std::string(dtype_name(row.dtype)) + " D=" + std::to_string(row.dim) +
                       (causal ? " causal" : " full") + " cp" + std::to_string(ranks) + " rank " +
                       std::to_string(rank));
          const Table t = plan_table(cu, ranks, rank, causal);
          const SegmentAttentionDesc d = desc_of(row.dtype, row.heads, row.kv_heads, row.dim, causal, t, tokens);
          // The rank's queries: chunks rank and 2 N - 1 - rank of the stream (Note [Context-parallel token layout]).
          const std::int64_t local = d.attention.tokens;
          auto stream_row = [&](std::int64_t i) {
            return i < chunk ? rank * chunk + i : (2 * ranks - 1 - rank) * chunk + (i - chunk);
          };
          HostArray q_local(row.dtype, local * row.heads * row.dim);
          for (std::int64_t i = 0; i < local; ++i) {
            std::memcpy(q_local.bytes.data() + i * q_row, q.bytes.data() + stream_row(i) * q_row, q_row);
          }
          DeviceArray ql_dev(q_local), q_offsets(int32s(t.q_offsets)), kv_ranges(int32s(t.kv_ranges));
          DeviceArray seg_out(local * q_row), seg_lse(row.heads * local * 4);
          launch_segment_attention_forward(d, ql_dev.get(), k_dev.get(), v_dev.get(), q_offsets.as<std::int32_t>(),
                                           kv_ranges.as<std::int32_t>(), seg_out.get(), seg_lse.as<float>(),
                                           stream.get());
          stream.synchronize();
          const HostArray got_out = seg_out.download(row.dtype, local * row.heads * row.dim);
          const std::vector<float> got_lse = seg_lse.download(DType::kFloat32, row.heads * local).to_floats();
          std::int64_t out_rows = 0;
          std::int64_t lse_values = 0;
          for (std::int64_t i = 0; i < local; ++i) {
            out_rows += std::memcmp(got_out.bytes.data() + i * q_row, want_out.bytes.data() + stream_row(i) * q_row,
                                    q_row) != 0;
            for (std::int64_t h = 0; h < row.heads; ++h) {
              const float a = got_lse[h * local + i];
              const float b = want_lse[h * tokens + stream_row(i)];
              lse_values += std::memcmp(&a, &b, sizeof(float)) != 0;
            }
          }
          EXPECT_EQ(out_rows, 0) << "query rows whose out differs from one rank's";
          EXPECT_EQ(lse_values, 0) << "lse values that differ from one rank's";
        }
      }
    }
  }
}

// Two launches give the same bits, on the tensor cores (dQ's fixed order of
// adds, dK/dV summed in registers in segment order) and the plain kernels.
TEST(SegmentAttentionTest, deterministic_bits_tensor_cores_and_plain) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  const struct {
    DType dtype;
    std::int64_t dim, heads, kv_heads;
    int ranks, rank;
    bool causal;
  } rows[] = {{DType::kBFloat16, 128, 8, 2, 2, 1, true},
              {DType::kFloat16, 64, 4, 1, 4, 0, true},
              {DType::kBFloat16, 64, 4, 2, 4, 3, false},
              {DType::kFloat32, 40, 4, 2, 2, 0, true}};
  for (const auto& row : rows) {
    const std::vector<std::int32_t> cu = spanning_packing(rng, row.ranks, 136);
    const Table t = plan_table(cu, row.ranks, row.rank, row.causal);
    const SegmentAttentionDesc d = desc_of(row.dtype, row.heads, row.kv_heads, row.dim, row.causal, t, cu.back());
    SCOPED_TRACE(std::string(dtype_name(row.dtype)) + " D=" + std::to_string(row.dim) + " cp" +
                 std::to_string(row.ranks) + " rank " + std::to_string(row.rank));
    const Inputs in = random_inputs(d, rng);
    const Results a = run_device(d, in, t);
    const Results b = run_device(d, in, t);
    EXPECT_EQ(a.out.bytes, b.out.bytes);
    EXPECT_EQ(a.lse.bytes, b.lse.bytes);
    EXPECT_EQ(a.dq.bytes, b.dq.bytes);
    EXPECT_EQ(a.dk.bytes, b.dk.bytes);
    EXPECT_EQ(a.dv.bytes, b.dv.bytes);
  }
}

// The table the kernels read from any contents (Note [Segment attention]).
Table sanitized(const Table& raw, std::int32_t q_tokens, std::int32_t kv_tokens) {
  Table t{std::vector<std::int32_t>(raw.q_offsets.size()), raw.kv_ranges};
  const std::size_t last = raw.q_offsets.size() - 1;
  for (std::size_t s = 1; s < last; ++s) {
    t.q_offsets[s] = std::max(t.q_offsets[s - 1], std::clamp(raw.q_offsets[s], 0, q_tokens));
  }
  t.q_offsets[last] = q_tokens;
  for (std::size_t s = 0; s < last; ++s) {
    t.kv_ranges[2 * s] = std::clamp(raw.kv_ranges[2 * s], 0, kv_tokens);
    t.kv_ranges[2 * s + 1] = std::clamp(raw.kv_ranges[2 * s + 1], t.kv_ranges[2 * s], kv_tokens);
  }
  return t;
}

TEST(SegmentAttentionTest, garbage_tables_read_as_valid_ones_never_fault) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  const Table raw{{-7, 90, 30, 1000000, -1, 5}, {-5, 40, 2000000000, 3, 10, -10, 0, 99999, 7, 300}};
  const Table t = sanitized(raw, 120, 200);
  // fp32: the plain kernels; bf16 and fp16: the tensor cores.
  const struct {
    DType dtype;
    std::int64_t dim;
  } rows[] = {{DType::kFloat32, 64}, {DType::kBFloat16, 64}, {DType::kFloat16, 128}};
  for (const auto& row : rows) {
    for (const bool causal : {true, false}) {
      const SegmentAttentionDesc d = desc_of(row.dtype, 4, 2, row.dim, causal, t, 200);
      SCOPED_TRACE(std::string(dtype_name(row.dtype)) + (causal ? " causal" : " full"));
      EXPECT_EQ(segment_attention_uses_tensor_cores(d), row.dtype != DType::kFloat32);
      const Inputs in = random_inputs(d, rng);
      const Results got = run_device(d, in, raw);  // the garbage goes to the device
      SG_CUDA_CHECK(cudaDeviceSynchronize());
      testing::expect_attention_close(got, run_host(d, in, t), row.dtype);
    }
  }
}

// The plan kernel equals the host plan on valid packings, and on garbage
// gives a table the segment kernels accept as it is.
TEST(ContextParallelPlanTest, device_plan_equals_host_plan_and_survives_garbage) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  for (int trial = 0; trial < 6; ++trial) {
    const int ranks = 1 << (trial % 3);
    std::vector<std::int32_t> cu = random_offsets(rng, 200 * 2 * ranks);
    if (trial == 0) cu = {0, 200 * 2 * ranks};  // one sequence over every rank
    for (int rank = 0; rank < ranks; ++rank) {
      for (const bool causal : {true, false}) {
        const ContextParallelPlanDesc d{.tokens = cu.back(),
                                        .sequences = static_cast<std::int64_t>(cu.size()) - 1,
                                        .ranks = ranks,
                                        .rank = rank,
                                        .causal = causal};
        SCOPED_TRACE("cp" + std::to_string(ranks) + " rank " + std::to_string(rank) + " sequences " +
                     std::to_string(d.sequences));
        std::vector<std::int32_t> q_offsets(static_cast<std::size_t>(d.segments() + 1)),
            kv_ranges(static_cast<std::size_t>(2 * d.segments())),
            positions(static_cast<std::size_t>(d.local_tokens()));
        host::context_parallel_plan(d, cu.data(), q_offsets.data(), kv_ranges.data(), positions.data());
        DeviceArray cu_dev(int32s(cu)), q_dev(q_offsets.size() * 4), kv_dev(kv_ranges.size() * 4),
            pos_dev(positions.size() * 4);
        for (DeviceArray* x : {&q_dev, &kv_dev, &pos_dev}) x->poison();
        Stream stream;
        launch_context_parallel_plan(d, cu_dev.as<std::int32_t>(), q_dev.as<std::int32_t>(), kv_dev.as<std::int32_t>(),
                                     pos_dev.as<std::int32_t>(), stream.get());
        stream.synchronize();
        EXPECT_EQ(int_values(q_dev.download(DType::kInt32, d.segments() + 1)), q_offsets);
        EXPECT_EQ(int_values(kv_dev.download(DType::kInt32, 2 * d.segments())), kv_ranges);
        EXPECT_EQ(int_values(pos_dev.download(DType::kInt32, d.local_tokens())), positions);
      }
    }
  }
  const std::vector<std::int32_t> garbage{-7, 90, 30, 1000000, -1, 5, 2000000000, 12};
  const ContextParallelPlanDesc d{.tokens = 96, .sequences = 7, .ranks = 4, .rank = 1};
  DeviceArray cu_dev(int32s(garbage)), q_dev(8 * 2 * 4 + 4), kv_dev(2 * 14 * 4), pos_dev(24 * 4);
  Stream stream;
  launch_context_parallel_plan(d, cu_dev.as<std::int32_t>(), q_dev.as<std::int32_t>(), kv_dev.as<std::int32_t>(),
                               pos_dev.as<std::int32_t>(), stream.get());
  stream.synchronize();
  const Table t{int_values(q_dev.download(DType::kInt32, 15)), int_values(kv_dev.download(DType::kInt32, 28))};
  const SegmentAttentionDesc sd = desc_of(DType::kFloat32, 2, 2, 8, true, t, 96);
  host::check_segments(sd, t.q_offsets.data(), t.kv_ranges.data());  // a valid table
  for (std::int32_t p : int_values(pos_dev.download(DType::kInt32, 24))) {
    EXPECT_GE(p, 0);
    EXPECT_LT(p, 96);
  }
}

TEST(SegmentAttentionTest, checks_shapes_and_pointers_without_a_launch) {
  SegmentAttentionDesc d{.attention = {.tokens = 16, .sequences = 2, .heads = 4, .kv_heads = 2, .head_dim = 64},
                         .kv_tokens = 32};
  check_segment_attention_cuda(d);
  // The tensor cores take what self-attention's would; their backward also
  // needs the dQ sums and semaphores over the query tokens.
  for (const DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (const std::int64_t dim : {40, 64, 128, 256}) {
      SegmentAttentionDesc x = d;
      x.attention.dtype = dtype;
      x.attention.head_dim = dim;
      EXPECT_EQ(segment_attention_uses_tensor_cores(x), attention_uses_tensor_cores(x.attention));
      EXPECT_EQ(segment_attention_backward_workspace_bytes(x), attention_backward_workspace_bytes(x.attention));
    }
  }
  SegmentAttentionDesc bf16 = d;
  bf16.attention.dtype = DType::kBFloat16;
  EXPECT_TRUE(segment_attention_uses_tensor_cores(bf16));
  // delta, a semaphore and D dQ sums per (head, query), 4 bytes each.
  EXPECT_EQ(segment_attention_backward_workspace_bytes(bf16), std::size_t{4} * 4 * 16 * (1 + 1 + 64));
  SegmentAttentionDesc wide = d;
  wide.attention.head_dim = 320;
  expect_invalid_argument([&] { check_segment_attention_cuda(wide); }, "head_dim <= 256");
  SegmentAttentionDesc no_keys = d;
  no_keys.kv_tokens = 0;
  expect_invalid_argument([&] { check_segment_attention_cuda(no_keys); }, "kv_tokens must be > 0");
  expect_invalid_argument(
      [&] {
        launch_segment_attention_forward(d, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
      },
      "got a null one");
  expect_invalid_argument(
      [&] {
        launch_context_parallel_plan({.tokens = 30, .sequences = 1, .ranks = 4, .rank = 0}, nullptr, nullptr, nullptr,
                                     nullptr, nullptr);
      },
      "pad the batch to a multiple of 8");
}

}  // namespace
}  // namespace stepgraph::kernels
