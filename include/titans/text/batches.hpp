#pragma once
// titans/text/batches.hpp: training batches from documents: B windows of N + 1 bytes each,
// drawn reproducibly from a seed and a step counter, as token ids and next-byte labels.

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../detail/random.hpp"
#include "../error.hpp"
#include "../limits.hpp"
#include "corpus.hpp"

namespace titans::text {

/// B sequences of N tokens, stacked sequence-major (entry b*N + t is token t of sequence b),
/// the layout of Model::forward_tokens: ids for the model, labels[i] the byte that follows
/// ids[i] in its document, for cross_entropy_loss(logits, labels, dlogits).
struct TokenBatch {
    int batch = 0;   ///< B
    int length = 0;  ///< N
    std::vector<int> ids;
    std::vector<int> labels;
};

/// Draws TokenBatches from documents: each of the B sequences is a window of N + 1 consecutive
/// bytes of one document (window w gives ids w[0..N) and labels w[1..N]), its start drawn
/// uniformly among every start of every document at least N + 1 bytes long (a longer document
/// gives more windows). Batch k is a pure function of the documents, B, N, the seed and k:
/// its B windows use draws k*B ... k*B + B - 1 of SplitMix64(seed). next() draws batch
/// step() and advances; a resumed run seeks to the step it stopped at and draws the same
/// batches.
///
///     titans::text::BatchSampler batches(split.train, 8, 128, 42);
///     titans::text::TokenBatch b = batches.next();
///     titans::Matrixf logits = model.forward_tokens(state, b.ids);  // state of batch 8
class BatchSampler {
public:
    /// ShapeError: no documents. ConfigError naming the argument: batch not in
    /// [1, limits::max_batch], length < 1, the ids and labels of one batch over
    /// limits::max_allocation_bytes, or no document of at least length + 1 bytes.
    BatchSampler(std::vector<Document> documents, int batch, int length, std::uint64_t seed)
        : docs_(std::move(documents)), batch_(batch), length_(length), seed_(seed) {
        constexpr const char* where = "BatchSampler";
        detail::require<ShapeError>(!docs_.empty(), where, "documents.size()", 0, "at least 1");
        detail::require_in_range(batch, 1, limits::max_batch, where, "batch");
        detail::require<ConfigError>(length >= 1, where, "length", length, "an integer >= 1");
        const std::int64_t tokens = detail::sat_mul(batch, length);
        detail::require_budget(detail::sat_mul(tokens, std::int64_t{2 * sizeof(int)}), where,
                               "batch * length tokens", "int ids and labels");
        std::int64_t starts = 0;
        std::size_t longest = 0;
        for (const Document& d : docs_) {
            const auto n = static_cast<std::int64_t>(d.bytes.size());
            starts += std::max<std::int64_t>(0, n - length);
            ends_.push_back(starts);
            longest = std::max(longest, d.bytes.size());
        }
        detail::require<ConfigError>(
            starts > 0, where, "length", length,
            detail::concat("at most ", static_cast<std::int64_t>(longest) - 1,
                           " (one less than the longest of the ", docs_.size(),
                           " documents: a window holds length + 1 bytes)"));
    }

    [[nodiscard]] int batch() const { return batch_; }
    [[nodiscard]] int length() const { return length_; }
    /// How many windows there are to draw from (the starts of every document).
    [[nodiscard]] std::int64_t windows() const { return ends_.back(); }
    /// The step next() draws.
    [[nodiscard]] std::uint64_t step() const { return step_; }
    /// Sets the step next() draws next (to resume a run).
    void seek(std::uint64_t step) { step_ = step; }

    /// Batch `step` (see the class comment); does not change step().
    [[nodiscard]] TokenBatch batch_at(std::uint64_t step) const {
        TokenBatch out{batch_, length_, {}, {}};
        const auto n = static_cast<std::size_t>(length_);
        out.ids.resize(static_cast<std::size_t>(batch_) * n);
        out.labels.resize(out.ids.size());
        // SplitMix64's state advances by a constant per draw: start at draw step * B.
        detail::SplitMix64 rng(seed_ + step * static_cast<std::uint64_t>(batch_) *
                                           0x9e3779b97f4a7c15ULL);
        for (std::size_t b = 0; b < static_cast<std::size_t>(batch_); ++b) {
            const auto start = static_cast<std::int64_t>(
                rng.next() % static_cast<std::uint64_t>(windows()));
            const auto d = static_cast<std::size_t>(
                std::upper_bound(ends_.begin(), ends_.end(), start) - ends_.begin());
            const std::int64_t offset = start - (d == 0 ? 0 : ends_[d - 1]);
            const char* w = docs_[d].bytes.data() + offset;
            for (std::size_t t = 0; t < n; ++t) {
                out.ids[b * n + t] = static_cast<unsigned char>(w[t]);
                out.labels[b * n + t] = static_cast<unsigned char>(w[t + 1]);
            }
        }
        return out;
    }

    /// batch_at(step()), then step() + 1.
    [[nodiscard]] TokenBatch next() { return batch_at(step_++); }

private:
    std::vector<Document> docs_;
    std::vector<std::int64_t> ends_;  ///< running count of window starts, one per document
    int batch_;
    int length_;
    std::uint64_t seed_;
    std::uint64_t step_ = 0;
};

}  // namespace titans::text
