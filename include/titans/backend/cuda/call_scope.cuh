#pragma once
// titans/backend/cuda/call_scope.cuh: the context one call runs in on CUDA.
//
// Outside a CallScope every layer call runs on its own stream (a state's, or the calling
// thread's: thread_context()), checks its results' finiteness by reading a flag back, and
// returns with its stream idle: a call of a layer is complete when it returns, at the price of
// a host wait per layer call (and one per finiteness check).
//
// Inside a CallScope (what Model::forward opens, GlueKernels<Cuda, T>::CallScope) the whole
// call runs on this thread's stream in order, without waiting: a state's work goes to
// call_context(own) = thread_context() rather than to the state's own stream, a layer's
// "return idle" wait (idle(cx)) is skipped, and a finiteness check raises the scope's device
// flag instead of coming back (deferring()). The scope's owner reads that flag once, at the
// call's edge (flagged(): the call's one wait besides its transfers); if it is raised, the
// owner rolls the call back and runs it again outside the scope, where the first failing check
// throws its NonFiniteError with its place named, as it always did.
//
// Freed buffers stay safe without the waits: device buffers are freed stream-ordered on the
// legacy stream (runtime.cuh), which runs after the work already queued on every blocking
// stream, this thread's included.
//
// A call's temporaries (call_buffer) come from the thread's CallArena while a deferring scope
// is open: a decode call, once warm, allocates nothing. The flag is a device word per nesting
// depth that stays zero between calls (call_flag): a clean call resets nothing.

#include <cstddef>
#include <vector>

#include "../../view.hpp"
#include "call_graph.cuh"
#include "launch.cuh"
#include "runtime.cuh"

namespace titans::backend::cuda {

/// This host thread's stream and cuBLAS handle (made on first use, with the TF32 setting of
/// that moment), with a cuBLAS workspace of its own (StreamContext::OwnWorkspace).
inline const StreamContext& thread_context() {
    thread_local const StreamContext ctx(StreamContext::OwnWorkspace{}, allow_tf32());
    return ctx;
}

/// Device memory lent to the temporaries of the calls that deferring CallScopes run
/// (call_buffer), one per host thread: a bump allocator over one block kept across calls, so
/// that a call, once warm, makes no cudaMallocAsync / cudaFreeAsync pair a temporary (each an
/// operation on the legacy stream, which waits for every blocking stream). What the block
/// cannot hold during a call is allocated as usual and kept until the outermost deferring
/// scope closes; the block then grows to the call's whole need (up to block_max) for the next
/// one. Everything a deferring scope runs is ordered on this thread's stream, so a later
/// call's use of the same bytes comes after this one's. Requests above request_max (a long
/// call's few large buffers) take the device's pool as before.
class CallArena {
public:
    static constexpr std::size_t request_max = std::size_t(1) << 20;
    static constexpr std::size_t block_max = std::size_t(64) << 20;
    static constexpr std::size_t alignment = 256;

