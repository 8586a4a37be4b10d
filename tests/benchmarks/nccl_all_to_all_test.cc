// ep_exchange_bench's NCCL reference (benchmarks/nccl_all_to_all.h): on a
// GPU, a one-rank NCCL world's all-to-all with host counts moves the rows to
// and from this rank at their offsets, there and back bit for bit, and bad
// counts are refused; without a GPU the constructor names --reference none.
#include "benchmarks/nccl_all_to_all.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/device.h"
#include "engine/host_world.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"

namespace stepgraph::bench {
namespace {

TEST(NcclAllToAllGpuTest, OneRankMovesRowsToTheirOffsetsAndBack) {
  SG_SKIP_WITHOUT_GPU();
  HostWorld::run(1, [](Communicator& world) {
    NcclAllToAll nccl(world);
    constexpr std::int64_t kRows = 6, kRowBytes = 8;
    std::vector<std::uint8_t> x(kRows * kRowBytes);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<std::uint8_t>(i * 7 + 1);
    void *send = nullptr, *recv = nullptr, *back = nullptr;
    SG_CUDA_CHECK(cudaMalloc(&send, x.size()));
    SG_CUDA_CHECK(cudaMalloc(&recv, 2 * x.size()));
    SG_CUDA_CHECK(cudaMalloc(&back, x.size()));
    SG_CUDA_CHECK(cudaMemcpy(send, x.data(), x.size(), cudaMemcpyHostToDevice));
    SG_CUDA_CHECK(cudaMemset(recv, 0, 2 * x.size()));
    cudaStream_t stream = nullptr;
    SG_CUDA_CHECK(cudaStreamCreate(&stream));
    // Rows 2.. of x to this rank's receive buffer at row 3, then back to row 2 of `back`.
    nccl.run(send, {4}, {2}, recv, {4}, {3}, kRowBytes, stream);
    nccl.run(recv, {4}, {3}, back, {4}, {2}, kRowBytes, stream);
    SG_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<std::uint8_t> received(2 * x.size()), returned(x.size());
    SG_CUDA_CHECK(cudaMemcpy(received.data(), recv, received.size(), cudaMemcpyDeviceToHost));
    SG_CUDA_CHECK(cudaMemcpy(returned.data(), back, returned.size(), cudaMemcpyDeviceToHost));
    EXPECT_TRUE(std::equal(x.begin() + 2 * kRowBytes, x.end(), received.begin() + 3 * kRowBytes));
    EXPECT_EQ(received[3 * kRowBytes - 1], 0) << "nothing before the receive offset";
    EXPECT_TRUE(std::equal(x.begin() + 2 * kRowBytes, x.end(), returned.begin() + 2 * kRowBytes));
    EXPECT_ERROR_CONTAINS(nccl.run(send, {4, 1}, {0, 4}, recv, {4}, {0}, kRowBytes, stream),
                          "counts and offsets need one entry per rank (1)");
    SG_CUDA_CHECK(cudaStreamDestroy(stream));
    SG_CUDA_CHECK(cudaFree(send));
    SG_CUDA_CHECK(cudaFree(recv));
    SG_CUDA_CHECK(cudaFree(back));
  });
}

TEST(NcclAllToAllTest, WithoutAGpuNamesTheFlag) {
  if (cuda_device_count().count > 0) GTEST_SKIP() << "this machine has a GPU";
  HostWorld::run(1, [](Communicator& world) {
    EXPECT_ERROR_CONTAINS(NcclAllToAll{world}, "NCCL's all-to-all reference needs a GPU", "pass --reference none");
  });
}

}  // namespace
}  // namespace stepgraph::bench
