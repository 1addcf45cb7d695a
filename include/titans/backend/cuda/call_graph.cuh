#pragma once
// titans/backend/cuda/call_graph.cuh: a deferring call's work recorded, then run as one CUDA
// graph (opt-in: set_call_graphs(true)).
//
// A decode call is a few dozen small launches (kernels and cuBLAS products), each costing the
// host a few microseconds: at batch 1 the host's launches, not the GPU, bound a token. With
// call graphs on, the work a deferring CallScope (call_scope.cuh) queues on this thread's
// stream is recorded instead of launched (launch(), gemm() and memset_async() record; the
// host logic runs as before) until something must follow it: a copy to or from the host, a
// wait, a free, a launch on another stream, the scope's end. There settle_recorded() runs the
// recorded segment:
//   - a segment whose shape (its kernels with their grids, blocks and shared memory, and its
//     products and memsets with every argument) matches a graph this thread built before:
//     the kernels whose arguments changed (a decode position, a window offset) updated in the
//     instantiated graph (cudaGraphExecKernelNodeSetParams), then one cudaGraphLaunch;
//   - a shape seen once before: built as a graph (a kernel node per kernel, a child graph
//     captured per product or memset), kept (the last `graph_cache_size` shapes), launched;
//   - otherwise (a first sighting, fewer than `graph_min_records` records, or a shape whose
//     build failed): run as recorded, in order, with the arguments recorded.
// The work and its order are the same in every case: the results are the same bits as
// without graphs. Under the CPU emulator a "graph" is the recorded segment run again with
// the updated arguments, and any stream operation issued past the tape while it holds work
// aborts the test (emulated_streams.h): that is how the tests find a call site that would
// run out of order.
//
//     titans::backend::cuda::set_call_graphs(true);       // process-wide, before decoding
//     auto st = model.make_state(1);
//     for (const auto& x : tokens) y = model.forward(st, x);  // once warm: one graph launch
//     auto s = titans::backend::cuda::call_graph_stats();    // built, launched, updated, direct

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "runtime.cuh"

