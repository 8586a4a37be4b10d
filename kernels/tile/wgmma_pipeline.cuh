// Hopper tile helpers: the tensor memory accelerator (TMA) loading 2-D
// boxes into 128-byte-swizzled shared memory, mbarriers that carry a stage
// from the loading thread to the warpgroups that consume it, and wgmma
// (m64n256k16 bf16 or m64n256k32 FP8 in, fp32 accumulators in registers) reading both operands
// from shared memory through matrix descriptors.
//
// Note [wgmma operand tiles]
// A K-major [rows][64] bf16 tile whose 16-byte chunk c of row r sits at
// chunk c ^ (r & 7), the tile 1024-byte aligned, is
// what a TMA box with CU_TENSOR_MAP_SWIZZLE_128B writes and what a wgmma
// descriptor with the 128-byte swizzle mode reads (8-row atoms of 1024
// bytes: stride byte offset 1024); the chunks one wave of a warp reads fall
// on distinct banks. The k16 slices of a tile start 32 bytes apart inside
// each 128-byte row. An MN-major tile ([k rows][64] of m or n) is swizzled
// the same way, row by row (wgmma_descriptor_mn_major).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace stepgraph::kernels::tile {

__device__ __forceinline__ std::uint32_t smem_address(const void* pointer) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(pointer));
}

// --- mbarrier ---------------------------------------------------------------

__device__ __forceinline__ void mbarrier_init(std::uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count));
}

// Makes initialized barriers visible to the async proxy (TMA) too.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(std::uint64_t* bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
}

// Waits until the phase with this parity has completed.
__device__ __forceinline__ void mbarrier_wait(std::uint64_t* bar, std::uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
}

// A ring of kStages slots, each with a full and an empty barrier: use n of
// the ring is slot n % kStages in phase n / kStages.
// The producer waits until use n may refill its slot (use n - kStages released).
template <int kStages>
__device__ __forceinline__ void ring_wait_empty(std::uint64_t* empty, int n) {
  if (n >= kStages) mbarrier_wait(&empty[n % kStages], ((n / kStages) & 1) ^ 1);
}
// A consumer waits until use n has landed.
template <int kStages>
__device__ __forceinline__ void ring_wait_full(std::uint64_t* full, int n) {
  mbarrier_wait(&full[n % kStages], (n / kStages) & 1);
}

// A consumer warp's release of use n: after __syncwarp (which orders every
// lane's reads of the slot before lane 0's arrival, the barrier's release),
// lane 0 arrives; the empty barriers count one arrival per reading warp.
template <int kStages>
__device__ __forceinline__ void ring_release(std::uint64_t* empty, int n) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbarrier_arrive(&empty[n % kStages]);
}

// --- TMA ----------------------------------------------------------------------

// Loads the box at (inner, outer) element coordinates of `map` into `dst`,
// completing `bytes` of the transaction count of `bar`. Out-of-bounds
// elements are zero-filled.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, std::uint64_t* bar, int inner,
                                            int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          smem_address(dst)),
      "l"(map), "r"(smem_address(bar)), "r"(inner), "r"(outer)
      : "memory");
}

// A 3-D box at (inner, middle, outer); out-of-bounds elements zero-filled.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, std::uint64_t* bar, int inner,
                                            int middle, int outer) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::
          "r"(smem_address(dst)),
      "l"(map), "r"(smem_address(bar)), "r"(inner), "r"(middle), "r"(outer)
      : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// --- wgmma ----------------------------------------------------------------------

// Descriptor of a K-major, 128-byte-swizzled tile at `tile` (See Note [wgmma operand tiles]).
__device__ __forceinline__ std::uint64_t wgmma_descriptor(const void* tile) {
  const std::uint64_t address = smem_address(tile);
  std::uint64_t desc = (address & 0x3FFFF) >> 4;  // start address
  desc |= std::uint64_t{1} << 16;                 // leading byte offset (unused with swizzling)
  desc |= std::uint64_t{1024 >> 4} << 32;         // stride byte offset: one 8-row atom
  desc |= std::uint64_t{1} << 62;                 // 128-byte swizzle
  return desc;
}

