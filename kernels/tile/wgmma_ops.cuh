// wgmma at the widths the attention kernels use: m64nNk16 for N = 64 and
// 128, bf16 or fp16 in, fp32 accumulators, with A read from shared memory
// through a descriptor (ss; M-major with kTransA) or from registers (rs), and
// B from a descriptor (K-major, or N-major with kTransB; descriptors from
// wgmma_pipeline.cuh).
//
// Accumulators: the warpgroup's 64 x N fp32 tile, N / 2 per thread, laid out
// as mma.sync's m16n8 accumulators side by side: thread lane of warp w holds
// in d[4 t + e] the element at row 16 (w % 4) + lane / 4 + 8 (e / 2), column
// 8 t + 2 (lane % 4) + e % 2. The register A operand of rs is mma.sync's
// m16k16 A fragment of the warp's 16 rows, so accumulator pairs convert to it
// directly (tile::accumulators_to_a).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace stepgraph::kernels::tile {

template <typename T, int N>
struct Wgmma;

// Operand lists of 32 and 64 accumulators, read-write ("+f") or write-only ("=f").
#define SG_WGMMA_ACC8(c, i) \
  c(d[i]), c(d[i + 1]), c(d[i + 2]), c(d[i + 3]), c(d[i + 4]), c(d[i + 5]), c(d[i + 6]), c(d[i + 7])
#define SG_WGMMA_ACC32(c) SG_WGMMA_ACC8(c, 0), SG_WGMMA_ACC8(c, 8), SG_WGMMA_ACC8(c, 16), SG_WGMMA_ACC8(c, 24)
#define SG_WGMMA_ACC64(c) \
  SG_WGMMA_ACC32(c), SG_WGMMA_ACC8(c, 32), SG_WGMMA_ACC8(c, 40), SG_WGMMA_ACC8(c, 48), SG_WGMMA_ACC8(c, 56)
#define SG_WGMMA_ACC32_STR                                                                                    \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SG_WGMMA_ACC64_STR                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "   \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, " \
  "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// One specialisation: CTYPE/PTX the element type, N the width, ACC/ACC_STR
// its accumulator operands, I0..I6 the operand numbers after them (as
// strings: nvcc's inline asm has no named operands).
//  - ss: d (+)= A B, A and B from descriptors; scale_d = 0 ignores d's old value.
//  - ss_overwrite: d = A B. Its accumulators are write-only operands, so the
//    compiler holds no register for d before it (ss reads d as far as the
//    compiler knows, even with scale_d = 0, which keeps d live back to its
//    previous use: registers a loop cannot always spare).
//  - rs: d (+)= A B, A from registers.
#define SG_DEFINE_WGMMA(CTYPE, PTX, N, ACC, ACC_STR, I0, I1, I2, I3, I4, I5, I6)                                  \
  template <>                                                                                                    \
  struct Wgmma<CTYPE, N> {                                                                                       \
    static constexpr int kAccumulators = N / 2;                                                                  \
    template <bool kTransB, bool kTransA = false>                                                                \
    __device__ __forceinline__ static void ss(float (&d)[N / 2], std::uint64_t desc_a, std::uint64_t desc_b,     \
                                              int scale_d) {                                                     \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I2                                                      \
                   ", 0;\n"                                                                                      \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " " ACC_STR ", %" I0 ", %" I1  \
                   ", p, 1, 1, %" I3 ", %" I4 ";\n}\n"                                                           \
                   : ACC("+f")                                                                                   \
                   : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA ? 1 : 0), "n"(kTransB ? 1 : 0));        \
    }                                                                                                            \
    template <bool kTransB, bool kTransA = false>                                                                \
    __device__ __forceinline__ static void ss_overwrite(float (&d)[N / 2], std::uint64_t desc_a,                 \
                                                        std::uint64_t desc_b) {                                  \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I2                                                      \
                   ", 0;\n"                                                                                      \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " " ACC_STR ", %" I0 ", %" I1  \
                   ", p, 1, 1, %" I3 ", %" I4 ";\n}\n"                                                           \
                   : ACC("=f")                                                                                   \
                   : "l"(desc_a), "l"(desc_b), "r"(0), "n"(kTransA ? 1 : 0), "n"(kTransB ? 1 : 0));              \
    }                                                                                                            \
    template <bool kTransB>                                                                                      \
    __device__ __forceinline__ static void rs(float (&d)[N / 2], const std::uint32_t (&a)[4],                    \
                                              std::uint64_t desc_b, int scale_d) {                               \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I5                                                      \
                   ", 0;\n"                                                                                      \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " " ACC_STR ", {%" I0 ", %" I1 \
                   ", %" I2 ", %" I3 "}, %" I4 ", p, 1, 1, %" I6 ";\n}\n"                                        \
                   : ACC("+f")                                                                                   \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d),                      \
                     "n"(kTransB ? 1 : 0));                                                                      \
    }                                                                                                            \
  };

SG_DEFINE_WGMMA(__nv_bfloat16, "bf16", 64, SG_WGMMA_ACC32, SG_WGMMA_ACC32_STR, "32", "33", "34", "35", "36", "37", "38")
SG_DEFINE_WGMMA(__half, "f16", 64, SG_WGMMA_ACC32, SG_WGMMA_ACC32_STR, "32", "33", "34", "35", "36", "37", "38")
SG_DEFINE_WGMMA(__nv_bfloat16, "bf16", 128, SG_WGMMA_ACC64, SG_WGMMA_ACC64_STR, "64", "65", "66", "67", "68", "69", "70")
SG_DEFINE_WGMMA(__half, "f16", 128, SG_WGMMA_ACC64, SG_WGMMA_ACC64_STR, "64", "65", "66", "67", "68", "69", "70")

#undef SG_DEFINE_WGMMA
#undef SG_WGMMA_ACC64_STR
#undef SG_WGMMA_ACC32_STR
#undef SG_WGMMA_ACC64
#undef SG_WGMMA_ACC32
#undef SG_WGMMA_ACC8

}  // namespace stepgraph::kernels::tile
