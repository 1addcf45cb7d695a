#pragma once
// titans/config.hpp: build-wide macros shared by host and (later) device code.
//
// TITANS_HOST_DEVICE marks small math that both the CPU backend and a CUDA translation unit
// compile (gates, activations, chunk coefficients). Under nvcc it is `__host__ __device__`;
// everywhere else it is plain `inline`.
//
// TITANS_CUDA_DEVICE_CODE is 1 where the CUDA backend's device code (its kernels and
// __device__ lambdas, backend/cuda/) is compiled: under nvcc, and under TITANS_CUDA_EMULATION,
// the CPU emulation of the CUDA runtime that runs that code on the host in CI
// (tests/cuda/emulation/). It is 0 elsewhere.

#define TITANS_VERSION_MAJOR 0
#define TITANS_VERSION_MINOR 1
#define TITANS_VERSION_PATCH 0

#if defined(__CUDACC__)
#define TITANS_HOST_DEVICE __host__ __device__ inline
#else
#define TITANS_HOST_DEVICE inline
#endif

#if defined(__CUDACC__) || defined(TITANS_CUDA_EMULATION)
#define TITANS_CUDA_DEVICE_CODE 1
#else
#define TITANS_CUDA_DEVICE_CODE 0
#endif

#if defined(_OPENMP)
#define TITANS_HAS_OPENMP 1
#else
#define TITANS_HAS_OPENMP 0
#endif
