// Compiler and host/device configuration shared by every kvsift header.
#pragma once

// One header serves host code and CUDA kernels (the CuTe `CUTE_HOST_DEVICE` idea): functions marked
// KVSIFT_HOST_DEVICE compile for both when nvcc sees them and as plain inline host code otherwise.
#if defined(__CUDACC__)
#define KVSIFT_HOST_DEVICE __host__ __device__ __forceinline__
#define KVSIFT_DEVICE __device__ __forceinline__
#else
#define KVSIFT_HOST_DEVICE inline
#define KVSIFT_DEVICE inline
#endif

#define KVSIFT_VERSION_MAJOR 0
#define KVSIFT_VERSION_MINOR 1
#define KVSIFT_VERSION_PATCH 0