// Descriptor of an MN-major operand: [k][64] bf16 blocks of 64 MN elements
// (128-byte rows, 128-byte swizzle, 1024-byte aligned), `block_bytes` apart
// along MN; with the transpose bit the leading byte offset steps along MN and
// the stride byte offset along K (8 k-rows, 1024 bytes).
__device__ __forceinline__ std::uint64_t wgmma_descriptor_mn_major(const void* tile, std::uint32_t block_bytes) {
  const std::uint64_t address = smem_address(tile);
  std::uint64_t desc = (address & 0x3FFFF) >> 4;
  desc |= std::uint64_t{(block_bytes >> 4) & 0x3FFF} << 16;
  desc |= std::uint64_t{1024 >> 4} << 32;
  desc |= std::uint64_t{1} << 62;
  return desc;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// The 128 accumulator operands of an m64n256 wgmma: the register list of the
// instruction text and the asm output list.
#define SG_WGMMA_N256_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define SG_WGMMA_N256_ACC8(i)                                                                                \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define SG_WGMMA_N256_ACC32(i) \
  SG_WGMMA_N256_ACC8(i), SG_WGMMA_N256_ACC8(i + 8), SG_WGMMA_N256_ACC8(i + 16), SG_WGMMA_N256_ACC8(i + 24)
#define SG_WGMMA_N256_OUTPUTS \
  SG_WGMMA_N256_ACC32(0), SG_WGMMA_N256_ACC32(32), SG_WGMMA_N256_ACC32(64), SG_WGMMA_N256_ACC32(96)

// d (+)= A[64 x 16] B[256 x 16]^T from the two descriptors; scale_d = 0
// ignores d's old value. d: the warpgroup's 64 x 256 fp32 accumulators, 128
// per thread: d[j] is row (warp % 4) * 16 + lane / 4 + 8 * ((j / 2) % 2),
// column (j / 4) * 8 + (lane % 4) * 2 + j % 2.
// kTransB: B is N-major (wgmma_descriptor_mn_major) instead of K-major;
// kTransA: A is M-major likewise.
template <bool kTransB = false, bool kTransA = false>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], std::uint64_t desc_a, std::uint64_t desc_b,
                                                 int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " SG_WGMMA_N256_REGS
               ", %128, %129, p, 1, 1, %132, %131;\n}\n"
               : SG_WGMMA_N256_OUTPUTS
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB ? 1 : 0), "n"(kTransA ? 1 : 0));
}

// The FP8 forms: d (+)= A[64 x 32] B[N x 32]^T, B in E4M3, A in E5M2
// (kAE5M2) or E4M3, both K-major (FP8 wgmma has no transpose): a k32 slice
// is 32 bytes of each 128-byte row, so the descriptors step as bf16's k16
// slices do. The accumulators are laid out as wgmma_m64n256k16's; n128 (64
// a thread, the columns below 128) is the tile of a split-accumulation
// kernel, whose partial sums and fp32 totals both fit in registers.
// SG_WGMMA_FP8(N, ATYPE, REGS, OUTPUTS, scale-d operand, descriptor operands)
#define SG_WGMMA_N128_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define SG_WGMMA_N128_OUTPUTS SG_WGMMA_N256_ACC32(0), SG_WGMMA_N256_ACC32(32)
#define SG_WGMMA_FP8(N, ATYPE, REGS, OUTPUTS, SCALE, DESCS)                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SCALE ", 0;\n"                                           \
               "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32." ATYPE ".e4m3 " REGS ", " DESCS ", p, 1, 1;\n}\n" \
               : OUTPUTS                                                                                      \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d))

template <bool kAE5M2>
__device__ __forceinline__ void wgmma_m64n256k32_fp8(float (&d)[128], std::uint64_t desc_a, std::uint64_t desc_b,
                                                     int scale_d) {
  if constexpr (kAE5M2) {
    SG_WGMMA_FP8(256, "e5m2", SG_WGMMA_N256_REGS, SG_WGMMA_N256_OUTPUTS, "130", "%128, %129");
  } else {
    SG_WGMMA_FP8(256, "e4m3", SG_WGMMA_N256_REGS, SG_WGMMA_N256_OUTPUTS, "130", "%128, %129");
  }
}

template <bool kAE5M2>
__device__ __forceinline__ void wgmma_m64n128k32_fp8(float (&d)[64], std::uint64_t desc_a, std::uint64_t desc_b,
                                                     int scale_d) {
  if constexpr (kAE5M2) {
    SG_WGMMA_FP8(128, "e5m2", SG_WGMMA_N128_REGS, SG_WGMMA_N128_OUTPUTS, "66", "%64, %65");
  } else {
    SG_WGMMA_FP8(128, "e4m3", SG_WGMMA_N128_REGS, SG_WGMMA_N128_OUTPUTS, "66", "%64, %65");
  }
}

#undef SG_WGMMA_FP8
#undef SG_WGMMA_N128_OUTPUTS
#undef SG_WGMMA_N128_REGS
#undef SG_WGMMA_N256_OUTPUTS
#undef SG_WGMMA_N256_ACC32
#undef SG_WGMMA_N256_ACC8
#undef SG_WGMMA_N256_REGS

// Orders this thread's generic-proxy writes to shared memory (plain stores)
// before later async-proxy accesses (wgmma reads, TMA writes) of it.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// A barrier among `threads` threads (a multiple of 32) of the block on
// hardware barrier `id` (1-15; __syncthreads uses 0).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across the
// asynchronous wgmma boundaries.
template <int kCount>
__device__ __forceinline__ void fence_accumulators(float (&acc)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// --- warp specialisation ----------------------------------------------------------

// Moves a warpgroup's register budget (sm_90a; the kernel needs a register cap
// at entry, __launch_bounds__(threads, 1)). Every warp of the warpgroup calls it.
// setmaxnreg.inc waits until the block's warps have released, by
// setmaxnreg.dec, the registers it asks for: a split that asks for more than
// is released never finishes (the kernel hangs). A 384-thread block launched
// at 168 registers a thread (the most 64 Ki allows in steps of 8) fits when
// the producer warpgroup's release covers the consumer warpgroups' raise.
constexpr bool register_split_fits(int producer_registers, int consumer_registers, int consumer_warpgroups = 2) {
  constexpr int kLaunchRegisters = 168;
  return (kLaunchRegisters - producer_registers) * 128 >=
         (consumer_registers - kLaunchRegisters) * 128 * consumer_warpgroups;
}

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

}  // namespace stepgraph::kernels::tile
