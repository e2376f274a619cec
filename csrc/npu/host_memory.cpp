#include "host_memory.h"

#include <dlfcn.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "acl/acl.h"
#include "acl_symbols.h"

// The driver library halHostRegister lives in; x86 tests build against a fake of it.
#ifndef LMCACHE_NPU_HAL_LIBRARY
#define LMCACHE_NPU_HAL_LIBRARY "libascend_hal.so"
#endif

namespace lmcache_npu {
namespace npu {

namespace {

constexpr uint64_t kRegisterAlignBytes = 4096;  // aclrtHostRegister: 4 KiB aligned host address
// drvRegisterTpye of the driver's ascend_hal.h: HOST_MEM_MAP_DEV_PCIE_TH, what HCCL passes on 910B and 910_93.
constexpr uint32_t kHalHostMemMapDevPcieTh = 3;
// acl_rt.h's aclrtHostRegisterV2 flags (CANN >= 8.5): page-lock the range, and map it for the device.
constexpr uint32_t kHostRegPinned = 0x10000000u;
constexpr uint32_t kHostRegMapped = 0x2u;
// acl_rt.h's aclrtMemLocationType values, by number: older toolkits lack some of the names.
constexpr int kLocationHost = 0, kLocationDevice = 1, kLocationUnregistered = 2, kLocationHostNuma = 4;

void* Ptr(uint64_t address) { return reinterpret_cast<void*>(static_cast<uintptr_t>(address)); }
uint64_t Address(const void* ptr) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr)); }

void Check(const char* call, aclError rc) {
  if (rc != ACL_SUCCESS) throw std::runtime_error(AclErrorText(call, rc));
}

int32_t CurrentDevice() {
  int32_t device = -1;
  Check("aclrtGetDevice", aclrtGetDevice(&device));
  return device;
}

// halHostRegister(void* src, UINT64 size, UINT32 flag, UINT32 devId, void** dst) and halHostUnregister(void*, UINT32),
// both returning drvError_t (0: DRV_ERROR_NONE): loaded from the driver at run time, so nothing links against it.
// halHostUnregisterEx(void*, UINT32 devId, UINT32 flag) takes the registration's type; older drivers lack it.
using HalRegisterFn = int (*)(void*, uint64_t, uint32_t, uint32_t, void**);
using HalUnregisterFn = int (*)(void*, uint32_t);
using HalUnregisterExFn = int (*)(void*, uint32_t, uint32_t);

struct HalApi {
  HalRegisterFn host_register = nullptr;
  HalUnregisterFn host_unregister = nullptr;
  HalUnregisterExFn host_unregister_ex = nullptr;  // optional
  std::string error;
};

const HalApi& Hal() {
  static HalApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    void* handle = dlopen(LMCACHE_NPU_HAL_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* detail = dlerror();
      api.error = std::string("cannot load " LMCACHE_NPU_HAL_LIBRARY ": ") + (detail ? detail : "unknown error");
      return;
    }
    api.host_register = reinterpret_cast<HalRegisterFn>(dlsym(handle, "halHostRegister"));
    api.host_unregister = reinterpret_cast<HalUnregisterFn>(dlsym(handle, "halHostUnregister"));
    api.host_unregister_ex = reinterpret_cast<HalUnregisterExFn>(dlsym(handle, "halHostUnregisterEx"));
    if (api.host_register == nullptr || api.host_unregister == nullptr) {
      api.error = LMCACHE_NPU_HAL_LIBRARY " has no halHostRegister/halHostUnregister (driver too old or too new)";
    }
  });
  return api;
}

using HostRegisterV2Fn = aclError (*)(void*, uint64_t, uint32_t);
using HostGetDevicePointerFn = aclError (*)(void*, void**, uint32_t);
using PointerGetAttributesFn = aclError (*)(const void*, aclrtPtrAttributes*);
using LogicDevIdFn = aclError (*)(int32_t, int32_t*);

// The driver's logical id and registration type each halHostRegister'ed range was registered with, for its
// unregistration (the current device may differ by then, and the driver wants the same id back).
std::mutex g_hal_mutex;
std::map<uint64_t, uint32_t> g_hal_devices;

std::string Hex(uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(value));
  return text;
}

void CheckRange(const char* call, uint64_t address, uint64_t bytes) {
  if (address % kRegisterAlignBytes != 0) {
    throw std::invalid_argument(std::string(call) + " needs a 4 KiB aligned host address, got " + Hex(address));
  }
  if (bytes == 0) throw std::invalid_argument(std::string(call) + " needs a non-empty range");
}

}  // namespace

std::string AclErrorText(const char* call, int code) {
  const char* detail = aclGetRecentErrMsg();
  return std::string(call) + " failed with ACL error " + std::to_string(code) +
         (detail != nullptr && detail[0] != '\0' ? std::string(": ") + detail : std::string());
}

Registration HostRegister(uint64_t address, uint64_t bytes) {
  CheckRange("aclrtHostRegister", address, bytes);
  std::string v2_failure;
  if (auto register_v2 = OptionalAcl<HostRegisterV2Fn>("aclrtHostRegisterV2")) {
    const aclError rc = register_v2(Ptr(address), bytes, kHostRegPinned | kHostRegMapped);
    if (rc == ACL_SUCCESS) {
      void* device = nullptr;
      auto device_pointer = OptionalAcl<HostGetDevicePointerFn>("aclrtHostGetDevicePointer");
      if (device_pointer == nullptr || device_pointer(Ptr(address), &device, 0) != ACL_SUCCESS) device = nullptr;
      return {Address(device), "aclrtHostRegisterV2(PINNED|MAPPED)"};
    }
    v2_failure = AclErrorText("aclrtHostRegisterV2(PINNED|MAPPED)", rc) + "; ";
  }
  void* device = nullptr;
  const aclError rc = aclrtHostRegister(Ptr(address), bytes, ACL_HOST_REGISTER_MAPPED, &device);
  if (rc != ACL_SUCCESS) throw std::runtime_error(v2_failure + AclErrorText("aclrtHostRegister(MAPPED)", rc));
  return {Address(device), "aclrtHostRegister(MAPPED)"};
}

