#pragma once
// tests/backend/simulated_device.hpp: a test-only backend whose data lives where the library
// cannot reach it, to prove the backend seam without a GPU.
//
// titans_test::SimulatedDevice is a backend policy like titans::backend::Cpu, but its
// parameters and states live in an arena (sim::Arena) that only its kernels can open: the
// State a caller holds is an id plus host-readable metadata (batch, position, configuration),
// and the Prepared parameters are an id too. Matrices cross between the host and the arena only
// through Transfer<SimulatedDevice, T> (upload, download, buffers in the arena); the kernels
// take views and refuse (std::logic_error) any view that does not lie in an arena buffer, so a
// layer that hands host memory to a kernel (a missing transfer) fails here. The kernels
// delegate the math to the CPU kernels on the arena's data, so results must equal the CPU
// backend's bit for bit. Buffers are born NaN, so an output a kernel forgot to write shows. When an arena
// object is freed its tensors are overwritten with NaN first, and an id that was freed (or never
// existed) throws on use: a layer that kept a pointer into backend memory, or reached it other
// than through the kernels, fails here. Every family runs on it: the memory, attention, RMSNorm
// and FeedForward kernels and their training passes (the memory's staged API too, so every
// block kind trains here), and so Block<T, SimulatedDevice> and Model<T, SimulatedDevice>,
// trained too;
// states reach the host (checkpoints) only through their tensors() hook, the transfer.
#include <titans/titans.hpp>

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <typeindex>
#include <functional>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace titans_test {

/// Tag type of the simulated device.
struct SimulatedDevice {
    static constexpr const char* name = "simulated-device";
};

namespace sim {

/// Objects owned by the device, by id. Thread-safe; ids are never reused.
class Arena {
public:
    static Arena& instance() {
        static Arena arena;
        return arena;
    }

    /// Moves x into the arena; `poison(x)` runs before x is freed. A matrix is a buffer: views
    /// into it count as device memory (owns()).
    template <class X, class Poison>
    std::uint64_t put(X x, Poison poison) {
        auto obj = std::make_shared<X>(std::move(x));
        Entry e{obj, std::type_index(typeid(X)),
                [obj, poison]() mutable { poison(*obj); }, nullptr, nullptr};
        if constexpr (requires(X& m) { m.data(); m.size(); }) {
            e.begin = reinterpret_cast<const char*>(obj->data());
            e.end = reinterpret_cast<const char*>(obj->data() + obj->size());
        }
        const std::lock_guard<std::mutex> lock(mutex_);
        const std::uint64_t id = ++next_;
        entries_.emplace(id, std::move(e));
        return id;
    }

    /// The object with this id; std::logic_error if it was freed, never existed, or has
    /// another type.
    template <class X>
    X& at(std::uint64_t id) {
        const std::lock_guard<std::mutex> lock(mutex_);
        const auto it = entries_.find(id);
        if (it == entries_.end()) {
            throw std::logic_error("simulated device: access to freed or unknown id " +
                                   std::to_string(id));
        }
        if (it->second.type != std::type_index(typeid(X))) {
            throw std::logic_error("simulated device: id " + std::to_string(id) +
                                   " holds another type");
        }
        return *static_cast<X*>(it->second.object.get());
    }

    /// Poisons and frees the object (no-op for id 0).
    void release(std::uint64_t id) {
        if (id == 0) return;
        Entry e;
        {
            const std::lock_guard<std::mutex> lock(mutex_);
            const auto it = entries_.find(id);
            if (it == entries_.end()) return;
            e = std::move(it->second);
            entries_.erase(it);
        }
        e.poison();
    }

    /// Whether bytes [p, p + n) lie inside one buffer of the arena.
    [[nodiscard]] bool owns(const void* p, std::size_t n) const {
        const auto* b = static_cast<const char*>(p);
        const std::lock_guard<std::mutex> lock(mutex_);
        for (const auto& [id, e] : entries_) {
            if (e.begin != nullptr && std::less_equal<>{}(e.begin, b) &&
                std::less_equal<>{}(b + n, e.end)) {
                return true;
            }
        }
        return false;
    }

    /// Objects alive now (leak checks).
    [[nodiscard]] std::size_t live() const {
        const std::lock_guard<std::mutex> lock(mutex_);
        return entries_.size();
    }

private:
    struct Entry {
        std::shared_ptr<void> object;
        std::type_index type = std::type_index(typeid(void));
        std::function<void()> poison;
        const char* begin = nullptr;  // a buffer's storage, [begin, end)
        const char* end = nullptr;
    };
    mutable std::mutex mutex_;
    std::unordered_map<std::uint64_t, Entry> entries_;
    std::uint64_t next_ = 0;
};

/// Owns one arena object: copying copies it on the device, destroying frees (and poisons) it.
template <class X>
class Handle {
public:
    using Poison = std::function<void(X&)>;
    Handle() = default;
    Handle(X x, Poison poison) : poison_(std::move(poison)) {
        id_ = Arena::instance().put(std::move(x), poison_);
    }
    Handle(const Handle& o) : poison_(o.poison_) {
        if (o.id_ != 0) id_ = Arena::instance().put(X(o.get()), poison_);
    }
    Handle(Handle&& o) noexcept : id_(std::exchange(o.id_, 0)), poison_(std::move(o.poison_)) {}
    Handle& operator=(Handle o) noexcept {
        std::swap(id_, o.id_);
        std::swap(poison_, o.poison_);
        return *this;
    }
    ~Handle() { Arena::instance().release(id_); }

