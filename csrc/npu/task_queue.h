// Where lmcache_npu's device work enters torch_npu's task queue.
//
// With TASK_QUEUE_ENABLE (vllm-ascend's images set it) torch_npu launches every operation from a queue thread; a
// stream handle read through torch_npu's Python API first drains that device-wide queue, tying each transfer to the
// model's launches. Work submitted here is queued behind what the calling thread's current stream already queued
// (the page fence's event waits included) and runs in that order on the queue thread, or at once on the calling
// thread when the queue is off. Built against torch_npu (task_queue_torch_npu.cpp); x86 tests link a fake.
#ifndef LMCACHE_NPU_TASK_QUEUE_H_
#define LMCACHE_NPU_TASK_QUEUE_H_

#include <functional>

#include "acl/acl.h"

namespace lmcache_npu {
namespace npu {

// The calling thread's current torch_npu stream on the current device, without draining the task queue.
aclrtStream CurrentStream();

// Runs `work` in stream order on the calling thread's current stream: queued when torch_npu's task queue is on,
// else now. `work` returns an ACL error code; it must not throw.
void Submit(const char* name, std::function<int()> work);

// Whether torch_npu's task queue is on for this process (reported by doctor and the self-test).
bool TaskQueueEnabled();

}  // namespace npu
}  // namespace lmcache_npu

#endif  // LMCACHE_NPU_TASK_QUEUE_H_