    /// `bytes` for the call in progress (valid until the outermost deferring scope closes).
    void* take(std::size_t bytes) {
        const std::size_t b = (bytes + alignment - 1) / alignment * alignment;
        need_ += b;
        if (used_ + b <= block_.size()) {
            void* p = block_.data() + used_;
            used_ += b;
            return p;
        }
        extra_.emplace_back(b);
        return extra_.back().data();
    }
    void open() { ++open_; }
    /// The outermost scope's close: the block grown to the call's need, the rest released
    /// (stream-ordered), everything lent again from the start. Never throws: if the block
    /// cannot grow it stays as it is.
    void close() noexcept {
        if (--open_ > 0) {
            return;
        }
        if (need_ > block_.size() && need_ <= block_max) {
            try {
                DeviceBuffer<unsigned char> bigger(need_);
                block_.swap(bigger);
            } catch (...) {  // no memory for a bigger block: the calls allocate as they did
            }
        }
        extra_.clear();
        used_ = need_ = 0;
    }
private:
    DeviceBuffer<unsigned char> block_;
    std::vector<DeviceBuffer<unsigned char>> extra_;
    std::size_t used_ = 0, need_ = 0;
    int open_ = 0;
};

/// This host thread's CallArena.
inline CallArena& call_arena() {
    thread_local CallArena arena;
    return arena;
}

template <class T>
DeviceBuffer<T> call_buffer(std::size_t n);

/// The device flag of this thread's deferring scope at nesting depth `depth` (0 outermost):
/// one word each, made zero once and kept across calls, so that a call starts without a
/// memset (a scope that may leave its flag raised clears it as it closes).
inline unsigned* call_flag(int depth) {
    thread_local std::vector<DeviceBuffer<unsigned>> flags;
    while (static_cast<int>(flags.size()) <= depth) {
        DeviceBuffer<unsigned> f(1);
        memset_async(f.data(), 0, sizeof(unsigned), thread_context().stream(),
                     "cudaMemsetAsync (call flag)");
        flags.push_back(std::move(f));
    }
    return flags[static_cast<std::size_t>(depth)].data();
}

/// A call on this thread's stream with its finiteness checks deferred to one device flag (see
/// the file comment). Scopes nest (the innermost one is active); a strict scope
/// (CallScope(false)) suspends the ones around it: inside it every check waits and throws at
/// its place again.
class CallScope {
public:
    explicit CallScope(bool defer = true) : prev_(active()), defer_(defer) {
        if (defer_) {
            flag_ = call_flag(depth());  // (may throw: nothing changed yet)
            call_arena().open();
            active() = this;
            ++depth();
            taped_ = call_graphs();
            if (taped_) {
                call_tape().open(thread_context().stream());
            }
        } else {
            call_tape().pause();  // what the scopes around it recorded runs first
            active() = nullptr;
        }
    }
    CallScope(const CallScope&) = delete;
    CallScope& operator=(const CallScope&) = delete;
    ~CallScope() {
        if (defer_) {
            close_tape();  // before the arena's memory can move
            clear_flag();
            --depth();
        } else {
            call_tape().resume();
        }
        active() = prev_;
        if (defer_) {
            call_arena().close();
        }
    }

    /// Whether a check of the call so far found a NaN or an infinity: the flag read back after
    /// everything queued on this thread's stream (one wait). False for a strict scope.
    [[nodiscard]] bool flagged() const {
        if (!defer_) {
            return false;
        }
        unsigned host = 0;
        const StreamContext& cx = thread_context();
        settle_recorded();
        check(cudaMemcpyAsync(&host, flag_, sizeof(unsigned), cudaMemcpyDeviceToHost,
                              cx.stream()),
              "cudaMemcpyAsync (call flag)");
        cx.synchronize();
        may_be_raised_ = host != 0;  // zero: clean unless a check is issued after this
        return host != 0;
    }

    /// The device flag a deferred check raises (asked for as the check is issued).
    [[nodiscard]] unsigned* flag() {
        may_be_raised_ = true;
        return flag_;
    }

    /// The active deferring scope of this thread, or null.
    static CallScope*& active() {
        thread_local CallScope* a = nullptr;
        return a;
    }

private:
    /// The tape's close, if this scope opened it (a recorded launch's error is lost here: a
    /// destructor cannot throw it, and the tests find such bugs under the emulator).
    void close_tape() noexcept {
        if (taped_) {
            taped_ = false;
            try {
                call_tape().close();
            } catch (...) {
            }
        }
    }

    /// The flag zeroed for the next call at this depth where a check may have raised it
    /// (a raised flag, or a call that ended without reading it clean).
    void clear_flag() noexcept {
        if (may_be_raised_) {
            try {  // (recorded where a scope around this one records)
                memset_async(flag_, 0, sizeof(unsigned), thread_context().stream(),
                             "cudaMemsetAsync (call flag)");
            } catch (...) {  // the next call at this depth may then rerun strictly: correct
            }
        }
    }
    /// This thread's open deferring scopes.
    static int& depth() {
        thread_local int d = 0;
        return d;
    }

