// task_queue.h on the fake device: torch_npu's task queue as one FIFO run by its own thread (on by default, as
// TASK_QUEUE_ENABLE=1 in vllm-ascend's images), which tests can pause, switch off, or feed the "model's" work.
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
      tasks_.push_back(std::move(task));
      ++pushed_;
    }
    changed_.notify_all();
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
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (rc != 0) ++task_errors;
        ++ran_;
      }
      changed_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<int()>> tasks_;
  uint64_t pushed_ = 0, ran_ = 0;
  bool paused_ = false;
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
