// Host and device memory the NPU transfer path owns, and the ways an arena segment becomes DMA-able.
//
// The registration chain (lmcache_npu/platform/ascend_host.py orders it from the host's facts, platform/host_memory.py
// tries it):
//   aclrtHostRegister  our mmap'd segment page-locked and mapped by ACL: aclrtHostRegisterV2(PINNED | MAPPED) where
//                      the toolkit has it (CANN >= 8.5), else aclrtHostRegister(MAPPED) (needs driver >= 25, a kernel
//                      > 5.10, not 310P); Python then asks aclrtPointerGetAttributes whether ACL sees page-locked host
//                      memory, and moves on when it does not;
//   aclrtMallocHost    ACL allocates the segment: page-locked by construction, what torch_npu itself treats as pinned;
//   halHostRegister    our mmap'd segment, mlock'ed, then registered with the driver (older drivers) for the driver's
//                      logical id of the current device.
// Entry points newer toolkits added (aclrtHostRegisterV2, aclrtHostGetDevicePointer, aclrtPointerGetAttributes,
// aclrtGetLogicDevIdByUserDevId) are looked up at run time in the loaded ACL library, so an older toolkit builds.
// Every function raises std::runtime_error naming the ACL/driver call and its error code; none leaves a partial
// registration behind.
#ifndef LMCACHE_NPU_HOST_MEMORY_H_
#define LMCACHE_NPU_HOST_MEMORY_H_

#include <cstdint>
#include <string>

namespace lmcache_npu {
namespace npu {

// A registered range: the device's address of it (0 where the toolkit cannot say) and the call that registered it.
struct Registration {
  uint64_t device_address;
  std::string api;
};

// aclrtHostRegisterV2(PINNED | MAPPED), else aclrtHostRegister(MAPPED), of a 4 KiB aligned range.
Registration HostRegister(uint64_t address, uint64_t bytes);
void HostUnregister(uint64_t address);

// aclrtMallocHost / aclrtFreeHost: page-locked host memory ACL allocates.
uint64_t MallocHost(uint64_t bytes);
void FreeHost(uint64_t address);

// mlock, then halHostRegister(HOST_MEM_MAP_DEV_PCIE_TH) from libascend_hal (loaded at run time) for the driver's
// logical id of the current device; returns the device's address. Undone by HalUnregister (halHostUnregisterEx with
// the registration's type where the driver has it, else halHostUnregister; then munlock).
uint64_t HalRegister(uint64_t address, uint64_t bytes);
void HalUnregister(uint64_t address, uint64_t bytes);

// aclrtMalloc / aclrtFree of device memory (huge pages first), and a blocking host -> device copy.
uint64_t DeviceMalloc(uint64_t bytes);
void DeviceFree(uint64_t address);
void CopyToDevice(uint64_t device, uint64_t host, uint64_t bytes);

// What aclrtPointerGetAttributes says of an address: the location type's name ("host", "device", "unregistered",
// "host_numa", "type <n>", or "unknown" when the toolkit lacks the call), the location id and the page size.
struct PointerInfo {
  std::string location;
  uint32_t id;
  uint32_t page_bytes;
};
PointerInfo PointerAttributes(uint64_t address);

// The driver's logical id of user device `user_device` (ACL numbers devices after ASCEND_RT_VISIBLE_DEVICES):
// aclrtGetLogicDevIdByUserDevId where it answers, else the user id's entry in ASCEND_RT_VISIBLE_DEVICES, else the id.
int32_t LogicalDevice(int32_t user_device);

// The ACL error text for a failed call: its name, the code and aclGetRecentErrMsg().
std::string AclErrorText(const char* call, int code);

}  // namespace npu
}  // namespace lmcache_npu

#endif  // LMCACHE_NPU_HOST_MEMORY_H_