void HostUnregister(uint64_t address) { Check("aclrtHostUnregister", aclrtHostUnregister(Ptr(address))); }

uint64_t MallocHost(uint64_t bytes) {
  if (bytes == 0) throw std::invalid_argument("aclrtMallocHost needs a non-empty size");
  void* host = nullptr;
  Check("aclrtMallocHost", aclrtMallocHost(&host, bytes));
  if (host == nullptr) throw std::runtime_error("aclrtMallocHost returned success and a null address");
  return Address(host);
}

void FreeHost(uint64_t address) { Check("aclrtFreeHost", aclrtFreeHost(Ptr(address))); }

int32_t LogicalDevice(int32_t user_device) {
  if (auto logic_id = OptionalAcl<LogicDevIdFn>("aclrtGetLogicDevIdByUserDevId")) {
    int32_t logical = -1;
    if (logic_id(user_device, &logical) == ACL_SUCCESS && logical >= 0) return logical;
  }
  const char* visible = std::getenv("ASCEND_RT_VISIBLE_DEVICES");
  if (visible != nullptr && user_device >= 0) {
    std::stringstream list(visible);
    std::string entry;
    for (int32_t index = 0; std::getline(list, entry, ','); ++index) {
      if (index != user_device) continue;
      char* end = nullptr;
      const long value = std::strtol(entry.c_str(), &end, 10);
      if (end != entry.c_str() && value >= 0) return static_cast<int32_t>(value);
      break;
    }
  }
  return user_device;
}

uint64_t HalRegister(uint64_t address, uint64_t bytes) {
  CheckRange("halHostRegister", address, bytes);
  const HalApi& hal = Hal();
  if (hal.host_register == nullptr) throw std::runtime_error("halHostRegister: " + hal.error);
  const uint32_t device = static_cast<uint32_t>(LogicalDevice(CurrentDevice()));
  // Resident before the driver maps it: the device may DMA into any page of the segment at any time.
  if (mlock(Ptr(address), bytes) != 0) {
    const int err = errno;
    throw std::runtime_error(std::string("mlock of the segment failed: ") + std::strerror(err) +
                             " (raise the memlock limit, ulimit -l, or grant CAP_IPC_LOCK)");
  }
  void* mapped = nullptr;
  const int rc = hal.host_register(Ptr(address), bytes, kHalHostMemMapDevPcieTh, device, &mapped);
  if (rc != 0) {
    munlock(Ptr(address), bytes);
    throw std::runtime_error("halHostRegister failed with driver error " + std::to_string(rc) + " (logical device " +
                             std::to_string(device) + ")");
  }
  std::lock_guard<std::mutex> lock(g_hal_mutex);
  g_hal_devices[address] = device;
  return Address(mapped);
}

void HalUnregister(uint64_t address, uint64_t bytes) {
  const HalApi& hal = Hal();
  if (hal.host_unregister == nullptr) throw std::runtime_error("halHostUnregister: " + hal.error);
  uint32_t device;
  {
    std::lock_guard<std::mutex> lock(g_hal_mutex);
    auto it = g_hal_devices.find(address);
    if (it == g_hal_devices.end()) {
      throw std::invalid_argument("halHostUnregister: " + Hex(address) + " was not registered by halHostRegister");
    }
    device = it->second;
    g_hal_devices.erase(it);
  }
  const int rc = hal.host_unregister_ex != nullptr
                     ? hal.host_unregister_ex(Ptr(address), device, kHalHostMemMapDevPcieTh)
                     : hal.host_unregister(Ptr(address), device);
  munlock(Ptr(address), bytes);  // the pages stay mapped; only the lock goes
  if (rc != 0) throw std::runtime_error("halHostUnregister failed with driver error " + std::to_string(rc));
}

uint64_t DeviceMalloc(uint64_t bytes) {
  if (bytes == 0) throw std::invalid_argument("aclrtMalloc needs a non-empty size");
  void* device = nullptr;
  Check("aclrtMalloc", aclrtMalloc(&device, bytes, ACL_MEM_MALLOC_HUGE_FIRST));
  return Address(device);
}

void DeviceFree(uint64_t address) { Check("aclrtFree", aclrtFree(Ptr(address))); }

void CopyToDevice(uint64_t device, uint64_t host, uint64_t bytes) {
  Check("aclrtMemcpy", aclrtMemcpy(Ptr(device), bytes, Ptr(host), bytes, ACL_MEMCPY_HOST_TO_DEVICE));
}

PointerInfo PointerAttributes(uint64_t address) {
  auto get_attributes = OptionalAcl<PointerGetAttributesFn>("aclrtPointerGetAttributes");
  if (get_attributes == nullptr) return {"unknown", 0, 0};  // a toolkit older than CANN 8.2 cannot say
  aclrtPtrAttributes attributes;
  std::memset(&attributes, 0, sizeof(attributes));
  Check("aclrtPointerGetAttributes", get_attributes(Ptr(address), &attributes));
  const int type = static_cast<int>(attributes.location.type);
  std::string location = type == kLocationHost           ? "host"
                         : type == kLocationDevice       ? "device"
                         : type == kLocationUnregistered ? "unregistered"
                         : type == kLocationHostNuma     ? "host_numa"
                                                         : "type " + std::to_string(type);
  return {location, attributes.location.id, attributes.pageSize};
}

}  // namespace npu
}  // namespace lmcache_npu
