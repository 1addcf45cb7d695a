#pragma once
// tests/backends.hpp: the generic harness, every test written once and run on every backend.
//
// A test over the scalar types and the backends is a
//
//     TEMPLATE_LIST_TEST_CASE("memory: chunked == loop", "[reference]", Both) {
//         using T = typename TestType::Scalar;
//         using Backend = typename TestType::Backend;
//         NeuralMemory<T, Backend> mem(cfg, params);   // ...
//     }
//
// and Catch2 runs it four times, named "<name> - Both - <i>": i = 0 float on the CPU, 1 double
// on the CPU, 2 float on the simulated device, 3 double on the simulated device (BothD: double
// only)
// (backend/simulated_device.hpp: the device's data is reachable only through its kernels and
// its transfer). The same seeds draw the same cases on both backends, so a device run checks
// the same numbers against the same reference as the CPU run.
#include "test_common.hpp"

#include "backend/simulated_device.hpp"

#include <tuple>

namespace titans_test {

/// A scalar type on a backend.
template <class T, class B>
struct On {
    using Scalar = T;
    using Backend = B;
};

/// What the generic tests run over: float and double, on the CPU and on the simulated device.
using Both = std::tuple<On<float, titans::backend::Cpu>, On<double, titans::backend::Cpu>,
                        On<float, SimulatedDevice>, On<double, SimulatedDevice>>;
/// Double on both (a test whose checks are exact, where float adds nothing): 0 the CPU, 1 the
/// simulated device.
using BothD = std::tuple<On<double, titans::backend::Cpu>, On<double, SimulatedDevice>>;

}  // namespace titans_test
