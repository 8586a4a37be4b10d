// The CUDA kernels of kernels/rope.h: one thread per rotated pair (or
// passed-through feature) of one token and a few of its heads; the
// token's position comes from cu_seqlens on the device
// (packed_sequences.cuh), or from a positions table where one is given. A
// thread takes a pair of up to kMaxHeadsPerThread heads and computes the
// position and angle once for them, with the float operations of one
// thread per head, so the bits are the same: one thread
// per pair of every head spent its time recomputing them (benchmarks/
// README.md, "The rotary split and merge").
//
// One kernel serves every entry point: it moves heads between a "packed"
// layout [T, H + 2 Hkv, D] and the separate q [T, H, D], k [T, Hkv, D],
// v [T, Hkv, D], rotating q and k by +angle (forward) or -angle (backward).
// rope_forward/backward are the packed -> q case with Hkv = 0, where the two
// layouts coincide, so out may alias x.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "engine/cuda_check.h"
#include "kernels/launch_config.cuh"
#include "kernels/packed_sequences.cuh"
#include "kernels/rope.h"
#include "kernels/rope_theta.h"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

struct RopeShape {
  int tokens;
  int sequences;
  int heads;
  int kv_heads;
  int head_dim;
  int half;        // rotated / 2
  int per_head;    // threads per head: half pairs + (head_dim - rotated) passed-through features
  double log2_base;  // of the base, for rope_theta
  float sign;      // +1 forward, -1 backward
  bool to_packed;  // q, k, v -> packed (the backward's merge); else packed -> q, k, v
  int heads_per_thread;
};

// Heads per thread: the angle is computed once for them, so up to 8; fewer
// where that would leave under kTargetThreads threads (short steps: small's
// 256 tokens x 32 pairs x 24 heads get one head a thread, as before).
constexpr int kMaxHeadsPerThread = 8;
constexpr std::int64_t kTargetThreads = 132 * 1024;

template <typename T>
__global__ void rope_heads_kernel(RopeShape s, const std::int32_t* cu_seqlens, const std::int32_t* positions,
                                  const T* packed_in, T* packed_out, const T* q_in, const T* k_in, const T* v_in,
                                  T* q_out, T* k_out, T* v_out) {
  const int width = s.heads + 2 * s.kv_heads;
  const int chunks = (width + s.heads_per_thread - 1) / s.heads_per_thread;
  const std::int64_t n = static_cast<std::int64_t>(s.tokens) * chunks * s.per_head;
  grid_stride(n, [&](std::int64_t i) {
    const int j = static_cast<int>(i % s.per_head);
    const std::int64_t token_chunk = i / s.per_head;
    const int first_head = static_cast<int>(token_chunk % chunks) * s.heads_per_thread;
    const int t = static_cast<int>(token_chunk / chunks);
    // The angle depends on the token's position and the pair only: computed
    // once here for this thread's heads.
    float sn = 0.0f, c = 1.0f;
    const bool rotated = j < s.half;
    if (rotated) {
      const int position =
          positions != nullptr ? positions[t] : t - sequence_start_of(cu_seqlens, s.sequences, s.tokens, t);
      const float theta = rope_theta(j, 2 * s.half, s.log2_base);
      sincosf(static_cast<float>(position) * theta, &sn, &c);
      sn *= s.sign;
    }
#pragma unroll 8
    for (int step = 0; step < s.heads_per_thread; ++step) {
      const int g = first_head + step;
      if (g >= width) break;
      const int part = g < s.heads ? 0 : (g < s.heads + s.kv_heads ? 1 : 2);
      const int h = part == 0 ? g : (part == 1 ? g - s.heads : g - s.heads - s.kv_heads);
      const std::int64_t packed_at = (static_cast<std::int64_t>(t) * width + g) * s.head_dim;
      const std::int64_t at = (static_cast<std::int64_t>(t) * (part == 0 ? s.heads : s.kv_heads) + h) * s.head_dim;
      const T* in = s.to_packed ? (part == 0 ? q_in : (part == 1 ? k_in : v_in)) + at : packed_in + packed_at;
      T* out = s.to_packed ? packed_out + packed_at : (part == 0 ? q_out : (part == 1 ? k_out : v_out)) + at;
      if (!rotated) {  // a feature past the rotated ones: copied
        const int f = s.half + j;
        out[f] = in[f];
      } else if (part == 2) {  // v: copied
        out[j] = in[j];
        out[j + s.half] = in[j + s.half];
      } else {
        const float a = to_float(in[j]);
        const float b = to_float(in[j + s.half]);
        out[j] = from_float<T>(a * c - b * sn);
        out[j + s.half] = from_float<T>(b * c + a * sn);
      }
    }
  });
}

RopeShape shape_of(const RopeDesc& d, std::int64_t kv_heads, float sign, bool to_packed) {
  SG_CHECK(d.tokens * (d.heads + 2 * kv_heads) * d.head_dim < (std::int64_t{1} << 31), "rope: ", d.tokens,
           " tokens of ", d.heads + 2 * kv_heads, " heads of ", d.head_dim, " exceed the kernel's int32 indexing");
  const int half = static_cast<int>(d.rotated() / 2);
  const int per_head = half + static_cast<int>(d.head_dim - d.rotated());
  const std::int64_t one_per_head = d.tokens * (d.heads + 2 * kv_heads) * per_head;
  const int heads_per_thread =
      static_cast<int>(std::clamp<std::int64_t>(one_per_head / kTargetThreads, 1, kMaxHeadsPerThread));
  return RopeShape{.tokens = static_cast<int>(d.tokens),
                   .sequences = static_cast<int>(d.sequences),
                   .heads = static_cast<int>(d.heads),
                   .kv_heads = static_cast<int>(kv_heads),
                   .head_dim = static_cast<int>(d.head_dim),
                   .half = half,
                   .per_head = per_head,
                   .log2_base = std::log2(static_cast<double>(d.base)),
                   .sign = sign,
                   .to_packed = to_packed,
                   .heads_per_thread = heads_per_thread};
}

