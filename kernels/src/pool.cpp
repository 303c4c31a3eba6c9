#include "pool.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define MLXGATE_PAUSE() _mm_pause()
#else
#define MLXGATE_PAUSE() std::this_thread::yield()
#endif

namespace mlxgate {
namespace {

// Iterations of pause a worker spins for new work before it sleeps (~0.1 ms).
constexpr int SPIN_ROUNDS = 4000;

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) {
      workers_.emplace_back([this] { work(); });
    }
  }

  ~Pool() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  void run(int tasks, const std::function<void(int)>& task) {
    if (tasks <= 1 || workers_.empty()) {
      for (int i = 0; i < tasks; ++i) task(i);
      return;
    }
    std::lock_guard caller(run_mutex_);  // one job at a time
    tasks_ = tasks;
    next_.store(0);
    done_.store(0);
    task_.store(&task, std::memory_order_release);  // last: a worker that sees it sees the rest
    {
      std::lock_guard lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    take_tasks(task);
    while (done_.load(std::memory_order_acquire) < tasks) MLXGATE_PAUSE();
    task_.store(nullptr, std::memory_order_release);
    // No worker may still be inside this job when the next one resets its counters.
    while (active_.load(std::memory_order_acquire) > 0) MLXGATE_PAUSE();
  }

 private:
  void take_tasks(const std::function<void(int)>& task) {
    for (int i; (i = next_.fetch_add(1)) < tasks_;) {
      task(i);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void work() {
    uint64_t seen = 0;
    while (true) {
      int spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen && spins++ < SPIN_ROUNDS) {
        MLXGATE_PAUSE();
      }
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      if (stopping_) return;
      active_.fetch_add(1, std::memory_order_acq_rel);
      if (const auto* task = task_.load(std::memory_order_acquire)) take_tasks(*task);
      active_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> next_{0};
  std::atomic<int> done_{0};
  std::atomic<int> active_{0};  // workers inside a job
  std::atomic<const std::function<void(int)>*> task_{nullptr};
  int tasks_ = 0;
  bool stopping_ = false;
};

int default_threads() {
  if (const char* set = std::getenv("MLXGATE_KERNEL_THREADS")) {
    int n = std::atoi(set);
    if (n > 0) return n;
  }
  unsigned cores = std::thread::hardware_concurrency();
  return cores == 0 ? 1 : static_cast<int>(cores);
}

Pool& pool() {
  static Pool instance(default_threads());
  return instance;
}

}  // namespace

void parallel_for(int tasks, const std::function<void(int)>& task) { pool().run(tasks, task); }

int pool_threads() { return pool().threads(); }

}  // namespace mlxgate
