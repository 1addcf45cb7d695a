#pragma once
// titans/io/metadata.hpp: the metadata checks the readers of checkpoints and trainer files
// share: a required entry, and the configuration a file records against the caller's.

#include <string>

#include "config_text.hpp"
#include "safetensors.hpp"

namespace titans::io::detail {

/// The metadata value `key` of f; FormatError if absent.
[[nodiscard]] inline std::string metadata_value(const SafetensorsFile& f, const char* key) {
    const auto it = f.metadata().find(key);
    if (it == f.metadata().end()) {
        throw FormatError("titans::io: " + f.source() + ": __metadata__ has no \"" + key + "\"");
    }
    return it->second;
}

/// The configuration f records (metadata "config", completed by with_legacy_settings) must be
/// `mine` (ConfigError "<subject> configuration differs: <the first difference>", naming the
/// sides `file_side` and `mine_side`), and its "config_hash" must be the recorded text's
/// (FormatError: corrupt metadata).
inline void check_recorded_config(const SafetensorsFile& f, const std::string& mine,
                                  const std::string& subject, const std::string& file_side,
                                  const std::string& mine_side) {
    const std::string recorded = metadata_value(f, "config");
    if (const std::string theirs = with_legacy_settings(recorded); theirs != mine) {
        throw ConfigError("titans::io: " + f.source() + ": " + subject +
                          " configuration differs: " +
                          config_difference(theirs, mine, file_side, mine_side));
    }
    Fnv1a recorded_hash;
    recorded_hash.update(recorded);
    if (metadata_value(f, "config_hash") != recorded_hash.hex()) {
        throw FormatError("titans::io: " + f.source() + ": config_hash does not match the "
                          "recorded configuration (corrupt metadata)");
    }
}

}  // namespace titans::io::detail