namespace titans::backend::cuda {

/// Process-wide switch for call graphs: off by default (on an H200 they took 6% off a decode
/// token bound by its kernels; docs/cuda.md), on from the start when the environment sets
/// TITANS_CALL_GRAPHS=1.
inline std::atomic<bool>& call_graphs_flag() {
    static std::atomic<bool> flag{env_switch("TITANS_CALL_GRAPHS")};
    return flag;
}
/// Read when a deferring CallScope opens.
inline void set_call_graphs(bool on) { call_graphs_flag().store(on); }
[[nodiscard]] inline bool call_graphs() { return call_graphs_flag().load(); }

/// What this thread's tape did (for tests and benchmarks): graphs built, graph launches,
/// kernel nodes updated, segments run as recorded.
struct CallGraphStats {
    long long built = 0, launched = 0, updated = 0, direct = 0;
};
inline CallGraphStats& call_graph_stats() {
    thread_local CallGraphStats s;
    return s;
}

namespace tape_detail {

struct Record;
/// Runs a record on a stream from its argument bytes.
using Run = void (*)(const unsigned char* bytes, const Record& r, cudaStream_t stream);
/// A kernel record's argument addresses (cudaKernelNodeParams::kernelParams).
using Params = void (*)(unsigned char* bytes, void** out);

/// One recorded operation: a kernel (params set) or an operation run by `run` (a product, a
/// memset: its arguments part of the shape). Its arguments are `size` bytes at `at`.
struct Record {
    const void* key;  // the kernel, or the operation's run function
    Run run;
    Params params;
    dim3 grid, block;
    std::size_t shmem, at, size;
};

inline bool same_dim(dim3 a, dim3 b) { return a.x == b.x && a.y == b.y && a.z == b.z; }

/// Whether b has a's shape: the same records (a product's or memset's arguments included).
inline bool same_shape(const std::vector<Record>& a, const unsigned char* ab,
                       const std::vector<Record>& b, const unsigned char* bb) {
    if (a.size() != b.size()) {
        return false;
    }
    for (std::size_t i = 0; i < a.size(); ++i) {
        const Record &x = a[i], &y = b[i];
        if (x.key != y.key || x.size != y.size || x.shmem != y.shmem || !same_dim(x.grid, y.grid) ||
            !same_dim(x.block, y.block) ||
            (x.params == nullptr && std::memcmp(ab + x.at, bb + y.at, x.size) != 0)) {
            return false;
        }
    }
    return true;
}

/// A hash of a segment's shape (same_shape's fields), FNV-1a over 8-byte words (a
/// decode token's shape is a few kilobytes: hashed in about a microsecond).
inline std::uint64_t shape_hash(const std::vector<Record>& rs, const unsigned char* bytes) {
    std::uint64_t h = 1469598103934665603ULL;
    auto mix = [&h](const void* p, std::size_t n) {
        const auto* c = static_cast<const unsigned char*>(p);
        std::size_t i = 0;
        for (; i + 8 <= n; i += 8) {
            std::uint64_t w = 0;
            std::memcpy(&w, c + i, 8);
            h = (h ^ w) * 1099511628211ULL;
        }
        for (; i < n; ++i) {
            h = (h ^ c[i]) * 1099511628211ULL;
        }
    };
    for (const Record& r : rs) {
        mix(&r.key, sizeof(r.key));
        const unsigned dims[6] = {r.grid.x, r.grid.y, r.grid.z, r.block.x, r.block.y, r.block.z};
        mix(dims, sizeof(dims));
        mix(&r.shmem, sizeof(r.shmem));
        if (r.params == nullptr) {
            mix(bytes + r.at, r.size);
        }
    }
    return h;
}

/// Runs every record in order (the segment as recorded); a launch error throws CudaError.
inline void run_records(const std::vector<Record>& rs, const unsigned char* bytes,
                        cudaStream_t stream) {
    for (const Record& r : rs) {
        r.run(bytes, r, stream);
        check(cudaGetLastError(), "a recorded titans CUDA launch");
    }
}

/// A segment kept as a graph: its records and argument bytes as last launched, and (nvcc) the
/// instantiated graph with the node of each record.
struct Graph {
    std::uint64_t hash = 0;
    std::vector<Record> records;
    std::vector<unsigned char> bytes;
    long long used = 0;
#if defined(__CUDACC__)
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    std::vector<cudaGraphNode_t> nodes;
    ~Graph() {
        if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
        if (graph != nullptr) (void)cudaGraphDestroy(graph);
    }
#endif
    Graph() = default;
    Graph(const Graph&) = delete;
    Graph& operator=(const Graph&) = delete;

#if defined(__CUDACC__)
    /// A kernel record's node parameters, its arguments read from `from` (a segment's bytes).
    static cudaKernelNodeParams node_params(const Record& r, unsigned char* from,
                                            std::array<void*, 64>& args) {
        r.params(from + r.at, args.data());
        cudaKernelNodeParams p{};
        p.func = const_cast<void*>(r.key);
        p.gridDim = r.grid;
        p.blockDim = r.block;
        p.sharedMemBytes = static_cast<unsigned>(r.shmem);
        p.kernelParams = args.data();
        return p;
    }
    /// The graph of the records, in order: a kernel node per kernel, a captured child graph
    /// per other operation; then instantiated. CudaError if any step fails.
    void build(cudaStream_t stream) {
        check(cudaGraphCreate(&graph, 0), "cudaGraphCreate");
        cudaGraphNode_t prev = nullptr;
        std::array<void*, 64> args{};
        for (std::size_t i = 0; i < records.size(); ++i) {
            const Record& r = records[i];
            cudaGraphNode_t node = nullptr;
            const std::size_t deps = prev == nullptr ? 0 : 1;
            if (r.params != nullptr) {
                const cudaKernelNodeParams p = node_params(r, bytes.data(), args);
                check(cudaGraphAddKernelNode(&node, graph, &prev, deps, &p),
                      "cudaGraphAddKernelNode");
            } else {
                cudaGraph_t child = nullptr;
                check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
                      "cudaStreamBeginCapture");
                r.run(bytes.data(), r, stream);
                const cudaError_t e = cudaStreamEndCapture(stream, &child);
                check(e, "cudaStreamEndCapture (a recorded product or memset)");
                const cudaError_t a = cudaGraphAddChildGraphNode(&node, graph, &prev, deps, child);
                (void)cudaGraphDestroy(child);  // the node holds its own copy
                check(a, "cudaGraphAddChildGraphNode");
            }
            nodes.push_back(node);
            prev = node;
        }
        check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    }
#endif
};

}  // namespace tape_detail

/// This thread's recording of a deferring call's work (see the file comment). A record's
/// arguments live in one byte buffer kept across calls: once warm, recording allocates nothing.
class CallTape {
public:
    static constexpr std::size_t graph_min_records = 6;
    static constexpr std::size_t graph_cache_size = 16;

