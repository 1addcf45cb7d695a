#pragma once
// tests/trainer_common.hpp: what the Trainer tests share: bitwise comparisons of parameters,
// optimisers and progress, the batch of a step, small trainable model cases, and the training
// step written out by hand (a model rebuilt from the parameters, forward, cross-entropy,
// backward, clipping, AdamW) that the Trainer must equal bit for bit.
#include "block_cases.hpp"

#include <titans/train/trainer.hpp>

#include <cstring>
#include <string>
#include <vector>

namespace titans_test {

using titans::AdamW;
using titans::Trainer;
using titans::TrainerConfig;
using titans::TrainerProgress;

/// Every tensor `cfg` uses has the same name, shape and bytes in a and b (any parameter
/// struct: ModelParams, BlockParams, ...).
template <class Params, class Config>
bool same_param_bits(const Params& a, const Params& b, const Config& cfg) {
    using T = typename titans::detail::ParamsScalar<Params>::type;
    const auto sa = titans::detail::tensor_slots(a, cfg);
    const auto sb = titans::detail::tensor_slots(b, cfg);
    if (sa.size() != sb.size()) return false;
    for (std::size_t i = 0; i < sa.size(); ++i) {
        if (sa[i].name != sb[i].name || sa[i].rows != sb[i].rows || sa[i].cols != sb[i].cols ||
            (sa[i].size() > 0 &&  // an empty tensor's data may be null: nothing to compare
             std::memcmp(sa[i].data, sb[i].data,
                         static_cast<std::size_t>(sa[i].size()) * sizeof(T)) != 0)) {
            return false;
        }
    }
    return true;
}

/// Same steps, settings and moments (names, shapes, bytes).
template <class T>
bool same_optimizer(const AdamW<T>& a, const AdamW<T>& b) {
    if (a.steps() != b.steps() || a.moments().size() != b.moments().size()) return false;
    const titans::AdamWConfig &ca = a.config(), &cb = b.config();
    if (ca.beta1 != cb.beta1 || ca.beta2 != cb.beta2 || ca.eps != cb.eps ||
        ca.weight_decay != cb.weight_decay || ca.decay_vectors != cb.decay_vectors) {
        return false;
    }
    auto ib = b.moments().begin();
    for (const auto& [name, mo] : a.moments()) {
        if (name != ib->first || !identical(mo.m, ib->second.m) || !identical(mo.v, ib->second.v)) {
            return false;
        }
        ++ib;
    }
    return true;
}

inline bool same_progress(const TrainerProgress& a, const TrainerProgress& b) {
    return a.data_position == b.data_position && a.loss == b.loss &&
           a.gradient_norm == b.gradient_norm && a.learning_rate == b.learning_rate;
}

/// The whole of two trainers: parameters, optimiser, progress.
template <class T, class B>
bool same_trainers(const Trainer<T, B>& a, const Trainer<T, B>& b) {
    return same_param_bits(a.params(), b.params(), a.model().config()) &&
           same_optimizer(a.optimizer(), b.optimizer()) && same_progress(a.progress(), b.progress());
}

/// The data of one step: B sequences of N ids and one label per id, about a third of them
/// negative (not scored), drawn from the step's own seed.
struct StepData {
    std::vector<int> ids, labels;
};

inline StepData step_data(const std::string& name, std::uint64_t step, int B, int N, int vocab) {
    Rng rng(seed_for(name, step));
    StepData d;
    d.ids = random_ids(rng, B * N, vocab);
    for (int i = 0; i < B * N; ++i) {
        d.labels.push_back(uniform_int(rng, 0, 2) == 0 ? -1 : uniform_int(rng, 0, vocab - 1));
    }
    return d;
}

/// A trainable 2-layer model of the given kinds (random memory modes, width 8), in T.
template <class T>
ModelCase trainer_model_case(BlockKind k0, BlockKind k1, int vocab, Rng& rng) {
    return make_model_case<T>(k0, k1, 8, vocab, 0, rng);
}

/// Settings that exercise every part: warm-up then decay, decoupled decay of vectors too.
inline TrainerConfig trainer_test_config(double clip_norm) {
    TrainerConfig c;
    c.adamw = {.beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1,
               .decay_vectors = true};
    c.schedule = {.peak = 2e-2, .warmup = 2, .total = 6, .floor = 0.2};
    c.clip_norm = clip_norm;
    return c;
}

/// The step written out by hand, as examples/06 wrote it before the Trainer: a model built
/// from the parameters, a fresh state, the training forward, cross-entropy, backward, global
/// clipping, AdamW at the schedule's rate. Returns the loss; norm and lr of the step.
template <class T>
double hand_step(const ModelConfig& cfg, ModelParams<T>& p, AdamW<T>& opt,
                 const TrainerConfig& tc, const StepData& d, int B, double& norm, double& lr) {
    const titans::Model<T> model(cfg, p);
    auto state = model.make_state(B);
    typename titans::Model<T>::Trace trace;
    Matrix<T> logits, dlogits;
    model.forward_tokens(state, d.ids, logits, trace);
    const double loss = titans::cross_entropy_loss<T>(logits, d.labels, dlogits);
    auto g = ModelParams<T>::zeros(cfg);
    model.backward(trace, dlogits, g);
    norm = tc.clip_norm > 0 ? titans::clip_gradient_norm(g, cfg, tc.clip_norm)
                            : titans::gradient_norm(g, cfg);
    lr = tc.schedule(opt.steps() + 1);
    opt.step(p, g, cfg, lr);
    return loss;
}

/// Whether models a and b give the same loss and the same gradients, bit for bit, on ids and
/// labels from fresh states of B sequences (the training forward, cross-entropy, backward).
template <class T, class Backend>
bool same_training(const titans::Model<T, Backend>& a, const titans::Model<T, Backend>& b, int B,
                   const std::vector<int>& ids, const std::vector<int>& labels) {
    titans::ModelGradients<T, Backend> ga(a), gb(b);
    typename titans::Model<T, Backend>::Trace ta, tb;
    auto sa = a.make_state(B), sb = b.make_state(B);
    const bool same_loss = a.forward_loss(sa, ids, labels, ta) == b.forward_loss(sb, ids, labels, tb);
    a.backward_loss(ta, ga);
    b.backward_loss(tb, gb);
    return same_loss && same_param_bits(ga.to_params(), gb.to_params(), a.config());
}

}  // namespace titans_test
