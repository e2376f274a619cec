#include "transfer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../common/transfer_plan.h"
#include "aclrtlaunch_lmcache_kv_transfer.h"
#include "host_memory.h"
#include "task_queue.h"

namespace lmcache_npu {
namespace npu {

namespace {

constexpr uint64_t kCopyAlignBytes = 64;  // aclrtMemcpyAsync: source and destination 64 B aligned (CANN 8.3/8.5)

void* Ptr(uint64_t address) { return reinterpret_cast<void*>(static_cast<uintptr_t>(address)); }

// One window as the queued task sees it: its descriptor and copies, copied at submit time so the caller's arrays
// may change as soon as the submit returns (the table and status buffers they point to may not: see Wait()).
struct Window {
  LaunchDesc launch;
  std::vector<CopyDesc> copies_in;
  std::vector<CopyDesc> copies_out;
};

std::vector<CopyDesc> ReadCopies(uint64_t address, uint64_t count) {
  const auto* first = reinterpret_cast<const CopyDesc*>(static_cast<uintptr_t>(address));
  return count == 0 ? std::vector<CopyDesc>() : std::vector<CopyDesc>(first, first + count);
}

std::vector<Window> ReadWindows(uint64_t launches, uint32_t count) {
  if (launches == 0 || count == 0) throw std::invalid_argument("a transfer needs at least one launch window");
  const auto* first = reinterpret_cast<const LaunchDesc*>(static_cast<uintptr_t>(launches));
  std::vector<Window> windows;
  windows.reserve(count);
  for (uint32_t w = 0; w < count; ++w) {
    ValidateLaunch(first[w], w);
    windows.push_back({first[w], ReadCopies(first[w].copies_in, first[w].num_copies_in),
                       ReadCopies(first[w].copies_out, first[w].num_copies_out)});
  }
  return windows;
}

std::string WindowCall(const char* call, size_t window) {
  return std::string(call) + " (window " + std::to_string(window) + ")";
}

}  // namespace

struct Transfer::State {
  std::mutex mutex;
  std::condition_variable tail_ran;
  uint64_t tail_sequence = 0;  // the last transfer whose tail task has run (or was dropped)
  bool event_recorded = false;  // whether that tail recorded the completion event
  TransferError error;         // the current transfer's first failure, its text taken on the thread that failed

  void Fail(const std::string& operation, int code) {
    FailWith(code == 0 ? -1 : code, AclErrorText(operation.c_str(), code));  // aclGetRecentErrMsg is per thread
  }
  void FailWith(int code, std::string text) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!error.failed()) error = {code, std::move(text)};
  }
  bool Failed() {
    std::lock_guard<std::mutex> lock(mutex);
    return error.failed();
  }
  // The tail of transfer `sequence` is over: ran (and recorded the event, or not) or was dropped.
  void TailOver(uint64_t sequence, bool recorded) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      tail_sequence = std::max(tail_sequence, sequence);
      event_recorded = recorded;
    }
    tail_ran.notify_all();
  }
};

namespace {

// Rides in every queued task (shared by its copies): destroyed without having run means torch_npu dropped the task
// (released after an earlier task failed) or refused it (its queue in an error state). Then the transfer fails and,
// for the tail, the wait ends: the destructor runs on whichever thread releases the task.
class TaskGuard {
 public:
  TaskGuard(std::shared_ptr<Transfer::State> state, std::string task, uint64_t tail_of)
      : state_(std::move(state)), task_(std::move(task)), tail_of_(tail_of) {}
  TaskGuard(const TaskGuard&) = delete;
  TaskGuard& operator=(const TaskGuard&) = delete;
  ~TaskGuard() {
    if (ran_.load()) return;
    state_->FailWith(-1, task_ + " was dropped by torch_npu's task queue without running (an earlier task on the "
                                 "device failed, or the queue is in an error state)");
    if (tail_of_ != 0) state_->TailOver(tail_of_, false);
  }
  void Ran() { ran_.store(true); }

 private:
  std::shared_ptr<Transfer::State> state_;
  std::string task_;
  uint64_t tail_of_;  // the transfer whose tail this is (0: a window)
  std::atomic<bool> ran_{false};
};

}  // namespace

