// fuzz/fuzz_checkpoint.cpp: libFuzzer target for the checkpoint reader.
//
// A checkpoint is a safetensors file, so the bytes first go through the safetensors body; then
// they are restored into a fixed tiny model (one block of each kind), its MAL block and that
// block's memory (checkpoint_objects.hpp). Whatever restores must be usable: the stream is
// advanced by a few tokens (the kernels must stay inside their buffers, which ASan checks), and
// the restored state, written again and restored again, must give the same file.
// Only titans::Error may escape a restore; any other exception or a crash is a finding.

#include "checkpoint_objects.hpp"
#include "fuzz_safetensors.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <vector>

namespace titans_fuzz {

template <class Object>
void restore_and_use(const titans::io::SafetensorsFile& f, const Object& object) {
    typename Object::State st;
    try {
        st = titans::io::restore_checkpoint(f, object);
    } catch (const titans::Error&) {
        return;
    }
    const auto again = titans::io::checkpoint_writer(object, st).bytes();
    const titans::io::SafetensorsFile g(again, "<rewritten>");
    const auto st2 = titans::io::restore_checkpoint(g, object);  // must not throw
    if (titans::io::checkpoint_writer(object, st2).bytes() != again) std::abort();
    // Advance the restored stream by 3 tokens per sequence.
    int batch = 0;
    if constexpr (requires { st.batch(); }) {
        batch = st.batch();
    } else {
        batch = st.batch;
    }
    titans::Matrixf x(3 * batch, 8);
    for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(i % 5) * 0.25f - 0.5f;
    try {
        (void)object.forward(st, x);
    } catch (const titans::Error&) {
        // e.g. a restored memory whose weights overflow to infinity: rejected by the next
        // layer's input check, which is fine; a crash is not.
    }
}

inline void fuzz_checkpoint_bytes(const std::byte* data, std::size_t size) {
    std::optional<titans::io::SafetensorsFile> f;
    try {
        f.emplace(std::vector<std::byte>(data, data + size), "<fuzz>");
    } catch (const titans::Error&) {
        return;
    }
    const auto& model = checkpoint_model();
    restore_and_use(*f, model);
    restore_and_use(*f, model.blocks()[3]);
    restore_and_use(*f, model.blocks()[3].memory());
}

}  // namespace titans_fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    (void)titans_fuzz::fuzz_safetensors_bytes(data, size);
    titans_fuzz::fuzz_checkpoint_bytes(reinterpret_cast<const std::byte*>(data), size);
    return 0;
}