    CallScope* prev_;
    bool defer_;
    bool taped_ = false;
    mutable bool may_be_raised_ = false;
    unsigned* flag_ = nullptr;
};

/// Whether finiteness checks are deferred (a deferring CallScope is active on this thread).
inline bool deferring() { return CallScope::active() != nullptr; }

/// The flag a kernel's deferred check raises: the active deferring scope's, or null outside
/// one (the kernel then leaves the check to the caller's own wait).
inline unsigned* deferred_flag() { return deferring() ? CallScope::active()->flag() : nullptr; }

/// Set while an OutputCovered is alive on this thread.
inline bool& output_covered_flag() {
    thread_local bool covered = false;
    return covered;
}
/// Whether the layer running now may leave its output's finiteness check to a later check of
/// the same deferring call (an OutputCovered around it, inside a deferring scope).
inline bool output_covered() { return deferring() && output_covered_flag(); }

/// Marks the sub-layers called in its lifetime as ones whose output a later check of the call
/// covers (a block's residual sum keeps a non-finite entry non-finite; MAG's gated norms check
/// their inputs): inside a deferring scope the attention then skips its output's check, and
/// the memory its output's when the decode kernel checked the rest. A strict scope's rerun
/// checks at every place again.
class OutputCovered {
public:
    OutputCovered() : prev_(output_covered_flag()) { output_covered_flag() = true; }
    OutputCovered(const OutputCovered&) = delete;
    OutputCovered& operator=(const OutputCovered&) = delete;
    ~OutputCovered() { output_covered_flag() = prev_; }

private:
    bool prev_;
};

/// n elements for the call in progress: lent by this thread's CallArena inside a deferring
/// scope (valid until the outermost one closes; n * sizeof(T) up to CallArena::request_max),
/// else a buffer of their own. Only for temporaries that no state or trace keeps.
template <class T>
DeviceBuffer<T> call_buffer(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (!deferring() || bytes == 0 || bytes > CallArena::request_max) {
        return DeviceBuffer<T>(n);
    }
    return DeviceBuffer<T>::borrowed(static_cast<T*>(call_arena().take(bytes)), n);
}

/// This thread's stream with a handle of the other math mode than thread_context()'s (a
/// state made under the other TF32 setting keeps its precision inside a scope), sharing its
/// workspace (one stream: the two handles' products never overlap).
inline const StreamContext& thread_context_other_mode() {
    thread_local const StreamContext ctx(thread_context(), !thread_context().tf32());
    return ctx;
}

/// The context a state's work runs on: inside a deferring scope this thread's stream (with a
/// handle of the state's own math mode), else the state's own.
inline const StreamContext& call_context(const StreamContext& own) {
    if (!deferring()) {
        return own;
    }
    const StreamContext& t = thread_context();
    return own.tf32() == t.tf32() ? t : thread_context_other_mode();
}

/// The wait a layer call ends with outside a scope (its stream idle when it returns); inside
/// one the call's work stays queued in order on the thread's stream.
inline void idle(const StreamContext& cx) {
    if (!deferring()) {
        cx.synchronize();
    }
}

#if TITANS_CUDA_DEVICE_CODE
/// Raises the active scope's flag if y holds a NaN or an infinity (no wait). A scope must be
/// active (deferring()).
template <class T>
void defer_nonfinite(cudaStream_t stream, View<const T> y) {
    const T* yp = y.data;
    unsigned* f = CallScope::active()->flag();
    const long long ys = y.stride;
    const unsigned cols = static_cast<unsigned>(y.cols);
    each(stream, y.rows * y.cols, [=] __device__(unsigned i) {
        const T v = yp[(i / cols) * ys + i % cols];
        if (not_finite(v)) {
            atomicMax(f, 1u);
        }
    });
}

/// The first row of y holding a NaN or an infinity, or -1 (first_nonfinite_row, one wait);
/// inside a deferring scope -1 at once, the check deferred to the scope's flag.
template <class T>
long long checked_row(cudaStream_t stream, View<const T> y, unsigned* flag) {
    if (deferring()) {
        defer_nonfinite<T>(stream, y);
        return -1;
    }
    return first_nonfinite_row<T>(stream, y, flag);
}
#endif

}  // namespace titans::backend::cuda