namespace {

// A window's store copies, staging -> host objects; stops at the first failure.
void CopyOut(const std::vector<CopyDesc>& copies, size_t w, aclrtStream stream, Transfer::State& state) {
  for (const CopyDesc& copy : copies) {
    const aclError rc = aclrtMemcpyAsync(Ptr(copy.host), copy.bytes, Ptr(copy.device), copy.bytes,
                                         ACL_MEMCPY_DEVICE_TO_HOST, stream);
    if (rc != ACL_SUCCESS) {
      state.Fail(WindowCall("aclrtMemcpyAsync device to host", w), rc);
      return;
    }
  }
}

// One window's device work, in stream order; stops at the first failing call (recorded in `state`).
void RunWindow(const Window& window, size_t w, bool hold_copies_out, aclrtStream stream, Transfer::State& state) {
  if (state.Failed()) return;  // an earlier window failed: what its staging holds is not to be used
  const LaunchDesc& l = window.launch;
  auto ok = [&](const char* call, int rc) {
    if (rc != ACL_SUCCESS) state.Fail(WindowCall(call, w), rc);
    return rc == ACL_SUCCESS;
  };
  if (!ok("aclrtMemcpyAsync of the tables", aclrtMemcpyAsync(Ptr(l.table_device), l.table_bytes, Ptr(l.table_host),
                                                             l.table_bytes, ACL_MEMCPY_HOST_TO_DEVICE, stream)) ||
      !ok("aclrtMemsetAsync of the status", aclrtMemsetAsync(Ptr(l.status_device), l.status_bytes, 0, l.status_bytes,
                                                             stream)) ||
      (l.zero_bytes != 0 && !ok("aclrtMemsetAsync of staging", aclrtMemsetAsync(Ptr(l.zero_device), l.zero_bytes, 0,
                                                                                l.zero_bytes, stream)))) {
    return;
  }
  for (const CopyDesc& copy : window.copies_in) {
    if (!ok("aclrtMemcpyAsync host to device", aclrtMemcpyAsync(Ptr(copy.device), copy.bytes, Ptr(copy.host),
                                                               copy.bytes, ACL_MEMCPY_HOST_TO_DEVICE, stream))) {
      return;
    }
  }
  const uint32_t launched = aclrtlaunch_lmcache_kv_transfer(
      l.block_dim, stream, Ptr(l.planes), Ptr(l.groups), Ptr(l.runs), Ptr(l.objects), Ptr(l.status_device),
      l.total_items, l.num_planes, l.num_groups, l.num_runs, l.num_chunks, l.direction, l.tile_bytes,
      l.zero_tile_bytes);
  if (!ok("aclrtlaunch_lmcache_kv_transfer", static_cast<int>(launched)) ||
      !ok("aclrtMemcpyAsync of the status", aclrtMemcpyAsync(Ptr(l.status_host), l.status_bytes,
                                                             Ptr(l.status_device), l.status_bytes,
                                                             ACL_MEMCPY_DEVICE_TO_HOST, stream))) {
    return;
  }
  if (hold_copies_out) return;
  CopyOut(window.copies_out, w, stream, state);
}

}  // namespace

void ValidateLaunch(const LaunchDesc& launch, uint32_t window) {
  const std::string where = "launch window " + std::to_string(window) + ": ";
  if (launch.block_dim < 1 || launch.block_dim > 65535) {
    throw std::invalid_argument(where + "block_dim " + std::to_string(launch.block_dim) + " is outside [1, 65535]");
  }
  if (launch.status_bytes < uint64_t{launch.block_dim} * sizeof(CoreStatus)) {
    throw std::invalid_argument(where + "status_bytes " + std::to_string(launch.status_bytes) + " holds fewer than " +
                                std::to_string(launch.block_dim) + " core status blocks of 32 B");
  }
  if (launch.table_host == 0 || launch.table_device == 0 || launch.status_host == 0 || launch.status_device == 0 ||
      launch.planes == 0) {
    throw std::invalid_argument(where + "table, status and plane addresses must not be null");
  }
  const uint64_t table_end = launch.table_device + launch.table_bytes;
  for (uint64_t part : {launch.groups, launch.runs, launch.objects}) {
    if (part < launch.table_device || part >= table_end) {
      throw std::invalid_argument(where + "a group/run/object table lies outside the uploaded table bytes");
    }
  }
  if (launch.zero_bytes != 0 && launch.zero_device == 0) {
    throw std::invalid_argument(where + "zero_bytes without a zero_device address");
  }
  for (const auto& [list, count, name] : {std::make_tuple(launch.copies_in, launch.num_copies_in, "copies_in"),
                                          std::make_tuple(launch.copies_out, launch.num_copies_out, "copies_out")}) {
    if (count != 0 && list == 0) throw std::invalid_argument(where + name + " is null with " + std::to_string(count));
    for (const CopyDesc& copy : ReadCopies(list, count)) {
      if (copy.bytes == 0 || copy.device == 0 || copy.host == 0) {
        throw std::invalid_argument(where + name + ": a copy with a null address or no bytes");
      }
      if (copy.device % kCopyAlignBytes != 0 || copy.host % kCopyAlignBytes != 0) {
        throw std::invalid_argument(where + name + ": aclrtMemcpyAsync needs 64 B aligned source and destination");
      }
    }
  }
}

