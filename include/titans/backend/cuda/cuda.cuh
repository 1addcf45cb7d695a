#pragma once
// titans/backend/cuda/cuda.cuh: the CUDA backend policy. Include it (from a .cu translation
// unit, compiled by nvcc with --extended-lambda; target titans::cuda) and name
// titans::backend::Cuda as a layer's Backend:
//
//     #include <titans/titans.hpp>
//     #include <titans/backend/cuda/cuda.cuh>
//     titans::NeuralMemory<float, titans::backend::Cuda> mem(cfg, params);
//     auto st = mem.make_state(64);           // device state, own stream and cuBLAS handle
//     Matrixf y = mem.forward(st, x);         // x uploaded, y downloaded once per call
//
// Covered: the neural memory (every mode of math §1-5, forward; the training forward and
// backward of math §9, chained pieces included), the attention layer (forward, and the
// training forward and backward of math §9, chained pieces included), RMSNorm and FeedForward
// (forward and backward), the glue between layers (glue_kernels.cuh). Block<T, Cuda> and
// Model<T, Cuda> keep a forward's activations on the GPU (one upload, one download per model
// call; MAC's segment attention still runs on the host); their training passes run every
// sub-layer on the GPU, every block kind (MAC through the memory's staged reverse), with the
// glue between them on the host for now (docs/cuda.md).
//
// Outside nvcc the backend compiles only under TITANS_CUDA_EMULATION, the CPU emulation of
// the CUDA runtime and cuBLAS that the tests use where there is no GPU (tests/cuda/emulation/).

#include "../../config.hpp"

#if !TITANS_CUDA_DEVICE_CODE
#error "titans/backend/cuda/cuda.cuh is for CUDA translation units (nvcc); use the CPU backend elsewhere"
#endif

#include <type_traits>

#include "../backend.hpp"

namespace titans::backend {

/// Tag type of the CUDA backend: cuBLAS for the products, kernels of ours for the rest;
/// states and outputs in device memory, host matrices moved at the API edge (edge.hpp).
struct Cuda {
    static constexpr const char* name = "cuda";
};

template <>
struct BackendTraits<Cuda> {
    static constexpr bool host_accessible = false;
    template <class T>
    static constexpr bool supports = std::is_same_v<T, float> || std::is_same_v<T, double>;
};

}  // namespace titans::backend

#include "runtime.cuh"
#include "call_graph.cuh"
#include "transfer.cuh"
#include "memory_kernels.cuh"
#include "layer_kernels.cuh"
#include "glue_kernels.cuh"
#include "attention_kernels.cuh"
#include "attention_training.cuh"
#include "memory_training.cuh"
