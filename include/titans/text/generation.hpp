#pragma once
// titans/text/generation.hpp: continuing a prompt token by token through a model's streaming
// (decode) path, each token picked by a Sampler.

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "../error.hpp"
#include "../models/model.hpp"
#include "sampling.hpp"

namespace titans::text {

/// One text being generated: the model's state of one stream, the sampler, and the token
/// picked last (or the prompt's last token), which the model has not seen yet. Everything a
/// continuation depends on: a copy (or a checkpoint of the three: titans/io/generation.hpp)
/// continues with the same tokens as the original.
template <class T, class Backend = backend::Cpu>
struct Generation {
    ModelState<T, Backend> state;
    Sampler sampler;
    int pending = -1;
};

/// Starts generating after `prompt` (token ids): a state of one stream that has seen every
/// prompt token but the last (fed in one call), which is kept as the pending token.
/// ConfigError: the model has no vocabulary, or `sampler` is invalid (naming the field);
/// ShapeError: the prompt is empty or has an id outside [0, vocab_size).
///
///     auto g = titans::text::start_generation(model, prompt_ids, {.temperature = 0.8});
///     for (int i = 0; i < 100; ++i) out += static_cast<char>(next_token(model, g));
template <class T, class Backend>
[[nodiscard]] Generation<T, Backend> start_generation(const Model<T, Backend>& model,
                                                      std::span<const int> prompt,
                                                      const SamplerConfig& sampler) {
    constexpr const char* where = "start_generation";
    const int vocab = model.config().vocab_size;
    detail::require<ConfigError>(vocab > 0, where, "model.config().vocab_size", vocab,
                                 "> 0 (a model of token ids)");
    Sampler s(sampler);
    detail::require<ShapeError>(!prompt.empty(), where, "prompt.size()", 0, "at least 1");
    for (std::size_t i = 0; i < prompt.size(); ++i) {
        detail::require<ShapeError>(prompt[i] >= 0 && prompt[i] < vocab, where,
                                    detail::concat("prompt[", i, "]").c_str(), prompt[i],
                                    detail::concat("a token id in [0, ", vocab, ")"));
    }
    Generation<T, Backend> g{model.make_state(1), std::move(s), prompt.back()};
    if (prompt.size() > 1) {
        (void)model.forward_tokens(g.state, std::vector<int>(prompt.begin(), prompt.end() - 1));
    }
    return g;
}

/// The next token: feeds the pending token to the model (one token through the streaming
/// path), samples the next from its logits, makes it the pending token and returns it.
/// Throws what Model::forward_tokens throws (a state of another model or batch, a pending id
/// outside the vocabulary, non-finite logits); `g` is unchanged then.
template <class T, class Backend>
[[nodiscard]] int next_token(const Model<T, Backend>& model, Generation<T, Backend>& g) {
    const Matrix<T> logits = model.forward_tokens(g.state, std::vector<int>{g.pending});
    // Cannot throw: forward_tokens returns one finite row (it refuses non-finite output).
    g.pending = g.sampler.sample(logits.row(0));
    return g.pending;
}

}  // namespace titans::text