Transfer::Transfer(uint32_t timeout_ms) : state_(std::make_shared<State>()), timeout_ms_(timeout_ms) {
  if (timeout_ms_ == 0) throw std::invalid_argument("a transfer's wait deadline must be at least 1 ms");
  const aclError rc = aclrtCreateEvent(&done_);
  if (rc != ACL_SUCCESS) throw std::runtime_error(AclErrorText("aclrtCreateEvent", rc));
}

Transfer::~Transfer() {
  if (done_ != nullptr) aclrtDestroyEvent(done_);  // a failure here has no one left to report to
}

void Transfer::RequireIdle() {
  if (timed_out_ == 0) return;
  bool tail_over = false, recorded = false;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    tail_over = state_->tail_sequence >= timed_out_;
    recorded = state_->event_recorded;
  }
  // 0 ms: only asks whether the late transfer's completion event has been reached
  if (!tail_over || !recorded || aclrtSynchronizeEventWithTimeout(done_, 0) != ACL_SUCCESS) {
    throw std::runtime_error("this lane's transfer " + std::to_string(timed_out_) + " timed out and has not "
                             "finished on the device: no new transfer until it has");
  }
  timed_out_ = 0;
}

void Transfer::Begin() {
  RequireIdle();
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->error = TransferError();
  ++sequence_;
}

void Transfer::SubmitWindows(uint64_t launches, uint32_t count) {
  std::vector<Window> windows = ReadWindows(launches, count);
  const aclrtStream stream = CurrentStream();
  std::shared_ptr<State> state = state_;
  // Each window is its own task: the model's launches may interleave between windows, never inside one.
  for (size_t w = 0; w < windows.size(); ++w) {
    const bool last = w + 1 == windows.size();
    auto guard = std::make_shared<TaskGuard>(state, WindowCall("the transfer task", w), 0);
    Submit("lmcache_kv_transfer", [stream, state, guard, window = std::move(windows[w]), w, last]() -> int {
      guard->Ran();
      RunWindow(window, w, last, stream, *state);
      return ACL_SUCCESS;  // a failure is the transfer's, raised by Wait(), never the model's queue's
    });
  }
}

void Transfer::SubmitTail(uint64_t launches, uint32_t count) {
  std::vector<Window> windows = ReadWindows(launches, count);
  const aclrtStream stream = CurrentStream();
  std::shared_ptr<State> state = state_;
  auto guard = std::make_shared<TaskGuard>(state, "the transfer's tail task", sequence_);
  Submit("lmcache_kv_transfer_tail", [stream, state, guard, done = done_, sequence = sequence_,
                                      copies = std::move(windows.back().copies_out),
                                      w = windows.size() - 1]() -> int {
    guard->Ran();
    if (!state->Failed()) CopyOut(copies, w, stream, *state);
    const aclError rc = aclrtRecordEvent(done, stream);  // recorded whatever happened, so the wait always ends
    if (rc != ACL_SUCCESS) state->Fail("aclrtRecordEvent of the completion event", rc);
    state->TailOver(sequence, rc == ACL_SUCCESS);
    return ACL_SUCCESS;
  });
}

void Transfer::Wait() {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  const std::string budget = " within " + std::to_string(timeout_ms_) + " ms";
  bool recorded = false;
  {
    std::unique_lock<std::mutex> lock(state_->mutex);
    if (!state_->tail_ran.wait_until(lock, deadline, [&] { return state_->tail_sequence >= sequence_; })) {
      timed_out_ = sequence_;
      // late tasks find the transfer failed and skip their device work
      if (!state_->error.failed()) {
        state_->error = {-1, "transfer " + std::to_string(sequence_) + ": torch_npu's task queue did not run its "
                             "tail task" + budget + " (the queue is stalled or the device hung)"};
      }
      throw std::runtime_error(state_->error.message);
    }
    recorded = state_->event_recorded;
  }
  if (recorded) {  // else the tail's task could not record it: waiting on the event would never end
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    const aclError rc = aclrtSynchronizeEventWithTimeout(done_, static_cast<int32_t>(std::max<int64_t>(left, 1)));
    if (rc == ACL_ERROR_RT_EVENT_SYNC_TIMEOUT || rc == ACL_ERROR_RT_WAIT_TIMEOUT) {
      timed_out_ = sequence_;  // the device is still busy with this transfer: the lane waits it out first
    }
    if (rc != ACL_SUCCESS) {
      state_->Fail("aclrtSynchronizeEventWithTimeout of the completion event (deadline" + budget + ")", rc);
    }
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->error.failed()) throw std::runtime_error(state_->error.message);
}

}  // namespace npu
}  // namespace lmcache_npu
