#pragma once
// tests/backend/simulated_device.hpp: a test-only backend whose data lives where the library
// cannot reach it, to prove the backend seam without a GPU.
//
// titans_test::SimulatedDevice is a backend policy like titans::backend::Cpu, but its
// parameters and states live in an arena (sim::Arena) that only its kernels can open: the
// State a caller holds is an id plus host-readable metadata (batch, position, configuration),
// and the Prepared parameters are an id too. Inputs are "uploaded" (copied into the arena) and
// outputs "downloaded" (copied out) by the kernels, which delegate the math to the CPU kernels
// on the arena's copies, so results must equal the CPU backend's bit for bit. When an arena
// object is freed its tensors are overwritten with NaN first, and an id that was freed (or never
// existed) throws on use: a layer that kept a pointer into backend memory, or reached it other
// than through the kernels, fails here. So far the seam is threaded through the memory family
// (NeuralMemory<T, Backend>), RMSNorm and FeedForward; attention, the blocks, the model and io
// follow the same pattern.
#include <titans/titans.hpp>

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

    /// Moves x into the arena; `poison(x)` runs before x is freed.
    template <class X, class Poison>
    std::uint64_t put(X x, Poison poison) {
        auto obj = std::make_shared<X>(std::move(x));
        Entry e{obj, std::type_index(typeid(X)),
                [obj, poison]() mutable { poison(*obj); }};
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

/// Runs a CPU kernel as the device would: x uploaded (copied in), y downloaded (copied out).
template <class T, class Kernel>
void on_device(const titans::MatrixRef<T>& x, titans::Matrix<T>& y, Kernel&& kernel) {
    const titans::Matrix<T> x_device = x;
    titans::Matrix<T> y_device;
    kernel(x_device, y_device);
    y = y_device;
}

/// The memory's state on the simulated device: an arena id and host-readable metadata.
template <class T>
class MemoryState {
public:
    MemoryState() = default;
    [[nodiscard]] int batch() const { return batch_; }
    [[nodiscard]] std::int64_t position() const { return position_; }
    [[nodiscard]] const titans::MemoryConfig& config() const { return cfg_; }

private:
    template <class, class>
    friend struct titans::backend::MemoryKernels;
    Handle<titans::MemoryState<T>> device_;
    titans::MemoryConfig cfg_{};
    int batch_ = 0;
    std::int64_t position_ = 0;
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

/// The memory kernels of the simulated device: upload, CPU kernels on the arena's copies,
/// download.
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

    static void forward(const MemoryConfig& cfg, const Prepared& p, State& st,
                        const MatrixRef<T>& x, Mat& y, Diagnostics<T>* diag) {
        try {
            titans_test::sim::on_device<T>(x, y, [&](const Mat& xd, Mat& yd) {
                Host::forward(cfg, p->get(), st.device_.get(), xd, yd, diag);
            });
        } catch (...) {
            mirror(st);
            throw;
        }
        mirror(st);
    }

    static void read(const MemoryConfig& cfg, const Prepared& p, const State& st,
                     const MatrixRef<T>& x, Mat& y) {
        titans_test::sim::on_device<T>(x, y, [&](const Mat& xd, Mat& yd) {
            Host::read(cfg, p->get(), st.device_.get(), xd, yd);
        });
    }

    static void read_weights(const MemoryConfig& cfg, const Prepared& p,
                             const std::vector<std::vector<Mat>>& weights, const MatrixRef<T>& x,
                             int batch, Mat& y) {
        const std::vector<std::vector<Mat>> w_device = weights;
        titans_test::sim::on_device<T>(x, y, [&](const Mat& xd, Mat& yd) {
            Host::read_weights(cfg, p->get(), w_device, xd, batch, yd);
        });
    }

    static std::vector<Mat> current_weights(const MemoryConfig& cfg, const State& st, int b,
                                            int h) {
        return Host::current_weights(cfg, st.device_.get(), b, h);
    }
    static std::vector<Mat> current_momentum(const MemoryConfig& cfg, const State& st, int b,
                                             int h) {
        return Host::current_momentum(cfg, st.device_.get(), b, h);
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
    static void forward(const Prepared& p, T eps, const MatrixRef<T>& x, Matrix<T>& y) {
        titans_test::sim::on_device<T>(x, y, [&](const Matrix<T>& xd, Matrix<T>& yd) {
            Host::forward(p->get(), eps, xd, yd);
        });
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
    static void forward(const FeedForwardConfig& cfg, const Prepared& p, const MatrixRef<T>& x,
                        Matrix<T>& y) {
        titans_test::sim::on_device<T>(x, y, [&](const Matrix<T>& xd, Matrix<T>& yd) {
            Host::forward(cfg, p->get(), xd, yd);
        });
    }
};

}  // namespace titans::backend