    [[nodiscard]] X& get() const { return Arena::instance().at<X>(id_); }
    [[nodiscard]] std::uint64_t id() const { return id_; }

private:
    std::uint64_t id_ = 0;
    Poison poison_;
};

/// Overwrites every tensor a visitor reaches with NaN and every integer with -1.
struct PoisonVisitor {
    template <class X>
    void operator()(const std::string&, X& x) const {
        if constexpr (std::is_integral_v<X>) {
            x = -1;
        } else {
            x.setConstant(std::numeric_limits<typename X::Scalar>::quiet_NaN());
        }
    }
};

/// Parameters uploaded once per object: an arena copy of *host behind a handle that copies of
/// the object share. `poison(copy)` runs when the last user lets go.
template <class P, class Poison>
std::shared_ptr<const Handle<std::shared_ptr<const P>>> upload(
    const std::shared_ptr<const P>& host, Poison poison) {
    auto copy = std::make_shared<P>(*host);
    return std::make_shared<const Handle<std::shared_ptr<const P>>>(
        std::shared_ptr<const P>(copy),
        [copy, poison](std::shared_ptr<const P>&) { poison(*copy); });
}

/// Copies between the host and the device, counted: every Transfer upload and download, and
/// the token ids a gather takes to the device (what the transfer-count tests read). A layer
/// state's tensors crossing for a checkpoint are not counted (a MAC block state's segment rows
/// are: they cross through Transfer).
struct Traffic {
    std::atomic<long> uploads{0}, downloads{0};
    static Traffic& instance() {
        static Traffic t;
        return t;
    }
};

/// A matrix in the arena.
template <class T>
using Buffer = Handle<titans::Matrix<T>>;

template <class T>
Buffer<T> make_buffer(titans::Matrix<T> m) {
    return Buffer<T>(std::move(m), [](titans::Matrix<T>& x) {
        x.setConstant(std::numeric_limits<T>::quiet_NaN());
    });
}

/// Throws std::logic_error unless the entries of v lie in an arena buffer: what a kernel checks
/// of every view it is given (host memory reaching a kernel is a missing transfer).
template <class T>
void require_device(titans::View<T> v, const char* what) {
    if (v.empty()) return;
    const std::size_t bytes =
        static_cast<std::size_t>((v.rows - 1) * v.stride + v.cols) * sizeof(T);
    if (!Arena::instance().owns(v.data, bytes)) {
        throw std::logic_error(std::string("simulated device: ") + what +
                               " is not device memory (host memory reached a kernel: a "
                               "missing transfer)");
    }
}

/// require_device for each view, named by the matching entry of `what`.
template <class T, std::size_t K>
void require_devices(const titans::View<const T> (&views)[K], const char* const (&what)[K]) {
    for (std::size_t i = 0; i < K; ++i) require_device(views[i], what[i]);
}

/// Host <-> device transfer of a state's tensors: the visitor sees host copies (downloads);
/// when Self is not const what it assigned is uploaded back.
template <class Host, class Self, class V>
void transfer(Self& self, V& v) {
    if constexpr (std::is_const_v<Self>) {
        const Host copy = self.device_.get();  // download
        Host::tensors(copy, v);
    } else {
        Host copy = self.device_.get();
        Host::tensors(copy, v);
        self.device_.get() = std::move(copy);  // upload
    }
}

/// The memory's state on the simulated device: an arena id and host-readable metadata.
template <class T>
class MemoryState {
public:
    MemoryState() = default;
    [[nodiscard]] int batch() const { return batch_; }
    [[nodiscard]] std::int64_t position() const { return position_; }
    [[nodiscard]] const titans::MemoryConfig& config() const { return cfg_; }
    /// Tokens of the chunk in progress (as the CPU state's).
    [[nodiscard]] int pending() const {
        return static_cast<int>(position_ % static_cast<std::int64_t>(cfg_.effective_chunk()));
    }