    /// Whether launches on some stream are recorded now.
    [[nodiscard]] bool recording() const { return open_ > 0 && paused_ == 0; }
    /// Whether launches on `stream` are recorded now.
    [[nodiscard]] bool records(cudaStream_t stream) const {
        return recording() && stream == stream_;
    }
    /// Recording starts on `stream` (scopes nest: the outermost one's stream).
    void open(cudaStream_t stream) {
        if (open_++ == 0) {
            stream_ = stream;
        }
    }
    /// The outermost close runs what is recorded.
    void close() {
        if (open_ > 0 && --open_ == 0) {
            settle();
        }
    }
    /// Recording paused (a strict scope: every check waits) after what is recorded runs.
    void pause() {
        settle();
        ++paused_;
    }
    void resume() { --paused_; }

    /// Room for `size` argument bytes, 16-byte aligned; the record joins the segment.
    unsigned char* add(const tape_detail::Record& r) {
        const std::size_t at = (bytes_.size() + 15) / 16 * 16;
        bytes_.resize(at + r.size);  // zeroed: the gaps between arguments compare equal
        records_.push_back(r);
        records_.back().at = at;
        holding(true);
        return bytes_.data() + at;
    }

    /// Runs the recorded segment (see the file comment), then clears it, whatever happens.
    void settle() {
        if (records_.empty()) {
            return;
        }
        holding(false);
        struct Clear {
            CallTape& t;
            ~Clear() {
                t.records_.clear();
                t.bytes_.clear();
            }
        } clear{*this};
        if (records_.size() < graph_min_records || !run_graph()) {
            tape_detail::run_records(records_, bytes_.data(), stream_);
            ++call_graph_stats().direct;
        }
    }

private:
    /// The segment as a graph, if its shape has one or earns one now; false: not run.
    bool run_graph() {
        const std::uint64_t h = tape_detail::shape_hash(records_, bytes_.data());
        tape_detail::Graph* g = find(h);
        if (g == nullptr) {
            if (!seen_before(h)) {
                return false;
            }
            g = build(h);
            if (g == nullptr) {
                return false;
            }
        } else {
            update(*g);
        }
        g->used = ++clock_;
#if defined(__CUDACC__)
        check(cudaGraphLaunch(g->exec, stream_), "cudaGraphLaunch");
#else
        tape_detail::run_records(g->records, g->bytes.data(), stream_);
#endif
        ++call_graph_stats().launched;
        return true;
    }

    tape_detail::Graph* find(std::uint64_t h) {
        for (auto& g : graphs_) {
            if (g->hash == h &&
                tape_detail::same_shape(g->records, g->bytes.data(), records_, bytes_.data())) {
                return g.get();
            }
        }
        return nullptr;
    }

    /// Whether h was seen before (remembered now if not); a shape whose build failed stays
    /// out for good.
    bool seen_before(std::uint64_t h) {
        for (const std::uint64_t f : failed_) {
            if (f == h) return false;
        }
        for (const std::uint64_t s : seen_) {
            if (s == h) return true;
        }
        seen_[seen_at_++ % seen_.size()] = h;
        return false;
    }

    /// The segment's graph, kept in place of the least recently used one past the cache's
    /// size; nullptr (the shape marked failed, no error pending) if the runtime refuses it.
    tape_detail::Graph* build(std::uint64_t h) {
        auto g = std::make_unique<tape_detail::Graph>();
        g->hash = h;
        g->records = records_;
        g->bytes = bytes_;
#if defined(__CUDACC__)
        try {
            g->build(stream_);
        } catch (const CudaError&) {
            cudaStreamCaptureStatus status{};
            if (cudaStreamIsCapturing(stream_, &status) == cudaSuccess &&
                status != cudaStreamCaptureStatusNone) {
                cudaGraph_t broken = nullptr;
                (void)cudaStreamEndCapture(stream_, &broken);
                if (broken != nullptr) (void)cudaGraphDestroy(broken);
            }
            (void)cudaGetLastError();
            failed_.push_back(h);
            return nullptr;
        }
#endif
        ++call_graph_stats().built;
        if (graphs_.size() < graph_cache_size) {
            graphs_.push_back(std::move(g));
            return graphs_.back().get();
        }
        auto* oldest = &graphs_.front();
        for (auto& k : graphs_) {
            if (k->used < (*oldest)->used) oldest = &k;
        }
        *oldest = std::move(g);
        return oldest->get();
    }

