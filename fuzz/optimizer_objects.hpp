#pragma once
// fuzz/optimizer_objects.hpp: the fixed parameters the optimizer fuzz target steps (a tiny
// SwiGLU feed-forward, in float and double), and the seed corpus of optimiser files (written
// by titans_make_corpus): valid files of that feed-forward's AdamW, and files load_optimizer
// must refuse. Shared so the corpus always matches the target.

#include <titans/io/optimizer.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace titans_fuzz {

/// d = 2, hidden 3, SwiGLU: tensors w1 (2 x 3), w3 (2 x 3), w2 (3 x 2).
inline titans::FeedForwardConfig optimizer_ffn_config() {
    return {.d_model = 2, .kind = titans::FeedForwardKind::SwiGLU, .hidden = 3};
}

/// The AdamW state after `steps` steps on the feed-forward, with gradients of a fixed pattern.
template <class T>
titans::AdamW<T> optimizer_after(int steps) {
    const auto cfg = optimizer_ffn_config();
    auto p = titans::FeedForwardParams<T>::random(cfg, 3);
    titans::AdamW<T> opt({.weight_decay = 0.05});
    for (int s = 1; s <= steps; ++s) {
        auto g = titans::FeedForwardParams<T>::zeros(cfg);
        titans::FeedForwardParams<T>::tensors(g, cfg, [s](const std::string&, auto& m) {
            for (Eigen::Index i = 0; i < m.size(); ++i) {
                m.data()[i] = static_cast<T>((i * 7 + s * 3) % 11 - 5) / T(4);
            }
        });
        opt.step(p, g, cfg, 1e-2);
    }
    return opt;
}

/// The bytes of an optimiser file with the given parts (no checks: the bad seeds are built
/// with it). `config`: beta1, beta2, eps, weight_decay, decay_vectors.
inline std::vector<std::byte> optimizer_file(
    std::int64_t step, const std::vector<double>& config,
    const std::map<std::string, titans::Matrixf>& tensors) {
    titans::io::SafetensorsWriter w;
    w.metadata("format", "titans.adamw");
    w.metadata("format_version", std::to_string(titans::io::format_version));
    w.metadata("dtype", "F32");
    w.add_integers("step", std::vector<std::int64_t>{step});
    w.add("config", Eigen::Map<const titans::RowVectord>(config.data(),
                                                         static_cast<Eigen::Index>(config.size())));
    for (const auto& [name, m] : tensors) w.add(name, m);
    return w.bytes();
}

/// Seeds: "valid_*" load as float and double; "bad_*" are refused by load_optimizer (bad_eps_float
/// by load_optimizer<float> only).
inline std::vector<std::pair<std::string, std::vector<std::byte>>> optimizer_seeds() {
    using titans::io::optimizer_writer;
    std::vector<std::pair<std::string, std::vector<std::byte>>> out{
        {"valid_fresh_f32", optimizer_writer(optimizer_after<float>(0)).bytes()},
        {"valid_step1_f32", optimizer_writer(optimizer_after<float>(1)).bytes()},
        {"valid_step3_f64", optimizer_writer(optimizer_after<double>(3)).bytes()},
    };
    const auto ok = optimizer_after<float>(2);
    std::map<std::string, titans::Matrixf> moments;
    for (const auto& [name, mo] : ok.moments()) {
        moments["m." + name] = mo.m;
        moments["v." + name] = mo.v;
    }
    const std::vector<double> cfg{0.9, 0.999, 1e-8, 0.05, 0.0};
    const auto with = [&](const std::string& key, titans::Matrixf m) {
        auto t = moments;
        t[key] = std::move(m);
        return t;
    };
    constexpr std::int64_t top = std::numeric_limits<std::int64_t>::max();
    out.emplace_back("valid_steps0_moments", optimizer_file(0, cfg, moments));
    out.emplace_back("valid_step_max", optimizer_file(top, cfg, moments));
    out.emplace_back("bad_negative_step", optimizer_file(-1, cfg, moments));
    out.emplace_back("bad_eps_zero", optimizer_file(2, {0.9, 0.999, 0.0, 0.05, 0.0}, moments));
    out.emplace_back("bad_eps_float", optimizer_file(2, {0.9, 0.999, 1e-50, 0.05, 0.0}, moments));
    out.emplace_back("bad_beta1_one", optimizer_file(2, {1.0, 0.999, 1e-8, 0.05, 0.0}, moments));
    out.emplace_back("bad_config_size", optimizer_file(2, {0.9, 0.999, 1e-8, 0.05}, moments));
    titans::Matrixf nan = moments.at("m.w1");
    nan(0, 1) = std::numeric_limits<float>::quiet_NaN();
    out.emplace_back("bad_nan_moment", optimizer_file(2, cfg, with("m.w1", nan)));
    out.emplace_back("bad_negative_v", optimizer_file(2, cfg, with("v.w2", -moments.at("v.w2"))));
    out.emplace_back("bad_shape_mismatch",
                     optimizer_file(2, cfg, with("v.w3", titans::Matrixf::Constant(3, 2, 0.5f))));
    auto missing = moments;
    missing.erase("v.w3");
    out.emplace_back("bad_missing_v", optimizer_file(2, cfg, missing));
    out.emplace_back("bad_extra_tensor",
                     optimizer_file(2, cfg, with("extra", titans::Matrixf::Zero(1, 1))));
    return out;
}

}  // namespace titans_fuzz
