// Hopper tile helpers: the tensor memory accelerator (TMA) loading 2-D
// boxes into 128-byte-swizzled shared memory, mbarriers that carry a stage
// from the loading thread to the warpgroups that consume it, and wgmma
// (m64n256k16, bf16 in, fp32 accumulators in registers) reading both operands
// from shared memory through matrix descriptors.
//
// Note [wgmma operand tiles]: a K-major [rows][64] bf16 tile whose 16-byte
// chunk c of row r sits at chunk c ^ (r & 7), the tile 1024-byte aligned, is
// what a TMA box with CU_TENSOR_MAP_SWIZZLE_128B writes and what a wgmma
// descriptor with the 128-byte swizzle mode reads (8-row atoms of 1024
// bytes: stride byte offset 1024), the swizzle of Note [Swizzled operand
// tiles] (mma_pipeline.cuh) on K-major rows.
// The k16 slices of a tile start 32 bytes apart inside each 128-byte row.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/tile/mma_pipeline.cuh"

namespace stepgraph::kernels::tile {

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

// d (+)= A[64 x 16] B[256 x 16]^T from the two descriptors; scale_d = 0
// ignores d's old value. d: the warpgroup's 64 x 256 fp32 accumulators, 128
// per thread: d[j] is row (warp % 4) * 16 + lane / 4 + 8 * ((j / 2) % 2),
// column (j / 4) * 8 + (lane % 4) * 2 + j % 2.
// kTransB: B is N-major (wgmma_descriptor_mn_major) instead of K-major.
template <bool kTransB = false>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], std::uint64_t desc_a, std::uint64_t desc_b,
                                                 int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "
      "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, "
      "%68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, "
      "%90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, "
      "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, 0, %131;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]),
        "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]),
        "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]),
        "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]),
        "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]),
        "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),
        "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]),
        "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]),
        "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB ? 1 : 0));
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
