// task_queue.h on torch_npu: OpCommand's custom-handler path, the one torch_npu's own HCCL calls and vllm-ascend's
// AscendC launches use. Only symbols libtorch_npu.so exports are used (`make check-npu-build` checks it).
#include "task_queue.h"

#include <string>
#include <utility>

#include "acl_symbols.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

// Declared by torch_npu's op-plugin headers and exported by libtorch_npu.so; OptionsManager::GetTaskQueueEnable is
// declared too but not exported, so it cannot be linked.
uint32_t OpApiGetTaskQueueEnable();

namespace lmcache_npu {
namespace npu {

namespace {

// The stream's core limits (torch_npu's per-stream AIC/AIV resource limits) for this thread's launches: what
// op-plugin does before it enqueues and again on the queue's thread. A toolkit without the call, or a refusal, leaves
// the launch unlimited, as it was before limits existed.
void UseStreamResources(aclrtStream stream) {
  using UseFn = aclError (*)(aclrtStream);
  if (auto use = OptionalAcl<UseFn>("aclrtUseStreamResInCurrentThread")) use(stream);
}

}  // namespace

aclrtStream CurrentStream() {
  return c10_npu::getCurrentNPUStream().stream(false);  // false: no MakeSureQueueEmpty()
}

void Submit(const char* name, std::function<int()> work) {
  const aclrtStream stream = CurrentStream();
  if (c10_npu::check_enqueue_need_use(stream)) UseStreamResources(stream);
  // RunOpApiV2 queues the task when the queue is on (it keeps the stream the calling thread has current) and runs it
  // now otherwise; destroying it unrun destroys `work`, whose guards then fail the transfer (transfer.cpp).
  at_npu::native::OpCommand::RunOpApiV2(
      std::string(name),
      [stream, work = std::move(work)]() -> int {
        if (c10_npu::check_dequeue_need_use(stream)) UseStreamResources(stream);
        return work();
      },
      false);
}

bool TaskQueueEnabled() { return OpApiGetTaskQueueEnable() != 0; }

}  // namespace npu
}  // namespace lmcache_npu
