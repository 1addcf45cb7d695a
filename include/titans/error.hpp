#pragma once
// titans/error.hpp: the exception types thrown at the API boundary (see docs/errors.md).
//
// Every public entry point validates its arguments and throws one of these with a message of
// the form "<where>: <argument> = <value>, expected <what>". Hot loops assume checked inputs.

#include <sstream>
#include <stdexcept>
#include <string>

namespace titans {

/// Base class of every exception the library throws.
class Error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

/// An invalid configuration value (chunk size 0, depth 0, negative rate, ...).
class ConfigError : public Error {
public:
    using Error::Error;
};

/// An argument whose shape disagrees with the configuration or with another argument.
class ShapeError : public Error {
public:
    using Error::Error;
};

/// A NaN or infinite value where a finite one is required.
class NonFiniteError : public Error {
public:
    using Error::Error;
};

/// A file whose content is malformed, truncated or unsupported (safetensors header, offsets,
/// dtype, a checkpoint's version or missing tensors). The message names the file, the tensor
/// or field, and what was expected.
class FormatError : public Error {
public:
    using Error::Error;
};

/// A file that cannot be opened, read or written (the message carries the OS reason).
class FileError : public Error {
public:
    using Error::Error;
};

/// The processes of a data-parallel run disagree (train/communicator.hpp): a rank whose
/// configuration, parameters or optimiser differ from rank 0's when they join, or whose
/// parameters have drifted from rank 0's at a periodic check. The message names the rank.
class CommunicationError : public Error {
public:
    using Error::Error;
};

namespace detail {

template <class... Parts>
[[nodiscard]] std::string concat(const Parts&... parts) {
    std::ostringstream os;
    (os << ... << parts);
    return os.str();
}

/// Throws E("<where>: <argument> = <value>, expected <expected>") unless `ok`.
template <class E, class V>
void require(bool ok, const char* where, const char* argument, const V& value,
             const std::string& expected) {
    if (!ok) {
        throw E(concat(where, ": ", argument, " = ", value, ", expected ", expected));
    }
}

}  // namespace detail
}  // namespace titans
