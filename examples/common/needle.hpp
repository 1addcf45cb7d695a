#pragma once
// examples/common/needle.hpp: a needle in a haystack for byte-level language models (the
// paper's S-NIAH, single needle, three kinds): a pass key (5 digits), a number (7 digits) or a
// word is stated once at a chosen depth of a validation text, and the text ends with the
// question's prompt, whose continuation is the needle's value:
//
//     <haystack ...> The pass key is 48213. Remember it. <haystack ...> The pass key is |48213
//
// Scored by teacher forcing in one forward pass per trial: `correct` when the
// model's argmax is the right byte at every position of the answer (exactly what greedy
// decoding from the prompt would produce), and the answer's bits per byte with the needle and
// without it (the same haystack and question, the needle sentence replaced by haystack bytes):
// their difference is what the model recalls even when it cannot yet reproduce the value.

#include <titans/titans.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace examples {

enum class NeedleKind { PassKey, Number, Word };

/// One trial: the question's bytes (haystack with or without the needle, then the prompt) and
/// the answer that should follow.
struct NeedleTrial {
    std::string context, answer;
};

/// Scores of a set of trials at one length.
struct NeedleScore {
    int trials = 0, correct = 0;
    double bits_with = 0, bits_without = 0;  // mean bits per answer byte
    [[nodiscard]] double accuracy() const { return trials > 0 ? double(correct) / trials : 0.0; }
};

/// The needle's value and its two sentences (statement, question prompt).
inline void needle_sentences(NeedleKind kind, std::mt19937_64& rng, std::string& value,
                             std::string& statement, std::string& prompt) {
    static const char* words[] = {"lantern", "harbour", "thistle", "meadow", "falcon",
                                  "crimson", "anchor", "willow", "marble", "sparrow"};
    const auto digits = [&rng](int n) {
        std::string s;
        for (int i = 0; i < n; ++i) s += static_cast<char>('0' + (i == 0 ? 1 + rng() % 9 : rng() % 10));
        return s;
    };
    switch (kind) {
        case NeedleKind::PassKey:
            value = digits(5);
            statement = " The pass key is " + value + ". Remember it. ";
            prompt = " The pass key is ";
            break;
        case NeedleKind::Number:
            value = digits(7);
            statement = " The special magic number is " + value + ". ";
            prompt = " The special magic number is ";
            break;
        case NeedleKind::Word:
            value = words[rng() % 10];
            statement = " The secret word is " + value + ". ";
            prompt = " The secret word is ";
            break;
    }
}

/// A trial pair (with, without the needle) of `length` context bytes: a haystack window of the
/// document `doc` (at least `length` bytes long) with the statement at `depth` (0..1) of it.
inline std::pair<NeedleTrial, NeedleTrial> make_needle_trial(NeedleKind kind, const std::string& doc,
                                                             int length, double depth,
                                                             std::mt19937_64& rng) {
    std::string value, statement, prompt;
    needle_sentences(kind, rng, value, statement, prompt);
    const int hay = length - static_cast<int>(prompt.size());
    const std::size_t start = rng() % (doc.size() - static_cast<std::size_t>(length) + 1);
    const std::string h = doc.substr(start, static_cast<std::size_t>(hay));
    const auto at = static_cast<std::size_t>(depth * (hay - static_cast<int>(statement.size())));
    NeedleTrial with{h.substr(0, at) + statement + h.substr(at + statement.size()) + prompt, value};
    NeedleTrial without{h + prompt, value};
    return {with, without};
}

/// Bits per answer byte of a trial, and whether the model answers it exactly (its argmax right
/// at every answer byte), from one forward pass over context + answer from a fresh state.
inline double score_trial(const titans::Model<float>& model, const NeedleTrial& t, bool& correct) {
    const std::string all = t.context + t.answer;
    std::vector<int> ids;
    for (std::size_t i = 0; i + 1 < all.size(); ++i) ids.push_back(static_cast<unsigned char>(all[i]));
    auto state = model.make_state(1);
    const titans::Matrixf logits = model.forward_tokens(state, ids);
    double bits = 0;
    correct = true;
    for (std::size_t j = 0; j < t.answer.size(); ++j) {
        const auto l = logits.row(static_cast<Eigen::Index>(t.context.size() - 1 + j)).cast<double>();
        const double m = l.maxCoeff();
        const double lse = m + std::log((l.array() - m).exp().sum());
        const int want = static_cast<unsigned char>(t.answer[j]);
        bits += (lse - l(want)) / std::log(2.0);
        Eigen::Index arg = 0;
        l.maxCoeff(&arg);
        correct = correct && arg == want;
    }
    return bits / static_cast<double>(t.answer.size());
}

/// S-NIAH at `length` context bytes: for each kind and each depth in {0.1, 0.5, 0.9},
/// `per_cell` trials on windows of the documents at least `length` bytes long, each with and
/// without its needle. Trials = 0 when no document is that long or length < 128 (the
/// sentences need room).
inline NeedleScore needle_in_haystack(const titans::Model<float>& model,
                                      const std::vector<titans::text::Document>& docs, int length,
                                      int per_cell, std::uint64_t seed) {
    std::vector<const std::string*> long_docs;
    for (const auto& d : docs) {
        if (d.bytes.size() >= static_cast<std::size_t>(length)) long_docs.push_back(&d.bytes);
    }
    NeedleScore s;
    if (long_docs.empty() || per_cell < 1 || length < 128) return s;
    std::mt19937_64 rng(seed);
    for (NeedleKind kind : {NeedleKind::PassKey, NeedleKind::Number, NeedleKind::Word}) {
        for (double depth : {0.1, 0.5, 0.9}) {
            for (int i = 0; i < per_cell; ++i) {
                const std::string& doc = *long_docs[rng() % long_docs.size()];
                const auto [with, without] = make_needle_trial(kind, doc, length, depth, rng);
                bool right = false, unused = false;
                s.bits_with += score_trial(model, with, right);
                s.bits_without += score_trial(model, without, unused);
                s.correct += right ? 1 : 0;
                ++s.trials;
            }
        }
    }
    s.bits_with /= s.trials;
    s.bits_without /= s.trials;
    return s;
}

}  // namespace examples