    /// The checkpoint hook: the transfer between the device and the host (each tensor copied
    /// out to the visitor, and back in when Self is not const).
    template <class Self, class V>
    static void tensors(Self& self, V&& v) {
        transfer<titans::MemoryState<T>>(self, v);
        if constexpr (!std::is_const_v<Self>) self.position_ = self.device_.get().position();
    }

private:
    template <class, class>
    friend struct titans::backend::MemoryKernels;
    template <class, class>
    friend struct titans::backend::MemoryTraining;
    template <class Host, class Self, class V>
    friend void transfer(Self& self, V& v);
    Handle<titans::MemoryState<T>> device_;
    titans::MemoryConfig cfg_{};
    int batch_ = 0;
    std::int64_t position_ = 0;
};

/// A memory snapshot on the simulated device (MAC's segment-start weights): an arena copy of
/// the CPU's and its pair count.
template <class T>
struct MemorySnapshot {
    Handle<titans::MemorySnapshot<T>> device_;
    std::size_t pairs_ = 0;
    [[nodiscard]] std::size_t pairs() const { return pairs_; }
    template <class Self, class V>
    static void tensors(Self& self, V&& v) {
        transfer<titans::MemorySnapshot<T>>(self, v);
    }
};

template <class T>
MemorySnapshot<T> make_snapshot(titans::MemorySnapshot<T> host) {
    MemorySnapshot<T> s;
    s.pairs_ = host.pairs();
    s.device_ = Handle<titans::MemorySnapshot<T>>(
        std::move(host), [](titans::MemorySnapshot<T>& x) {
            titans::MemorySnapshot<T>::tensors(x, PoisonVisitor{});
        });
    return s;
}

/// The attention's state on the simulated device: an arena id and host-readable metadata.
template <class T>
class AttentionState {
public:
    AttentionState() = default;
    [[nodiscard]] int batch() const { return batch_; }
    [[nodiscard]] std::int64_t position() const { return position_; }
    [[nodiscard]] const titans::AttentionConfig& config() const { return cfg_; }
    [[nodiscard]] bool well_formed() const { return well_formed_; }
    [[nodiscard]] std::pair<Eigen::Index, Eigen::Index> window_rows(int b) const {
        return rows_.at(static_cast<std::size_t>(b));
    }
    template <class Self, class V>
    static void tensors(Self& self, V&& v) {
        transfer<titans::AttentionState<T>>(self, v);
        if constexpr (!std::is_const_v<Self>) self.mirror();
    }

private:
    template <class, class>
    friend struct titans::backend::AttentionKernels;
    template <class, class>
    friend struct titans::backend::AttentionTraining;
    template <class Host, class Self, class V>
    friend void transfer(Self& self, V& v);
    /// Everything a caller may read without the kernels, copied from the device.
    void mirror() {
        const titans::AttentionState<T>& d = device_.get();
        position_ = d.position();
        well_formed_ = d.well_formed();
        rows_.resize(static_cast<std::size_t>(batch_));
        for (int b = 0; b < batch_; ++b) {
            rows_[static_cast<std::size_t>(b)] = d.window_rows(b);
        }
    }
    Handle<titans::AttentionState<T>> device_;
    titans::AttentionConfig cfg_{};
    int batch_ = 0;
    std::int64_t position_ = 0;
    bool well_formed_ = false;
    std::vector<std::pair<Eigen::Index, Eigen::Index>> rows_;
};

/// A projected prefix on the simulated device: k and v in arena buffers, its row count and
/// sharing.
template <class T>
struct AttentionPrefix {
    Buffer<T> k, v;
    Eigen::Index rows_ = 0;
    titans::PrefixSharing sharing = titans::PrefixSharing::Shared;
    [[nodiscard]] Eigen::Index rows() const { return rows_; }
    [[nodiscard]] titans::PrefixView<T> view() const {
        return {titans::view_of(k.get()), titans::view_of(v.get()), sharing};
    }
};

}  // namespace sim
}  // namespace titans_test

namespace titans::backend {

template <>
struct BackendTraits<titans_test::SimulatedDevice> {
    static constexpr bool host_accessible = false;
    template <class T>
    static constexpr bool supports = std::is_same_v<T, float> || std::is_same_v<T, double>;
};

/// Matrices in the arena: the only way between the host and the simulated device.
template <class T>
struct Transfer<titans_test::SimulatedDevice, T> {
    using Buffer = titans_test::sim::Buffer<T>;
    static Buffer allocate(std::ptrdiff_t rows, std::ptrdiff_t cols) {
        return titans_test::sim::make_buffer<T>(
            Matrix<T>::Constant(rows, cols, std::numeric_limits<T>::quiet_NaN()));
    }
    static Buffer upload(View<const T> host) {
        ++titans_test::sim::Traffic::instance().uploads;
        return titans_test::sim::make_buffer<T>(Matrix<T>(cpu::as_eigen(host)));
    }
    static View<T> view(Buffer& b) { return view_of(b.get()); }
    static View<const T> view(const Buffer& b) { return view_of(b.get()); }
    static void download(View<const T> from, View<T> host) {
        titans_test::sim::require_device(from, "a downloaded view");
        ++titans_test::sim::Traffic::instance().downloads;
        cpu::as_eigen(host) = cpu::as_eigen(from);
    }
    static void accumulate(View<const T> host, View<T> to) {
        titans_test::sim::require_device(to, "an accumulated view");
        ++titans_test::sim::Traffic::instance().uploads;
        cpu::as_eigen(to) += cpu::as_eigen(host);
    }
};

/// The memory kernels of the simulated device: the CPU kernels on the arena's data.
template <class T>
struct MemoryKernels<titans_test::SimulatedDevice, T> {
    using Host = MemoryKernels<Cpu, T>;
    using Mat = Matrix<T>;
    using State = titans_test::sim::MemoryState<T>;
    /// The parameters uploaded once per object (copies of the object share them).
    using Prepared = std::shared_ptr<const titans_test::sim::Handle<typename Host::Prepared>>;

