// fuzz/fuzz_optimizer.cpp: libFuzzer target for the optimiser file reader
// (titans::io::load_optimizer, float and double).
//
// Only titans::Error may escape a load. What loads must be usable: written again and loaded
// again it gives the same file, and a step on the fixed feed-forward of optimizer_objects.hpp
// either completes with finite parameters and moments or is refused with a titans::Error (the
// file's tensors are not the feed-forward's, a counter at its limit, an overflowing step).

#include "optimizer_objects.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <vector>

namespace titans_fuzz {

template <class T>
void load_and_step(const titans::io::SafetensorsFile& f) {
    std::optional<titans::AdamW<T>> opt;
    try {
        opt.emplace(titans::io::load_optimizer<T>(f));
    } catch (const titans::Error&) {
        return;
    }
    const auto again = titans::io::optimizer_writer(*opt).bytes();  // must not throw
    const titans::io::SafetensorsFile g(again, "<rewritten>");
    const auto opt2 = titans::io::load_optimizer<T>(g);  // must not throw
    if (titans::io::optimizer_writer(opt2).bytes() != again) std::abort();

    const auto cfg = optimizer_ffn_config();
    auto p = titans::FeedForwardParams<T>::random(cfg, 1);
    const auto grads = titans::FeedForwardParams<T>::random(cfg, 2);
    try {
        opt->step(p, grads, cfg, 1e-2);
    } catch (const titans::Error&) {
        return;
    }
    if (!titans::detail::tensors_finite(p, cfg)) std::abort();
    for (const auto& [name, mo] : opt->moments()) {
        if (!mo.m.allFinite() || !mo.v.allFinite()) std::abort();
    }
}

}  // namespace titans_fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    std::optional<titans::io::SafetensorsFile> f;
    try {
        const auto* b = reinterpret_cast<const std::byte*>(data);
        f.emplace(std::vector<std::byte>(b, b + size), "<fuzz>");
    } catch (const titans::Error&) {
        return 0;
    }
    titans_fuzz::load_and_step<float>(*f);
    titans_fuzz::load_and_step<double>(*f);
    return 0;
}
