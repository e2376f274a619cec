// task_queue.h on torch_npu: OpCommand's custom-handler path, the one torch_npu's own HCCL calls and vllm-ascend's
// AscendC launches use. Only symbols libtorch_npu.so exports are used (`make check-npu-build` checks it).
#include "task_queue.h"

#include <string>
#include <utility>

#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

// Declared by torch_npu's op-plugin headers and exported by libtorch_npu.so; OptionsManager::GetTaskQueueEnable is
// declared too but not exported, so it cannot be linked.
uint32_t OpApiGetTaskQueueEnable();

namespace lmcache_npu {
namespace npu {

aclrtStream CurrentStream() {
  return c10_npu::getCurrentNPUStream().stream(false);  // false: no MakeSureQueueEmpty()
}

void Submit(const char* name, std::function<int()> work) {
  // RunOpApiV2 queues a copy of `work` when the queue is on (it keeps the stream the calling thread has current)
  // and runs it now otherwise.
  at_npu::native::OpCommand::RunOpApiV2(std::string(name), work, false);
}

bool TaskQueueEnabled() { return OpApiGetTaskQueueEnable() != 0; }

}  // namespace npu
}  // namespace lmcache_npu
