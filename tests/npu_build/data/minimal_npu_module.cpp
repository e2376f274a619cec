// A binding as small as the pre-fix CMakeLists could build (no torch): one ACL call, the platform query and the
// kernel launch, so _npu NEEDs the kernel library beside it, which is what the RUNPATH has to find.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "acl/acl.h"
#include "aclrtlaunch_lmcache_kv_transfer.h"
#include "tiling/platform/platform_ascendc.h"

namespace {

uint32_t VectorCores() {
  return platform_ascendc::PlatformAscendCManager::GetInstance(aclrtGetSocName())->GetCoreNumAiv();
}

uint32_t LaunchNothing() {
  return ACLRT_LAUNCH_KERNEL(lmcache_kv_transfer)(1, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, 0,
                                                   0, 0, 0, 0, 0);
}

}  // namespace

PYBIND11_MODULE(_npu, m) {
  m.def("vector_cores", &VectorCores);
  m.def("launch_nothing", &LaunchNothing);
}
