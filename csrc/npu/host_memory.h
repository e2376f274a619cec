// Host and device memory the NPU transfer path owns, and the ways an arena segment becomes DMA-able.
//
// The registration chain (lmcache_npu/platform/ascend_host.py orders it from the host's facts, platform/host_memory.py
// tries it):
//   aclrtHostRegister  our mmap'd segment, registered with ACL (needs driver >= 25, a kernel > 5.10, not 310P);
//   aclrtMallocHost    ACL allocates the segment: page-locked by construction, what torch_npu itself treats as pinned;
//   halHostRegister    our mmap'd segment, mlock'ed, then registered with the driver (older drivers).
// Every function raises std::runtime_error naming the ACL/driver call and its error code; none leaves a partial
// registration behind.
#ifndef LMCACHE_NPU_HOST_MEMORY_H_
#define LMCACHE_NPU_HOST_MEMORY_H_

#include <cstdint>
#include <string>

namespace lmcache_npu {
namespace npu {

// aclrtHostRegister(MAPPED) of a 4 KiB aligned range; returns the device's address of it.
uint64_t HostRegister(uint64_t address, uint64_t bytes);
void HostUnregister(uint64_t address);

// aclrtMallocHost / aclrtFreeHost: page-locked host memory ACL allocates.
uint64_t MallocHost(uint64_t bytes);
void FreeHost(uint64_t address);

// mlock, then halHostRegister(HOST_MEM_MAP_DEV_PCIE_TH) from libascend_hal (loaded at run time); returns the device's
// address. Undone by HalUnregister (halHostUnregister, then munlock).
uint64_t HalRegister(uint64_t address, uint64_t bytes);
void HalUnregister(uint64_t address, uint64_t bytes);

// aclrtMalloc / aclrtFree of device memory (huge pages first), and a blocking host -> device copy.
uint64_t DeviceMalloc(uint64_t bytes);
void DeviceFree(uint64_t address);
void CopyToDevice(uint64_t device, uint64_t host, uint64_t bytes);

// What aclrtPointerGetAttributes says of an address: the location type's name ("host", "device", "unregistered",
// "host_numa", or "type <n>"), the location id and the page size.
struct PointerInfo {
  std::string location;
  uint32_t id;
  uint32_t page_bytes;
};
PointerInfo PointerAttributes(uint64_t address);

// The ACL error text for a failed call: its name, the code and aclGetRecentErrMsg().
std::string AclErrorText(const char* call, int code);

}  // namespace npu
}  // namespace lmcache_npu

#endif  // LMCACHE_NPU_HOST_MEMORY_H_
