#pragma once
// fuzz/fuzz_safetensors.hpp: the body of the safetensors fuzz target, shared with
// fuzz_checkpoint.cpp (which runs it on every input before its own checks).
//
// Any titans::Error is an expected rejection; any other exception escapes (libFuzzer reports
// it as a crash), and so do crashes, sanitizer reports and leaks.

#include <titans/io/safetensors.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace titans_fuzz {

/// Tensors with more elements than this are not converted (the file's size bounds them anyway,
/// since the reader checks dtype x shape against the data section, but be explicit).
inline constexpr std::uint64_t max_matrix_numel = std::uint64_t{1} << 20;

/// Parses `data` as a safetensors file and reads every tensor every way the API allows.
/// Returns the parsed file's tensor count (0 if rejected), so callers can chain checks.
inline std::size_t fuzz_safetensors_bytes(const std::uint8_t* data, std::size_t size) {
    std::vector<std::byte> bytes(size);
    if (size != 0) std::memcpy(bytes.data(), data, size);
    try {
        const titans::io::SafetensorsFile f(std::move(bytes), "<fuzz>");
        volatile std::size_t sink = 0;
        for (const auto& [k, v] : f.metadata()) sink = sink + k.size() + v.size();
        sink = sink + f.metadata_or("format", "").size();
        for (const titans::io::TensorInfo& t : f.tensors()) {
            // Invariants the reader promises: the tensor is found by name and its bytes are
            // exactly dtype size x shape product, inside the buffer.
            const titans::io::TensorInfo* found = f.find(t.name);
            if (found == nullptr || found->name != t.name) __builtin_trap();
            const auto raw = f.data(t);
            if (raw.size() != t.numel() * titans::io::dtype_size(t.dtype)) __builtin_trap();
            sink = sink + t.shape_string().size();
            if (t.numel() <= max_matrix_numel) {
                try {
                    const auto m = f.matrix<float>(t.name);
                    if (static_cast<std::uint64_t>(m.size()) != t.numel()) __builtin_trap();
                } catch (const titans::Error&) {
                }
                try {
                    const auto m = f.matrix<double>(t.name);
                    if (static_cast<std::uint64_t>(m.size()) != t.numel()) __builtin_trap();
                } catch (const titans::Error&) {
                }
                try {
                    const auto v = f.integers(t.name);
                    if (v.size() != t.numel()) __builtin_trap();
                } catch (const titans::Error&) {
                }
            }
        }
        // A name that is not there: FormatError.
        const char* absent = "\x01 not a tensor";
        if (f.find(absent) == nullptr) {
            try {
                (void)f.matrix<float>(absent);
                __builtin_trap();
            } catch (const titans::FormatError&) {
            }
        }
        // Round trip: what the reader accepted, the writer must write and the reader re-read
        // identically (names, dtypes, shapes, bytes, metadata).
        titans::io::SafetensorsWriter w;
        for (const auto& [k, v] : f.metadata()) w.metadata(k, v);
        for (const titans::io::TensorInfo& t : f.tensors()) w.add_raw(t.name, t.dtype, t.shape, f.data(t));
        const titans::io::SafetensorsFile g(w.bytes(), "<fuzz round trip>");
        if (g.metadata() != f.metadata() || g.tensors().size() != f.tensors().size()) __builtin_trap();
        for (std::size_t i = 0; i < f.tensors().size(); ++i) {
            const auto& a = f.tensors()[i];
            const auto& b = g.tensors()[i];
            const auto da = f.data(a);
            const auto db = g.data(b);
            if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape ||
                da.size() != db.size() ||
                (!da.empty() && std::memcmp(da.data(), db.data(), da.size()) != 0)) {
                __builtin_trap();
            }
        }
        return f.tensors().size();
    } catch (const titans::Error&) {
        return 0;
    }
}

}  // namespace titans_fuzz