template <typename T>
void launch_typed(const RopeShape& s, const std::int32_t* cu_seqlens, const std::int32_t* positions,
                  const void* packed_in, void* packed_out, const void* q_in, const void* k_in, const void* v_in,
                  void* q_out, void* k_out, void* v_out, CUstream_st* stream) {
  const int chunks = (s.heads + 2 * s.kv_heads + s.heads_per_thread - 1) / s.heads_per_thread;
  const std::int64_t n = static_cast<std::int64_t>(s.tokens) * chunks * s.per_head;
  rope_heads_kernel<T><<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(
      s, cu_seqlens, positions, static_cast<const T*>(packed_in), static_cast<T*>(packed_out),
      static_cast<const T*>(q_in), static_cast<const T*>(k_in), static_cast<const T*>(v_in), static_cast<T*>(q_out),
      static_cast<T*>(k_out), static_cast<T*>(v_out));
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch(DType dtype, const RopeShape& s, const std::int32_t* cu_seqlens, const std::int32_t* positions,
            const void* packed_in, void* packed_out, const void* q_in, const void* k_in, const void* v_in, void* q_out,
            void* k_out, void* v_out, CUstream_st* stream) {
  switch (dtype) {
    case DType::kFloat32:
      return launch_typed<float>(s, cu_seqlens, positions, packed_in, packed_out, q_in, k_in, v_in, q_out, k_out, v_out,
                                 stream);
    case DType::kBFloat16:
      return launch_typed<__nv_bfloat16>(s, cu_seqlens, positions, packed_in, packed_out, q_in, k_in, v_in, q_out,
                                         k_out, v_out, stream);
    case DType::kFloat16:
      return launch_typed<__half>(s, cu_seqlens, positions, packed_in, packed_out, q_in, k_in, v_in, q_out, k_out,
                                  v_out, stream);
    default:
      SG_THROW(ErrorCode::kInvalidArgument, "rope: unsupported dtype ", dtype_name(dtype));
  }
}

}  // namespace

void launch_rope_forward(const RopeDesc& desc, const void* x, const std::int32_t* cu_seqlens, void* out,
                         CUstream_st* stream) {
  check_rope(desc);
  launch(desc.dtype, shape_of(desc, 0, 1.0f, false), cu_seqlens, nullptr, x, nullptr, nullptr, nullptr, nullptr, out,
         nullptr, nullptr, stream);
}

void launch_rope_backward(const RopeDesc& desc, const void* dy, const std::int32_t* cu_seqlens, void* dx,
                          CUstream_st* stream) {
  check_rope(desc);
  launch(desc.dtype, shape_of(desc, 0, -1.0f, false), cu_seqlens, nullptr, dy, nullptr, nullptr, nullptr, nullptr, dx,
         nullptr, nullptr, stream);
}

void launch_qkv_split_rope(const RopeDesc& desc, std::int64_t kv_heads, const void* qkv,
                           const std::int32_t* cu_seqlens, void* q, void* k, void* v, CUstream_st* stream) {
  check_qkv_rope(desc, kv_heads);
  launch(desc.dtype, shape_of(desc, kv_heads, 1.0f, false), cu_seqlens, nullptr, qkv, nullptr, nullptr, nullptr,
         nullptr, q, k, v, stream);
}

void launch_qkv_merge_rope_backward(const RopeDesc& desc, std::int64_t kv_heads, const void* dq, const void* dk,
                                    const void* dv, const std::int32_t* cu_seqlens, void* dqkv,
                                    CUstream_st* stream) {
  check_qkv_rope(desc, kv_heads);
  launch(desc.dtype, shape_of(desc, kv_heads, -1.0f, true), cu_seqlens, nullptr, nullptr, dqkv, dq, dk, dv, nullptr,
         nullptr, nullptr, stream);
}

void launch_qkv_split_rope_at(const RopeDesc& desc, std::int64_t kv_heads, const void* qkv,
                              const std::int32_t* positions, void* q, void* k, void* v, CUstream_st* stream) {
  check_qkv_rope(desc, kv_heads);
  launch(desc.dtype, shape_of(desc, kv_heads, 1.0f, false), nullptr, positions, qkv, nullptr, nullptr, nullptr, nullptr,
         q, k, v, stream);
}

void launch_qkv_merge_rope_backward_at(const RopeDesc& desc, std::int64_t kv_heads, const void* dq, const void* dk,
                                       const void* dv, const std::int32_t* positions, void* dqkv, CUstream_st* stream) {
  check_qkv_rope(desc, kv_heads);
  launch(desc.dtype, shape_of(desc, kv_heads, -1.0f, true), nullptr, positions, nullptr, dqkv, dq, dk, dv, nullptr,
         nullptr, nullptr, stream);
}

}  // namespace stepgraph::kernels