    static Prepared prepare(const MemoryConfig& cfg,
                            const std::shared_ptr<const MemoryParams<T>>& host) {
        return titans_test::sim::upload(host, [cfg](MemoryParams<T>& p) {
            MemoryParams<T>::tensors(p, cfg, titans_test::sim::PoisonVisitor{});
        });
    }
    /// From the flat parameters in the arena: a copy there (no transfer).
    static Prepared prepare_flat(const MemoryConfig& cfg, const MemoryParams<T>& shapes,
                                 View<const T> flat) {
        titans_test::sim::require_device(flat, "flat");
        return prepare(cfg, Host::prepare_flat(cfg, shapes, flat));
    }

    static State make_state(const MemoryConfig& cfg, const Prepared& p, int batch) {
        State st;
        st.device_ = titans_test::sim::Handle<titans::MemoryState<T>>(
            Host::make_state(cfg, p->get(), batch), [](titans::MemoryState<T>& s) {
                titans::MemoryState<T>::tensors(s, titans_test::sim::PoisonVisitor{});
            });
        st.cfg_ = cfg;
        st.batch_ = batch;
        st.position_ = 0;
        return st;
    }

    static void forward(const MemoryConfig& cfg, const Prepared& p, State& st, View<const T> x,
                        View<T> y, Diagnostics<T>* diag) {
        titans_test::sim::require_device(x, "x");
        titans_test::sim::require_device(y, "y");
        try {
            Host::forward(cfg, p->get(), st.device_.get(), x, y, diag);
        } catch (...) {
            mirror(st);
            throw;
        }
        mirror(st);
    }

    static void read(const MemoryConfig& cfg, const Prepared& p, const State& st,
                     View<const T> x, View<T> y) {
        titans_test::sim::require_device(x, "x");
        titans_test::sim::require_device(y, "y");
        Host::read(cfg, p->get(), st.device_.get(), x, y);
    }

    static void read_weights(const MemoryConfig& cfg, const Prepared& p,
                             const std::vector<std::vector<Mat>>& weights, View<const T> x,
                             int batch, View<T> y) {
        titans_test::sim::require_device(x, "x");
        titans_test::sim::require_device(y, "y");
        const std::vector<std::vector<Mat>> w_device = weights;  // uploaded
        Host::read_weights(cfg, p->get(), w_device, x, batch, y);
    }

    static std::vector<Mat> current_weights(const MemoryConfig& cfg, const State& st, int b,
                                            int h) {
        return Host::current_weights(cfg, st.device_.get(), b, h);
    }
    static std::vector<Mat> current_momentum(const MemoryConfig& cfg, const State& st, int b,
                                             int h) {
        return Host::current_momentum(cfg, st.device_.get(), b, h);
    }
    static std::vector<std::vector<Mat>> all_weights(const MemoryConfig& cfg, const State& st) {
        return Host::all_weights(cfg, st.device_.get());
    }

    using Snapshot = titans_test::sim::MemorySnapshot<T>;
    static void snapshot(const MemoryConfig& cfg, const State& st, Snapshot& out) {
        typename Host::Snapshot host;
        Host::snapshot(cfg, st.device_.get(), host);
        out = titans_test::sim::make_snapshot(std::move(host));
    }
    static void read_snapshot(const MemoryConfig& cfg, const Prepared& p, const Snapshot& s,
                              View<const T> x, int batch, View<T> y) {
        titans_test::sim::require_device(x, "x");
        titans_test::sim::require_device(y, "y");
        Host::read_snapshot(cfg, p->get(), s.device_.get(), x, batch, y);
    }
    /// A snapshot's weights to the host (a download) and host weights to one (an upload).
    static std::vector<std::vector<Mat>> snapshot_weights(const MemoryConfig& cfg,
                                                          const Snapshot& s) {
        ++titans_test::sim::Traffic::instance().downloads;
        return Host::snapshot_weights(cfg, s.device_.get());
    }
    static Snapshot make_snapshot(const MemoryConfig& cfg, std::vector<std::vector<Mat>> w) {
        ++titans_test::sim::Traffic::instance().uploads;
        return titans_test::sim::make_snapshot(Host::make_snapshot(cfg, std::move(w)));
    }

    static bool begin(State& st) { return Host::begin(st.device_.get()); }
    static void commit(State& st) { Host::commit(st.device_.get()); }
    static void rollback(State& st) {
        Host::rollback(st.device_.get());
        mirror(st);
    }

    /// Everything a caller may later read of the state without the kernels: the position.
    static void mirror(State& st) { st.position_ = st.device_.get().position(); }
};

/// The attention kernels of the simulated device: the CPU kernels on the arena's data.
template <class T>
struct AttentionKernels<titans_test::SimulatedDevice, T> {
    using Host = AttentionKernels<Cpu, T>;
    using State = titans_test::sim::AttentionState<T>;
    using Prefix = titans_test::sim::AttentionPrefix<T>;
    using Prepared = std::shared_ptr<const titans_test::sim::Handle<typename Host::Prepared>>;

