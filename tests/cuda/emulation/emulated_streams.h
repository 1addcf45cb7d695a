#pragma once
// tests/cuda/emulation/emulated_streams.h: when the emulator's work runs (cuda_runtime.h
// includes it; not a header of its own).
//
// Eager (the default): every launch, copy, memset, GEMM and stream-ordered free runs when its
// call returns, so two streams' work always runs in call order and a missing order between
// them cannot show.
//
// Lazy (set_lazy_streams(true), or TITANS_EMULATION_LAZY=1 in the environment): work on a
// created stream is queued on it and runs, in order, only when something waits for that
// stream:
//   - cudaStreamSynchronize, cudaEventSynchronize of an event recorded on it,
//     cudaStreamDestroy;
//   - a copy from it into host memory (host memory here is pageable, so CUDA returns from
//     such a copy once it is done);
//   - cudaDeviceSynchronize, and any work on the legacy stream (0), which first runs every
//     stream's queue (it waits for every blocking stream, as CUDA's does).
// A copy from host memory takes its bytes at the call (CUDA stages pageable memory then).
// Work that reads what another stream wrote, with nothing ordering the two, then sees the
// memory as it was before, where the eager mode hides the race.

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace cuda_emulation {

/// Set by titans' call tape (call_graph.cuh) while it holds recorded work that has not run:
/// any stream operation, wait or free issued then would run before that work, out of the
/// call's order, so it aborts (a call site that should record or settle the tape first).
inline bool& tape_holds_work() {
    thread_local bool holds = false;
    return holds;
}
/// Aborts if the tape holds work (see tape_holds_work), naming what was issued.
inline void check_tape(const char* what) {
    if (tape_holds_work()) {
        std::fprintf(stderr,
                     "cuda emulation: %s issued while titans' call tape holds recorded work "
                     "(it would run before that work)\n",
                     what);
        std::abort();
    }
}

/// The legacy default stream (0 or cudaStreamLegacy).
inline bool is_legacy(cudaStream_t s) { return s == nullptr || s == cudaStreamLegacy; }

/// Every stream's queued work (lazy mode).
struct StreamQueues {
    std::mutex m;
    std::map<cudaStream_t, std::deque<std::function<void()>>> q;
};
/// Never destroyed: a stream destroyed by a static's destructor at exit still finds it, and
/// work still queued then stays reachable (no leak report for its buffers).
inline StreamQueues& stream_queues() {
    static StreamQueues* s = new StreamQueues;
    return *s;
}

inline std::atomic<bool>& lazy_flag() {
    static std::atomic<bool> flag{[] {
        const char* v = std::getenv("TITANS_EMULATION_LAZY");
        return v != nullptr && std::strcmp(v, "1") == 0;
    }()};
    return flag;
}
/// Whether work on created streams is queued until waited for.
inline bool lazy_streams() { return lazy_flag().load(); }

/// Runs stream s's queued work, in order (the legacy stream: every stream's).
inline void flush_stream(cudaStream_t s);

/// Runs every stream's queued work.
inline void flush_all_streams() {
    std::vector<cudaStream_t> keys;
    {
        StreamQueues& sq = stream_queues();
        const std::lock_guard<std::mutex> lock(sq.m);
        for (const auto& [k, q] : sq.q) {
            if (!q.empty()) {
                keys.push_back(k);
            }
        }
    }
    for (cudaStream_t k : keys) {
        flush_stream(k);
    }
}

inline void flush_stream(cudaStream_t s) {
    if (is_legacy(s)) {
        flush_all_streams();
        return;
    }
    StreamQueues& sq = stream_queues();
    for (;;) {
        std::function<void()> f;
        {
            const std::lock_guard<std::mutex> lock(sq.m);
            const auto it = sq.q.find(s);
            if (it == sq.q.end() || it->second.empty()) {
                return;
            }
            f = std::move(it->second.front());
            it->second.pop_front();
        }
        f();
    }
}

/// Turns the lazy mode on or off (the queued work runs first).
inline void set_lazy_streams(bool on) {
    flush_all_streams();
    lazy_flag().store(on);
}

/// Runs f now (eager mode; the legacy stream, after every stream's queue) or queues it on s.
inline void submit(cudaStream_t s, std::function<void()> f) {
    check_tape("a stream operation");
    if (!lazy_streams() || is_legacy(s)) {
        if (lazy_streams()) {
            flush_all_streams();
        }
        f();
        return;
    }
    StreamQueues& sq = stream_queues();
    const std::lock_guard<std::mutex> lock(sq.m);
    sq.q[s].push_back(std::move(f));
}

/// A copy's bytes moved by `move(dst, src)` on `stream`: into host memory, once the stream's
/// queue has run (the call returns with the copy done); from host memory, from a copy of the
/// source's `src_span` bytes taken now; between device buffers, queued.
template <class Move>
void submit_copy(cudaStream_t stream, char* dst, bool dst_host, const char* src, bool src_host,
                 std::size_t src_span, Move move) {
    if (!lazy_streams() || is_legacy(stream)) {
        submit(stream, [=] { move(dst, src); });
    } else if (dst_host) {
        flush_stream(stream);
        move(dst, src);
    } else if (src_host) {
        auto staged = std::make_shared<std::vector<char>>(src, src + src_span);
        submit(stream, [=] { move(dst, staged->data()); });
    } else {
        submit(stream, [=] { move(dst, src); });
    }
}

}  // namespace cuda_emulation
