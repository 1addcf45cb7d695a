#pragma once
// titans/io/safetensors.hpp: a strict reader and a writer of the safetensors format.
//
// The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian unsigned header
// length n, n bytes of UTF-8 JSON
//     {"__metadata__": {"key": "value", ...},
//      "name": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [begin, end]}, ...}
// then the data section: every tensor's bytes, little-endian and row-major, at
// [begin, end) relative to the start of the data section. The reader treats the file as
// untrusted (docs/formats.md lists every check): every failure is a titans::FormatError that
// names the source, the tensor and the problem; no read ever leaves the buffer.
//
// Requires nlohmann/json (Debian: nlohmann-json3-dev): link titans::io, not just titans::titans.
//
// The parts: dtype.hpp (element types, F16/BF16 conversion), file.hpp (non-blocking reads of
// regular files, atomic writes), safetensors_reader.hpp (SafetensorsFile) and
// safetensors_writer.hpp (SafetensorsWriter).

#include "dtype.hpp"
#include "file.hpp"
#include "safetensors_reader.hpp"
#include "safetensors_writer.hpp"