    static Prepared prepare(const AttentionConfig& cfg,
                            const std::shared_ptr<const AttentionParams<T>>& host) {
        return titans_test::sim::upload(host, [cfg](AttentionParams<T>& p) {
            AttentionParams<T>::tensors(p, cfg, titans_test::sim::PoisonVisitor{});
        });
    }
    static Prepared prepare_flat(const AttentionConfig& cfg, const AttentionParams<T>& shapes,
                                 View<const T> flat) {
        titans_test::sim::require_device(flat, "flat");
        return prepare(cfg, Host::prepare_flat(cfg, shapes, flat));
    }
    static State make_state(const AttentionConfig& cfg, int batch) {
        State st;
        st.device_ = titans_test::sim::Handle<titans::AttentionState<T>>(
            Host::make_state(cfg, batch), [](titans::AttentionState<T>& s) {
                titans::AttentionState<T>::tensors(s, titans_test::sim::PoisonVisitor{});
            });
        st.cfg_ = cfg;
        st.batch_ = batch;
        st.mirror();
        return st;
    }
    static Prefix project_prefix(const AttentionConfig& cfg, const Prepared& p,
                                 View<const T> rows, PrefixSharing sharing) {
        titans_test::sim::require_device(rows, "prefix");
        typename Host::Prefix host = Host::project_prefix(cfg, p->get(), rows, sharing);
        Prefix out;
        out.rows_ = host.rows();
        out.sharing = host.sharing;
        out.k = titans_test::sim::make_buffer<T>(std::move(host.k));
        out.v = titans_test::sim::make_buffer<T>(std::move(host.v));
        return out;
    }
    static void forward(const AttentionConfig& cfg, const Prepared& p, State& st,
                        View<const T> x, View<T> y, const PrefixView<T>* prefix) {
        titans_test::sim::require_device(x, "x");
        titans_test::sim::require_device(y, "y");
        if (prefix != nullptr) {
            titans_test::sim::require_device(prefix->k, "prefix keys");
            titans_test::sim::require_device(prefix->v, "prefix values");
        }
        try {
            Host::forward(cfg, p->get(), st.device_.get(), x, y, prefix);
        } catch (...) {
            st.mirror();
            throw;
        }
        st.mirror();
    }
    static void segment(const AttentionConfig& cfg, const Prepared& p, const SegmentCall<T>& c) {
        titans_test::sim::require_devices<T, 6>(
            {c.u, c.h, c.seg_k, c.seg_v, c.prefix.k, c.prefix.v},
            {"u", "h", "segment keys", "segment values", "prefix keys", "prefix values"});
        titans_test::sim::require_device(c.y, "y");
        Host::segment(cfg, p->get(), c);
    }
    static void segment_backward(const AttentionConfig& cfg, const Prepared& p,
                                 const SegmentBackwardCall<T>& c) {
        titans_test::sim::require_devices<T, 9>(
            {c.u, c.h, c.dy, c.kept_k, c.kept_v, c.after_k, c.after_v, c.prefix.k, c.prefix.v},
            {"u", "h", "dy", "kept keys", "kept values", "later keys' adjoint",
             "later values' adjoint", "prefix keys", "prefix values"});
        titans_test::sim::require_devices<T, 7>(
            {c.persistent, View<const T>(c.du), View<const T>(c.dh), View<const T>(c.dkept_k),
             View<const T>(c.dkept_v), View<const T>(c.grads), View<const T>(c.dpersistent)},
            {"persistent", "du", "dh", "kept keys' adjoint", "kept values' adjoint", "grads",
             "dpersistent"});
        Host::segment_backward(cfg, p->get(), c);
    }
    static bool begin(State& st) { return Host::begin(st.device_.get()); }
    static void commit(State& st) { Host::commit(st.device_.get()); }
    static void rollback(State& st) {
        Host::rollback(st.device_.get());
        st.mirror();
    }

};

/// The memory's training pass on the simulated device: the CPU's on the arena's data (its
/// trace the CPU's), the staged API (start, forward_part, Reverse, read_weights_backward)
/// included, so every block kind trains here.
template <class T>
struct MemoryTraining<titans_test::SimulatedDevice, T> {
    static constexpr bool available = true;
    static constexpr bool staged = true;
    static constexpr bool mid_chunk = true;
    using Host = MemoryTraining<Cpu, T>;
    using Kernels = MemoryKernels<titans_test::SimulatedDevice, T>;
    using Trace = typename Host::Trace;

