#pragma once
// titans/fwd.hpp: forward declarations of the main templates, their default policies and the
// friendly aliases. Include <titans/titans.hpp> for the definitions.

namespace titans {

namespace backend {
struct Cpu;
}  // namespace backend

struct MemoryConfig;
template <class T>
struct MemoryParams;
template <class T>
struct Diagnostics;
template <class T>
class MemoryState;
template <class T, class Backend = backend::Cpu>
class NeuralMemory;

using NeuralMemoryf = NeuralMemory<float>;
using NeuralMemoryd = NeuralMemory<double>;
using MemoryParamsf = MemoryParams<float>;
using MemoryParamsd = MemoryParams<double>;

}  // namespace titans
