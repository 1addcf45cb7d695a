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

// Attention (titans/attention/attention.hpp) and the basic layers (titans/layers/).
struct AttentionConfig;
template <class T>
struct AttentionParams;
template <class T>
class AttentionState;
template <class T, class Backend = backend::Cpu>
class Attention;
template <class T, class Backend = backend::Cpu>
class RMSNorm;
struct FeedForwardConfig;
template <class T>
struct FeedForwardParams;
template <class T, class Backend = backend::Cpu>
class FeedForward;
template <class T, class Backend = backend::Cpu>
class PersistentMemory;

using Attentionf = Attention<float>;
using Attentiond = Attention<double>;
using AttentionParamsf = AttentionParams<float>;
using AttentionParamsd = AttentionParams<double>;
using RMSNormf = RMSNorm<float>;
using RMSNormd = RMSNorm<double>;
using FeedForwardf = FeedForward<float>;
using FeedForwardd = FeedForward<double>;
using FeedForwardParamsf = FeedForwardParams<float>;
using FeedForwardParamsd = FeedForwardParams<double>;
using PersistentMemoryf = PersistentMemory<float>;
using PersistentMemoryd = PersistentMemory<double>;

// Training (titans/train/).
struct AdamWConfig;
template <class T>
class AdamW;
struct WarmupCosine;
struct TrainerConfig;
struct TrainerProgress;
template <class T, class Backend = backend::Cpu>
class Trainer;

using Trainerf = Trainer<float>;
using Trainerd = Trainer<double>;

}  // namespace titans
