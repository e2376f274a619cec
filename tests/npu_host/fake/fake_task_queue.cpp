// task_queue.h on the fake device: torch_npu's task queue as one FIFO run by its own thread (on by default, as
// TASK_QUEUE_ENABLE=1 in vllm-ascend's images), which tests can pause, switch off, or feed the "model's" work.
// As torch_npu's does, it releases every queued task without running it once a task fails, and it can be put in
// the state where it refuses new tasks (returns from the enqueue without queuing).
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "../../../csrc/npu/task_queue.h"
#include "fake_device.h"

namespace fake {

namespace {

class TaskQueue {
 public:
  TaskQueue() : worker_([this] { Loop(); }) { worker_.detach(); }

  void Push(std::function<int()> task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (refusing_) {
        ++refused_;
        return;  // `task` is destroyed here, never run: what torch_npu's Enqueue does past its error state
      }
      tasks_.push_back(std::move(task));
      ++pushed_;
    }
    changed_.notify_all();
  }
  void SetRefusing(bool refusing) {
    std::lock_guard<std::mutex> lock(mutex_);
    refusing_ = refusing;
  }
  // Every queued task released without running (torch_npu's ReadQueue after a failed task); returns how many.
  uint64_t DropPending() {
    std::deque<std::function<int()>> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      dropped.swap(tasks_);
      ran_ += dropped.size();
      dropped_ += dropped.size();
    }
    const uint64_t count = dropped.size();
    dropped.clear();  // destroyed outside the lock: their destructors may take other locks
    changed_.notify_all();
    return count;
  }
  uint64_t Dropped() {
    std::lock_guard<std::mutex> lock(mutex_);
    return dropped_ + refused_;
  }
  void SetPaused(bool paused) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      paused_ = paused;
    }
    changed_.notify_all();
  }
  uint64_t Pending() {
    std::lock_guard<std::mutex> lock(mutex_);
    return pushed_ - ran_;
  }
  void Drain() {  // what torch_npu's MakeSureQueueEmpty does
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t target = pushed_;
    changed_.wait(lock, [&] { return ran_ >= target; });
  }

  bool enabled = true;
  bool bypass = false;  // a launch path that ignores the queue and runs at once (the negative control of ordering)
  int task_errors = 0;  // tasks that returned non-zero: torch_npu would put its queue in an error state

 private:
  void Loop() {
    for (;;) {
      std::function<int()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return !paused_ && !tasks_.empty(); });
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      const int rc = task();
      task = nullptr;  // destroyed before it counts as run, as torch_npu releases an entry after running it
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (rc != 0) ++task_errors;
        ++ran_;
      }
      if (rc != 0) DropPending();  // torch_npu ignores every task behind a failed one
      changed_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<int()>> tasks_;
  uint64_t pushed_ = 0, ran_ = 0, dropped_ = 0, refused_ = 0;
  bool paused_ = false;
  bool refusing_ = false;
  std::thread worker_;
};

TaskQueue& Queue() {
  static TaskQueue* queue = new TaskQueue();  // never destroyed: its thread outlives static destruction
  return *queue;
}

}  // namespace

}  // namespace fake

namespace lmcache_npu {
namespace npu {

aclrtStream CurrentStream() { return fake::DefaultStream(); }

void Submit(const char* name, std::function<int()> work) {
  fake::TheDevice().Log(std::string("submit:") + name);
  if (fake::Queue().enabled && !fake::Queue().bypass) {
    fake::Queue().Push(std::move(work));
  } else {
    const int rc = work();
    if (rc != 0) ++fake::Queue().task_errors;
  }
}

bool TaskQueueEnabled() { return fake::Queue().enabled; }

}  // namespace npu
}  // namespace lmcache_npu

extern "C" {

void lmcache_fake_queue_set_enabled(int enabled) { fake::Queue().enabled = enabled != 0; }
void lmcache_fake_queue_set_bypass(int bypass) { fake::Queue().bypass = bypass != 0; }
void lmcache_fake_queue_set_paused(int paused) { fake::Queue().SetPaused(paused != 0); }
uint64_t lmcache_fake_queue_pending() { return fake::Queue().Pending(); }
void lmcache_fake_queue_drain() { fake::Queue().Drain(); }
int lmcache_fake_queue_task_errors() { return fake::Queue().task_errors; }
void lmcache_fake_queue_set_refusing(int refusing) { fake::Queue().SetRefusing(refusing != 0); }
void lmcache_fake_queue_reset_errors() { fake::Queue().task_errors = 0; }
uint64_t lmcache_fake_queue_drop_pending() { return fake::Queue().DropPending(); }
uint64_t lmcache_fake_queue_dropped() { return fake::Queue().Dropped(); }

// A model operation that fails when the queue runs it (an aclnn error): torch_npu then drops every task behind it.
void lmcache_fake_queue_model_fail(const char* name) {
  std::string label(name);
  fake::Queue().Push([label]() -> int {
    fake::TheDevice().Log(label);
    return 507015;  // ACL_ERROR_RT_AICORE_EXCEPTION-like: any non-zero code
  });
}

// The model's work as torch_npu queues it: a task that, when the queue runs it, puts a write of `bytes` bytes of
// `value` at `address` on the stream (a kernel writing KV pages). Logged on the device as `name`.
void lmcache_fake_queue_model_write(const char* name, uint64_t address, int value, uint64_t bytes) {
  std::string label(name);
  fake::Queue().Push([label, address, value, bytes]() -> int {
    fake::DefaultStream()->Push(label, [address, value, bytes] {
      std::memset(reinterpret_cast<void*>(static_cast<uintptr_t>(address)), value, bytes);
    });
    return 0;
  });
}

}  // extern "C"
