#pragma once
/// \file worker_pool.hpp
/// kvq::WorkerPool: persistent worker threads behind a ParallelFor, for callers that have no
/// thread pool of their own (tools, the Python module, small engines).
///
/// Without `AttentionOptions::parallel_for`, an attention call with `threads = n` starts n - 1
/// std::threads and joins them before it returns: about 70 us per call on the 2-vCPU hosts of
/// docs/benchmarks.md, as much as a whole decode step of a short sequence of a small model. A
/// WorkerPool starts its threads once; each call only wakes them.
///
///     kvq::WorkerPool pool(4);               // the caller + 3 threads
///     kvq::AttentionOptions opt;
///     pool.configure(opt);                   // opt.threads = 4, opt.parallel_for = the pool
///     kvq::attend_batch(batch, q, out, true, ws, nullptr, opt);
///
/// run(n, body) calls body(k) once for every k in [0, n): index 0 on the calling thread first,
/// the others on whichever of the caller and the workers takes them (an index is one worker of
/// the attention call, so a body is never run twice at once for the same k). It returns when
/// every body has returned; the first exception a body throws is rethrown by run() once all
/// have returned. Calls from several threads at once are served one after the other (results
/// are unaffected: the attention kernels never depend on how many workers ran). A call from
/// inside one of this pool's own bodies runs its bodies inline on that thread (no deadlock).
/// The pool must outlive every ParallelFor taken from it.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "kvq/attention/cpu/problem.hpp"
#include "kvq/core/error.hpp"

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace kvq {

class WorkerPool {
 public:
  /// `threads` workers in all, the calling thread included (threads - 1 are started here).
  explicit WorkerPool(int threads) {
    KVQ_REQUIRE(threads >= 1 && threads <= 1024, kInvalidArgument,
                "WorkerPool: threads must be in [1, 1024], got ", threads);
    workers_.reserve(static_cast<std::size_t>(threads - 1));
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_.store(true, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  /// Workers in all, the caller included.
  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  /// body(0) .. body(n - 1), as the file comment says.
  void run(int64_t n, const std::function<void(int64_t)>& body) {
    if (n <= 0) return;
    if (inside() || workers_.empty() || n == 1) {
      for (int64_t k = 0; k < n; ++k) body(k);
      return;
    }
    std::lock_guard<std::mutex> serial(run_m_);
    {
      std::lock_guard<std::mutex> lk(m_);
      body_ = &body;
      n_ = n;
      next_.store(1, std::memory_order_relaxed);  // index 0 is the caller's
      error_ = nullptr;
      done_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();  // workers that stopped spinning; cheap when none sleeps
    Inside mark(this);
    take(0);
    for (int64_t k; (k = next_.fetch_add(1, std::memory_order_relaxed)) < n;) take(k);
    const std::size_t all = workers_.size();
    if (!spin([&] { return done_.load(std::memory_order_acquire) == all; })) {
      std::unique_lock<std::mutex> lk(m_);
      finished_.wait(lk, [&] { return done_.load(std::memory_order_acquire) == all; });
    }
    body_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  /// A ParallelFor over this pool (for AttentionOptions::parallel_for).
  ParallelFor parallel_for() {
    return [this](int64_t n, const std::function<void(int64_t)>& body) { run(n, body); };
  }

  /// opt.threads = threads(), opt.parallel_for = parallel_for().
  void configure(AttentionOptions& opt) {
    opt.threads = threads();
    opt.parallel_for = parallel_for();
  }

 private:
  // marks the threads running one of this pool's bodies (nested run() calls go inline)
  struct Inside {
    static const WorkerPool*& current() {
      thread_local const WorkerPool* p = nullptr;
      return p;
    }
    explicit Inside(const WorkerPool* p) : saved(current()) { current() = p; }
    ~Inside() { current() = saved; }
    const WorkerPool* saved;
  };
  bool inside() const { return Inside::current() == this; }

  void take(int64_t k) {
    try {
      (*body_)(k);
    } catch (...) {
      std::lock_guard<std::mutex> lk(m_);
      if (!error_) error_ = std::current_exception();
    }
  }

  /// Polls `ready` for up to kSpin (with a pause between polls); true once it holds. A wake-up
  /// through the condition variable costs tens of microseconds on a virtual machine, as much
  /// as a short attention call: a worker spins briefly after each run for the next one, and the
  /// caller spins for the last worker to finish.
  template <class Ready>
  static bool spin(const Ready& ready) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 0;; ++i) {
      if (ready()) return true;
      pause();
      if ((i & 63) == 63 && std::chrono::steady_clock::now() >= until) return ready();
    }
  }
  static void pause() {
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  void loop() {
    Inside mark(this);
    uint64_t seen = 0;
    for (;;) {
      auto ready = [&] {
        return stop_.load(std::memory_order_acquire) ||
               generation_.load(std::memory_order_acquire) != seen;
      };
      if (!spin(ready)) {
        std::unique_lock<std::mutex> lk(m_);
        wake_.wait(lk, ready);
      }
      if (stop_.load(std::memory_order_acquire)) return;
      seen = generation_.load(std::memory_order_acquire);
      for (int64_t k; (k = next_.fetch_add(1, std::memory_order_relaxed)) < n_;) take(k);
      done_.fetch_add(1, std::memory_order_acq_rel);
      {
        std::lock_guard<std::mutex> lk(m_);  // orders the increment before a sleeping caller's check
      }
      finished_.notify_one();
    }
  }

  static constexpr std::chrono::microseconds kSpin{50};

  std::vector<std::thread> workers_;
  std::mutex run_m_;  // one run() at a time
  std::mutex m_;
  std::condition_variable wake_, finished_;
  const std::function<void(int64_t)>* body_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
  std::atomic<std::size_t> done_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace kvq