    static void check_trace(const MemoryConfig& cfg, const Trace& tr, const char* where) {
        Host::check_trace(cfg, tr, where);
    }
    static void forward(const MemoryConfig& cfg, const typename Kernels::Prepared& p,
                        typename Kernels::State& st, View<const T> x, View<T> y, Trace& trace,
                        Diagnostics<T>* diag = nullptr) {
        titans_test::sim::require_device(x, "x");
        titans_test::sim::require_device(y, "y");
        try {
            Host::forward(cfg, p->get(), st.device_.get(), x, y, trace, diag);
        } catch (...) {
            Kernels::mirror(st);
            throw;
        }
        Kernels::mirror(st);
    }
    static bool backward(const MemoryConfig& cfg, const typename Kernels::Prepared& p,
                         const Trace& tr, View<const T> dy, View<T> dx, View<T> grads,
                         const MemoryStateGradient<T>* d_out = nullptr,
                         MemoryStateGradient<T>* d_in = nullptr) {
        titans_test::sim::require_devices<T>({dy, dx, grads}, {"dy", "dx", "grads"});
        return Host::backward(cfg, p->get(), tr, dy, dx, grads, d_out, d_in);
    }

    static void start(const MemoryConfig& cfg, const typename Kernels::State& st,
                      Eigen::Index N, Eigen::Index d, Trace& t) {
        Host::start(cfg, st.device_.get(), N, d, t);
    }
    static void forward_part(const MemoryConfig& cfg, const typename Kernels::Prepared& p,
                             typename Kernels::State& st, View<const T> x, View<T> y, Trace& t,
                             Diagnostics<T>* diag = nullptr) {
        titans_test::sim::require_device(x, "x");
        titans_test::sim::require_device(y, "y");
        try {
            Host::forward_part(cfg, p->get(), st.device_.get(), x, y, t, diag);
        } catch (...) {
            Kernels::mirror(st);
            throw;
        }
        Kernels::mirror(st);
    }
    /// The CPU's reverse sweep, dy read from the arena.
    class Reverse {
    public:
        Reverse(const MemoryConfig& cfg, const typename Kernels::Prepared& p, const Trace& tr,
                View<const T> dy, const MemoryStateGradient<T>* d_out = nullptr)
            : rev_(cfg, p->get(), tr, checked(dy), d_out) {}
        [[nodiscard]] Eigen::Index position() const { return rev_.position(); }
        void down_to(Eigen::Index p, Matrix<T>& dx) { rev_.down_to(p, dx); }
        void tap(const std::vector<std::vector<Matrix<T>>>& dW) { rev_.tap(dW); }
        void finish(MemoryParams<T>& g, MemoryStateGradient<T>* d_in = nullptr) {
            rev_.finish(g, d_in);
        }
        void down_to(Eigen::Index p, View<T> dx) {
            titans_test::sim::require_device(dx, "dx");
            rev_.down_to(p, dx);
        }
        void tap(const typename Kernels::Snapshot& dW) { rev_.tap(dW.device_.get()); }
        bool finish_flat(View<T> grads, MemoryStateGradient<T>* d_in = nullptr) {
            titans_test::sim::require_device(grads, "grads");
            return rev_.finish_flat(grads, d_in);
        }

    private:
        static View<const T> checked(View<const T> dy) {
            titans_test::sim::require_device(dy, "dy");
            return dy;
        }
        typename Host::Reverse rev_;
    };
    static void read_weights_backward(const MemoryConfig& cfg,
                                      const typename Kernels::Prepared& p,
                                      const std::vector<std::vector<Matrix<T>>>& weights,
                                      const Matrix<T>& x, int B, const Matrix<T>& dy,
                                      Matrix<T>& dx, std::vector<std::vector<Matrix<T>>>& dweights,
                                      MemoryParams<T>& g) {
        Host::read_weights_backward(cfg, p->get(), weights, x, B, dy, dx, dweights, g);
    }
    static bool read_snapshot_backward(const MemoryConfig& cfg,
                                       const typename Kernels::Prepared& p,
                                       const typename Kernels::Snapshot& s, View<const T> x,
                                       int B, View<const T> dy, View<T> dx,
                                       typename Kernels::Snapshot& dW, View<T> grads) {
        titans_test::sim::require_devices<T>({x, dy, dx, grads}, {"x", "dy", "dx", "grads"});
        titans::MemorySnapshot<T> host;
        const bool finite = Host::read_snapshot_backward(cfg, p->get(), s.device_.get(), x, B,
                                                         dy, dx, host, grads);
        dW = titans_test::sim::make_snapshot(std::move(host));
        return finite;
    }
};

/// The attention's training pass on the simulated device: the CPU's on the arena's data.
template <class T>
struct AttentionTraining<titans_test::SimulatedDevice, T> {
    static constexpr bool available = true;
    using Host = AttentionTraining<Cpu, T>;
    using Kernels = AttentionKernels<titans_test::SimulatedDevice, T>;
    using Trace = typename Host::Trace;
    using Mat = Matrix<T>;