    /// g's kernels given the segment's arguments where they differ.
    void update(tape_detail::Graph& g) {
        for (std::size_t i = 0; i < records_.size(); ++i) {
            const tape_detail::Record &r = records_[i], &k = g.records[i];
            if (r.params == nullptr ||
                std::memcmp(bytes_.data() + r.at, g.bytes.data() + k.at, r.size) == 0) {
                continue;
            }
#if defined(__CUDACC__)
            std::array<void*, 64> args{};
            const cudaKernelNodeParams p = tape_detail::Graph::node_params(r, bytes_.data(), args);
            check(cudaGraphExecKernelNodeSetParams(g.exec, g.nodes[i], &p),
                  "cudaGraphExecKernelNodeSetParams");
#endif
            // (after the node took them: g's bytes say what its nodes hold)
            std::memcpy(g.bytes.data() + k.at, bytes_.data() + r.at, r.size);
            ++call_graph_stats().updated;
        }
    }

    /// Tells runtime.cuh (settle_recorded) and the emulator whether work waits here.
    void holding(bool h);

    std::vector<tape_detail::Record> records_;
    std::vector<unsigned char> bytes_;
    std::vector<std::unique_ptr<tape_detail::Graph>> graphs_;
    std::array<std::uint64_t, 32> seen_{};
    std::size_t seen_at_ = 0;
    std::vector<std::uint64_t> failed_;
    long long clock_ = 0;
    cudaStream_t stream_{};
    int open_ = 0, paused_ = 0;
};

/// This host thread's tape.
inline CallTape& call_tape() {
    thread_local CallTape t;
    return t;
}

inline void CallTape::holding(bool h) {
    tape_detail::settle_hook() = h ? +[] { call_tape().settle(); } : nullptr;
#if !defined(__CUDACC__)
    ::cuda_emulation::tape_holds_work() = h;
#endif
}

/// Records op(args, stream) on this thread's tape if it records `stream`: an operation whose
/// every argument is part of its segment's shape. False: not recorded (run it now).
template <class Args>
bool record_op(cudaStream_t stream, tape_detail::Run run, const Args& args) {
    static_assert(std::has_unique_object_representations_v<Args> && alignof(Args) <= 16,
                  "an operation's arguments are compared as bytes: no padding, no floats");
    CallTape& t = call_tape();
    if (!t.records(stream)) {
        return false;
    }
    unsigned char* at =
        t.add({reinterpret_cast<const void*>(run), run, nullptr, dim3(), dim3(), 0, 0, sizeof(Args)});
    std::memcpy(at, &args, sizeof(Args));
    return true;
}

namespace tape_detail {
/// A stream operation's arguments (Args::issue(args, stream) makes the call): recorded on the
/// tape where it records the stream, else issued now after the recorded work.
template <class Args>
void record_or_issue(cudaStream_t stream, const Args& args, const char* what) {
    constexpr Run run = [](const unsigned char* b, const Record& r, cudaStream_t s) {
        Args a;
        std::memcpy(&a, b + r.at, sizeof(a));
        (void)Args::issue(a, s);  // (checked after the segment)
    };
    if (!record_op(stream, run, args)) {
        settle_recorded();
        check(Args::issue(args, stream), what);
    }
}
struct MemsetArgs {
    void* p;
    long long value;
    std::size_t bytes;
    static cudaError_t issue(const MemsetArgs& a, cudaStream_t s) {
        return cudaMemsetAsync(a.p, static_cast<int>(a.value), a.bytes, s);
    }
};
struct CopyArgs {
    void* to;
    const void* from;
    std::size_t bytes;
    static cudaError_t issue(const CopyArgs& a, cudaStream_t s) {
        return cudaMemcpyAsync(a.to, a.from, a.bytes, cudaMemcpyDeviceToDevice, s);
    }
};
}  // namespace tape_detail

/// cudaMemsetAsync(p, value, bytes, stream), recorded where the tape records the stream.
inline void memset_async(void* p, int value, std::size_t bytes, cudaStream_t stream,
                         const char* what) {
    tape_detail::record_or_issue(stream, tape_detail::MemsetArgs{p, value, bytes}, what);
}

/// cudaMemcpyAsync(to, from, bytes, device to device, stream), recorded where the tape
/// records the stream.
inline void copy_async(void* to, const void* from, std::size_t bytes, cudaStream_t stream,
                       const char* what) {
    tape_detail::record_or_issue(stream, tape_detail::CopyArgs{to, from, bytes}, what);
}

}  // namespace titans::backend::cuda
