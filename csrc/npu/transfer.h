// One lane's transfers on an Ascend NPU: each transfer is one or more LaunchDesc windows enqueued on the lane's
// current stream through the task queue, then a tail (the last window's store copies and a completion event) that
// the lane waits for. Nothing here synchronizes a stream or drains torch_npu's queue.
//
//   Begin()                         a new transfer (clears the last one's error)
//   SubmitWindows(launches, n)      every window up to and including the last kernel; the last window's copies_out
//                                   are held for the tail, so an event the caller records next marks "pages free"
//   SubmitTail(launches, n)         the held copies_out, then the completion event
//   Wait()                          blocks (no GIL) until the tail has run on the device; throws the first error
//
// A failing ACL call inside a queued task is recorded, skips the rest of that transfer's device work and is raised
// by Wait(); the task itself reports success to torch_npu, so a failed transfer never poisons the model's queue.
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
  Transfer();  // on the calling thread's current device
  ~Transfer();
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;

  void Begin();
  void SubmitWindows(uint64_t launches, uint32_t count);
  void SubmitTail(uint64_t launches, uint32_t count);
  void Wait();

  struct State;  // what the queued tasks share with the lane: the error and the tail's progress (transfer.cpp)

 private:
  std::shared_ptr<State> state_;
  aclrtEvent done_ = nullptr;
  uint64_t sequence_ = 0;  // transfers begun on this lane
};

// Checks one window before anything is enqueued: 64 B aligned copies (aclrtMemcpyAsync's rule on A2/A3), copies
// inside neither null nor empty ranges, status blocks for every core, a table that holds its three tables.
void ValidateLaunch(const LaunchDesc& launch, uint32_t window);

}  // namespace npu
}  // namespace lmcache_npu

#endif  // LMCACHE_NPU_TRANSFER_H_