    static void check_trace(const AttentionConfig& cfg, const Trace& tr, const char* where) {
        Host::check_trace(cfg, tr, where);
    }
    static void forward(const AttentionConfig& cfg, const typename Kernels::Prepared& p,
                        typename Kernels::State& st, View<const T> x, View<T> y,
                        View<const T> prefix, PrefixSharing sharing, Trace& trace) {
        titans_test::sim::require_device(x, "x");
        titans_test::sim::require_device(y, "y");
        if (prefix.rows > 0) titans_test::sim::require_device(prefix, "prefix");
        try {
            Host::forward(cfg, p->get(), st.device_.get(), x, y, prefix, sharing, trace);
        } catch (...) {
            st.mirror();
            throw;
        }
        st.mirror();
    }
    static void backward(const AttentionConfig& cfg, const typename Kernels::Prepared& p,
                         const Trace& tr, View<const T> dy, View<T> dx, View<T> grads,
                         View<T> dprefix, const AttentionStateGradient<T>* d_out = nullptr,
                         AttentionStateGradient<T>* d_in = nullptr) {
        titans_test::sim::require_devices<T>({dy, dx, grads, dprefix},
                                             {"dy", "dx", "grads", "dprefix"});
        Host::backward(cfg, p->get(), tr, dy, dx, grads, dprefix, d_out, d_in);
    }
};

/// RMSNorm on the simulated device.
template <class T>
struct NormKernels<titans_test::SimulatedDevice, T> {
    using Host = NormKernels<Cpu, T>;
    using Prepared = std::shared_ptr<const titans_test::sim::Handle<typename Host::Prepared>>;
    static Prepared prepare(const std::shared_ptr<const RowVector<T>>& weight) {
        return titans_test::sim::upload(weight, [](RowVector<T>& w) {
            w.setConstant(std::numeric_limits<T>::quiet_NaN());
        });
    }
    static Prepared prepare_flat(View<const T> flat) {
        titans_test::sim::require_device(flat, "flat");
        return prepare(Host::prepare_flat(flat));
    }
    static void forward(const Prepared& p, T eps, View<const T> x, View<T> y) {
        titans_test::sim::require_device(x, "x");
        titans_test::sim::require_device(y, "y");
        Host::forward(p->get(), eps, x, y);
    }
    static void forward_train(const Prepared& p, T eps, View<const T> x, View<T> y,
                              View<T> inv_rms) {
        titans_test::sim::require_devices<T>({x, y, inv_rms}, {"x", "y", "inv_rms"});
        Host::forward_train(p->get(), eps, x, y, inv_rms);
    }
    static void backward(const Prepared& p, View<const T> x, View<const T> inv_rms,
                         View<const T> dy, View<T> dx, View<T> dweight) {
        titans_test::sim::require_devices<T>({x, inv_rms, dy, dx, dweight},
                                          {"x", "inv_rms", "dy", "dx", "dweight"});
        Host::backward(p->get(), x, inv_rms, dy, dx, dweight);
    }
};

/// FeedForward on the simulated device.
template <class T>
struct FeedForwardKernels<titans_test::SimulatedDevice, T> {
    using Host = FeedForwardKernels<Cpu, T>;
    using Prepared = std::shared_ptr<const titans_test::sim::Handle<typename Host::Prepared>>;
    static Prepared prepare(const FeedForwardConfig& cfg,
                            const std::shared_ptr<const FeedForwardParams<T>>& params) {
        return titans_test::sim::upload(params, [cfg](FeedForwardParams<T>& p) {
            FeedForwardParams<T>::tensors(p, cfg, titans_test::sim::PoisonVisitor{});
        });
    }
    static Prepared prepare_flat(const FeedForwardConfig& cfg, const FeedForwardParams<T>& shapes,
                                 View<const T> flat) {
        titans_test::sim::require_device(flat, "flat");
        return prepare(cfg, Host::prepare_flat(cfg, shapes, flat));
    }
    static void forward(const FeedForwardConfig& cfg, const Prepared& p, View<const T> x,
                        View<T> y) {
        titans_test::sim::require_device(x, "x");
        titans_test::sim::require_device(y, "y");
        Host::forward(cfg, p->get(), x, y);
    }
    static void forward_train(const FeedForwardConfig& cfg, const Prepared& p, View<const T> x,
                              View<T> y, View<T> a, View<T> g) {
        titans_test::sim::require_devices<T>({x, y, a, g}, {"x", "y", "a", "g"});
        Host::forward_train(cfg, p->get(), x, y, a, g);
    }
    static void backward(const FeedForwardConfig& cfg, const Prepared& p, View<const T> x,
                         View<const T> a, View<const T> g, View<const T> dy, View<T> dx,
                         View<T> dw1, View<T> dw3, View<T> dw2) {
        titans_test::sim::require_devices<T>({x, a, g, dy, dx, dw1, dw3, dw2},
                                          {"x", "a", "g", "dy", "dx", "dw1", "dw3", "dw2"});
        Host::backward(cfg, p->get(), x, a, g, dy, dx, dw1, dw3, dw2);
    }
};

/// The glue between layers on the simulated device: the CPU's on the arena's data; a gather
/// and a scatter_add take their token ids to the device (one upload each), cross_entropy its
/// labels (one upload); the scalars the kernels leave come back by read() (one download).
template <class T>
struct GlueKernels<titans_test::SimulatedDevice, T> {
    using Host = GlueKernels<Cpu, T>;
    static void copy(View<const T> from, View<T> to) {
        titans_test::sim::require_devices<T>({from, to}, {"from", "to"});
        Host::copy(from, to);
    }
    static void add(View<const T> a, View<const T> b, View<T> out) {
        titans_test::sim::require_devices<T>({a, b, out}, {"a", "b", "out"});
        Host::add(a, b, out);
    }
    static void gate(View<const T> y, View<const T> m, View<T> out) {
        titans_test::sim::require_devices<T>({y, m, out}, {"y", "m", "out"});
        Host::gate(y, m, out);
    }
    static void gate_backward(View<const T> dout, View<const T> a, View<const T> m, View<T> da,
                              View<T> dm) {
        titans_test::sim::require_devices<T>({dout, a, m, da, dm}, {"dout", "a", "m", "da", "dm"});
        Host::gate_backward(dout, a, m, da, dm);
    }
    static void fill(View<T> to, T value) {
        titans_test::sim::require_device(to, "to");
        Host::fill(to, value);
    }
    static void copy_rows(View<const T> from, View<T> to, RowBlocks r) {
        titans_test::sim::require_devices<T>({from, to}, {"from", "to"});
        Host::copy_rows(from, to, r);
    }
    static void add_rows(View<const T> from, View<T> to, RowBlocks r) {
        titans_test::sim::require_devices<T>({from, to}, {"from", "to"});
        Host::add_rows(from, to, r);
    }
    static std::ptrdiff_t nonfinite_row(View<const T> x) {
        titans_test::sim::require_device(x, "x");
        return Host::nonfinite_row(x);
    }
    /// Token ids "on the device": a copy made by a counted upload.
    struct Ids {
        std::vector<int> ids;
        [[nodiscard]] std::size_t size() const { return ids.size(); }
    };
    static Ids upload_ids(std::span<const int> ids) {
        ++titans_test::sim::Traffic::instance().uploads;
        return Ids{std::vector<int>(ids.begin(), ids.end())};
    }
    static void gather(View<const T> table, const Ids& ids, View<T> out) {
        titans_test::sim::require_devices<T>({table, out}, {"table", "out"});
        Host::gather(table, ids.ids, out);
    }
    static void product(View<const T> x, View<const T> w, View<T> out) {
        titans_test::sim::require_devices<T>({x, w, out}, {"x", "w", "out"});
        Host::product(x, w, out);
    }
    static void product_plain(View<const T> x, View<const T> w, View<T> out) {
        titans_test::sim::require_devices<T>({x, w, out}, {"x", "w", "out"});
        Host::product_plain(x, w, out);
    }
    static void product_at(View<const T> a, View<const T> b, View<T> out) {
        titans_test::sim::require_devices<T>({a, b, out}, {"a", "b", "out"});
        Host::product_at(a, b, out);
    }
    static void product_bt(View<const T> a, View<const T> b, View<T> out) {
        titans_test::sim::require_devices<T>({a, b, out}, {"a", "b", "out"});
        Host::product_bt(a, b, out);
    }
    /// Scalars "on the device": read() is the one counted download.
    struct Scalars {
        typename Host::Scalars s;
    };
    static Scalars make_scalars() { return Scalars{}; }
    static ScalarValues read(const Scalars& s) {
        ++titans_test::sim::Traffic::instance().downloads;
        return Host::read(s.s);
    }
    static void cross_entropy(View<const T> logits, std::span<const int> labels,
                              View<T> dlogits, Scalars& s, std::size_t slot) {
        titans_test::sim::require_devices<T>({logits, dlogits}, {"logits", "dlogits"});
        ++titans_test::sim::Traffic::instance().uploads;  // the labels
        Host::cross_entropy(logits, labels, dlogits, s.s, slot);
    }
    static void clip(View<T> x, std::span<const std::ptrdiff_t> parts, double max_norm,
                     Scalars& s, std::size_t slot) {
        titans_test::sim::require_device(x, "x");
        Host::clip(x, parts, max_norm, s.s, slot);
    }
    static void scale(View<T> x, T factor) {
        titans_test::sim::require_device(x, "x");
        Host::scale(x, factor);
    }
    struct Parts {
        typename Host::Parts parts;
        [[nodiscard]] std::size_t size() const { return parts.size(); }
    };
    static Parts upload_parts(std::span<const titans::detail::AdamWPart> parts) {
        ++titans_test::sim::Traffic::instance().uploads;
        return Parts{Host::upload_parts(parts)};
    }
    static void adamw(const titans::detail::AdamWStep<T>& f, const Parts& parts,
                      View<const T> p, View<const T> g, View<const T> m, View<const T> v,
                      View<T> p1, View<T> m1, View<T> v1, Scalars& s, std::size_t slot) {
        titans_test::sim::require_devices<T>({p, g, m, v, p1, m1, v1},
                                             {"p", "g", "m", "v", "p1", "m1", "v1"});
        Host::adamw(f, parts.parts, p, g, m, v, p1, m1, v1, s.s, slot);
    }
    static void scatter_add(View<const T> rows, const Ids& ids, View<T> table) {
        titans_test::sim::require_devices<T>({rows, table}, {"rows", "table"});
        Host::scatter_add(rows, ids.ids, table);
    }
};

}  // namespace titans::backend
