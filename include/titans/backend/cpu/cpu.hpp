#pragma once
// titans/backend/cpu/cpu.hpp: the CPU backend policy (Eigen, SIMD; OpenMP across sequences
// and heads when the translation unit is compiled with OpenMP).

#include "../backend.hpp"

namespace titans::backend {

/// Tag type of the CPU backend: Eigen for the products, plain loops for the rest.
struct Cpu {
    static constexpr const char* name = "cpu";
};

template <>
struct BackendTraits<Cpu> {
    static constexpr bool host_accessible = true;
    template <class T>
    static constexpr bool supports = std::is_same_v<T, float> || std::is_same_v<T, double>;
};

}  // namespace titans::backend

#include "transfer.hpp"
#include "attention_kernels.hpp"
#include "attention_training.hpp"
#include "glue_kernels.hpp"
#include "layer_kernels.hpp"
#include "memory_kernels.hpp"
#include "memory_training.hpp"
