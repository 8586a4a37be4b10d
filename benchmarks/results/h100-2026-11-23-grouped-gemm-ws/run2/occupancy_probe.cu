// Diagnostic: how many clusters of 1 and 2 blocks of the warp-specialised
// kernels' shape (384 threads, ~197 KiB shared) the occupancy API admits.
#include <cstdio>
#include <cuda_runtime.h>
__global__ void __launch_bounds__(384, 1) k(int* p) { extern __shared__ int s[]; if (p) p[0] = s[threadIdx.x]; }
int main() {
  const int smem = 1024 + 4 * 48 * 1024 + 128 + 2 * 4 * 129;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  for (int c : {1, 2}) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(132 / c * c); cfg.blockDim = dim3(384); cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute a = {}; a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = c; a.val.clusterDim.y = 1; a.val.clusterDim.z = 1;
    cfg.attrs = &a; cfg.numAttrs = 1;
    int n = -1; cudaError_t e = cudaOccupancyMaxActiveClusters(&n, (void*)k, &cfg);
    std::printf("cluster %d: max active clusters %d (%s)\n", c, n, cudaGetErrorString(e));
  }
}
