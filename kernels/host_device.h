// SG_HOST_DEVICE: a function compiled for the host and, under nvcc, for the
// device too, so a host reference runs exactly the device's arithmetic.
#pragma once

#if defined(__CUDACC__)
#define SG_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SG_HOST_DEVICE inline
#endif
