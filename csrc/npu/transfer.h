// One lane's transfers on an Ascend NPU: each transfer is one or more LaunchDesc windows enqueued on the lane's
// current stream through the task queue, then a tail (the last window's store copies and a completion event) that
// the lane waits for. Nothing here synchronizes a stream or drains torch_npu's queue.
//
//   Begin()                         a new transfer (clears the last one's error)
//   SubmitWindows(launches, n)      every window up to and including the last kernel; the last window's copies_out
//                                   are held for the tail, so an event the caller records next marks "pages free"
//   SubmitTail(launches, n)         the held copies_out, then the completion event
//   Wait()                          blocks (no GIL) until the tail has run on the device, at most the lane's
//                                   deadline; throws the first error
//
// A failing ACL call inside a queued task is recorded, skips the rest of that transfer's device work and is raised
// by Wait(); the task itself reports success to torch_npu, so a failed transfer never poisons the model's queue.
// torch_npu may also never run a task: after any failed task it releases everything queued behind it, and once its
// queue is in an error state it refuses new tasks. Every task carries a guard whose destructor, when the task never
// ran, fails the transfer (and, for the tail, ends the wait), so a dropped task is an error, never a hang. A transfer
// whose tail or event does not complete within the deadline fails too, and the lane refuses new transfers until the
// late one has finished on the device (its staging may still be written).
#ifndef LMCACHE_NPU_TRANSFER_H_
#define LMCACHE_NPU_TRANSFER_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "acl/acl.h"
#include "npu_runtime.h"

namespace lmcache_npu {
namespace npu {

class Transfer {
 public:
  // On the calling thread's current device; Wait() gives up after `timeout_ms` (>= 1).
  explicit Transfer(uint32_t timeout_ms = kDefaultTimeoutMs);
  ~Transfer();
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;

  void Begin();
  void SubmitWindows(uint64_t launches, uint32_t count);
  void SubmitTail(uint64_t launches, uint32_t count);
  void Wait();

  static constexpr uint32_t kDefaultTimeoutMs = 60000;

  struct State;  // what the queued tasks share with the lane: the error and the tail's progress (transfer.cpp)

 private:
  // A transfer that timed out may still run on the device: the lane takes no new one until it has.
  void RequireIdle();

  std::shared_ptr<State> state_;
  aclrtEvent done_ = nullptr;
  uint32_t timeout_ms_;
  uint64_t sequence_ = 0;   // transfers begun on this lane
  uint64_t timed_out_ = 0;  // the sequence of a transfer Wait() gave up on (0: none)
};

// Checks one window before anything is enqueued: 64 B aligned copies (aclrtMemcpyAsync's rule on A2/A3), copies
// inside neither null nor empty ranges, status blocks for every core, a table that holds its three tables.
void ValidateLaunch(const LaunchDesc& launch, uint32_t window);

}  // namespace npu
}  // namespace lmcache_npu

#endif  // LMCACHE_NPU_TRANSFER_H_
