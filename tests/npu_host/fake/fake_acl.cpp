// ACL's runtime calls on the fake device (fake_device.h), with the signatures of the real ACL headers.
#include <dlfcn.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "acl/acl.h"
#include "fake_device.h"
#include "tiling/platform/platform_ascendc.h"

namespace fake {

namespace {

constexpr uint64_t kCopyAlign = 64;
thread_local int32_t t_device = -1;  // aclrtSetDevice's: per thread, as ACL's context is

void* Allocate(uint64_t bytes, uint64_t align) {
  void* p = nullptr;
  if (posix_memalign(&p, align, bytes == 0 ? align : bytes) != 0) return nullptr;
  std::memset(p, 0xA5, bytes);  // never zero: a test that forgets to write a byte sees it
  return p;
}

aclError Fail(aclError code, const std::string& text) {
  std::lock_guard<std::mutex> lock(TheDevice().mutex);
  TheDevice().last_error = text;
  return code;
}

Stream* AsStream(aclrtStream stream) { return stream == nullptr ? DefaultStream() : static_cast<Stream*>(stream); }

}  // namespace

Stream::Stream() : worker_([this] { Loop(); }) {}

Stream::~Stream() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  worker_.join();
}

void Stream::Push(std::string name, std::function<void()> op) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ops_.emplace_back(std::move(name), std::move(op));
    ++pushed_;
  }
  changed_.notify_all();
}

void Stream::SetPaused(bool paused) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    paused_ = paused;
  }
  changed_.notify_all();
}

void Stream::Drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t target = pushed_;
  changed_.wait(lock, [&] { return ran_ >= target; });
}

void Stream::Loop() {
  for (;;) {
    std::pair<std::string, std::function<void()>> op;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return stop_ || (!paused_ && !ops_.empty()); });
      if (ops_.empty()) return;
      op = std::move(ops_.front());
      ops_.pop_front();
    }
    const uint32_t delay = TheDevice().op_delay_us;
    if (delay != 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
    bool faulted;
    {
      std::lock_guard<std::mutex> lock(TheDevice().mutex);
      faulted = !TheDevice().stream_error.empty();
    }
    if (!faulted || op.first == "record_event") op.second();  // after a fault only events still complete
    TheDevice().Log(op.first);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++ran_;
    }
    changed_.notify_all();
  }
}

bool Device::Inside(const std::map<uintptr_t, uint64_t>& ranges, uintptr_t address, uint64_t bytes) {
  auto it = ranges.upper_bound(address);
  if (it == ranges.begin()) return false;
  --it;
  return address >= it->first && address + bytes <= it->first + it->second;
}

bool Device::PageLocked(uintptr_t address, uint64_t bytes) {
  const bool runtime_says_locked = pointer_host_location == "host" || pointer_host_location == "host_numa";
  return Inside(malloc_host, address, bytes) || (Inside(registered, address, bytes) && runtime_says_locked) ||
         HalCovers(address, bytes);
}

// The fake driver's own record of halHostRegister'ed ranges (the module loaded it by path: RTLD_NOLOAD finds it).
bool HalCovers(uintptr_t address, uint64_t bytes) {
  static int (*covers)(uint64_t, uint64_t) = [] {
    void* handle = dlopen(LMCACHE_NPU_HAL_LIBRARY, RTLD_NOW | RTLD_NOLOAD);
    return handle == nullptr ? nullptr
                             : reinterpret_cast<int (*)(uint64_t, uint64_t)>(dlsym(handle, "lmcache_fake_hal_covers"));
  }();
  return covers != nullptr && covers(address, bytes) != 0;
}

void Device::Log(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex);
  device_log.push_back(name);
}

Device& TheDevice() {
  static Device* device = new Device();  // never destroyed: stream threads may still log at exit
  return *device;
}

Stream* DefaultStream() {
  static Stream* stream = new Stream();
  return stream;
}

}  // namespace fake

using fake::TheDevice;

extern "C" {

aclError aclrtSetDevice(int32_t deviceId) {
  fake::t_device = deviceId;
  return ACL_SUCCESS;
}

aclError aclrtGetDevice(int32_t* deviceId) {
  if (fake::t_device < 0) return fake::Fail(ACL_ERROR_RT_CONTEXT_NULL, "no device set on this thread");
  *deviceId = fake::t_device;
  return ACL_SUCCESS;
}

const char* aclrtGetSocName() {
  static std::string name;
  std::lock_guard<std::mutex> lock(TheDevice().mutex);
  if (TheDevice().soc_null || fake::t_device < 0) return nullptr;  // ACL: null on failure (no device selected)
  name = TheDevice().soc;
  return name.c_str();
}

const char* aclGetRecentErrMsg() {
  static thread_local std::string copy;
  std::lock_guard<std::mutex> lock(TheDevice().mutex);
  copy = TheDevice().last_error;
  return copy.c_str();
}

aclError aclrtHostRegister(void* ptr, uint64_t size, aclrtHostRegisterType type, void** devPtr) {
  auto& d = TheDevice();
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  if (type != ACL_HOST_REGISTER_MAPPED || address % 4096 != 0 || size == 0 || devPtr == nullptr) {
    return fake::Fail(ACL_ERROR_INVALID_PARAM, "aclrtHostRegister: MAPPED, 4 KiB aligned, non-empty");
  }
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    if (d.host_register_error == 0) {
      d.registered[address] = size;
      *devPtr = ptr;
      return ACL_SUCCESS;
    }
  }
  return fake::Fail(d.host_register_error, "aclrtHostRegister is not supported on this host (fake)");
}

aclError aclrtHostRegisterV2(void* ptr, uint64_t size, uint32_t flag) {
  auto& d = TheDevice();
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  if (address % 4096 != 0 || size == 0) {
    return fake::Fail(ACL_ERROR_INVALID_PARAM, "aclrtHostRegisterV2: 4 KiB aligned, non-empty");
  }
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    if (d.host_register_v2_error == 0 && d.host_register_error == 0) {
      d.registered[address] = size;
      d.registered_flags[address] = flag;
      return ACL_SUCCESS;
    }
  }
  return fake::Fail(d.host_register_v2_error != 0 ? d.host_register_v2_error : d.host_register_error,
                    "aclrtHostRegisterV2 is not supported on this host (fake)");
}

aclError aclrtHostGetDevicePointer(void* pHost, void** pDevice, uint32_t flag) {
  std::lock_guard<std::mutex> lock(TheDevice().mutex);
  const auto address = reinterpret_cast<uintptr_t>(pHost);
  auto it = TheDevice().registered_flags.find(address);
  if (flag != 0 || it == TheDevice().registered_flags.end() || (it->second & ACL_HOST_REG_MAPPED) == 0) {
    return ACL_ERROR_INVALID_PARAM;
  }
  *pDevice = pHost;
  return ACL_SUCCESS;
}

aclError aclrtHostUnregister(void* ptr) {
  std::lock_guard<std::mutex> lock(TheDevice().mutex);
  TheDevice().registered_flags.erase(reinterpret_cast<uintptr_t>(ptr));
  return TheDevice().registered.erase(reinterpret_cast<uintptr_t>(ptr)) ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM;
}

aclError aclrtGetLogicDevIdByUserDevId(const int32_t userDevid, int32_t* const logicDevId) {
  std::lock_guard<std::mutex> lock(TheDevice().mutex);
  if (TheDevice().logic_device_error != 0) return TheDevice().logic_device_error;
  *logicDevId = userDevid + TheDevice().logic_device_offset;
  return ACL_SUCCESS;
}

aclError aclrtMallocHost(void** hostPtr, size_t size) {
  auto& d = TheDevice();
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    if (d.malloc_host_error != 0) {
      d.last_error = "aclrtMallocHost: out of page-locked memory (fake)";
      return d.malloc_host_error;
    }
  }
  void* p = fake::Allocate(size, 4096);
  if (p == nullptr) return fake::Fail(ACL_ERROR_BAD_ALLOC, "aclrtMallocHost: out of memory");
  std::lock_guard<std::mutex> lock(d.mutex);
  d.malloc_host[reinterpret_cast<uintptr_t>(p)] = size;
  *hostPtr = p;
  return ACL_SUCCESS;
}

aclError aclrtFreeHost(void* hostPtr) {
  {
    std::lock_guard<std::mutex> lock(TheDevice().mutex);
    if (!TheDevice().malloc_host.erase(reinterpret_cast<uintptr_t>(hostPtr))) return ACL_ERROR_INVALID_PARAM;
  }
  std::free(hostPtr);
  return ACL_SUCCESS;
}

aclError aclrtMalloc(void** devPtr, size_t size, aclrtMemMallocPolicy) {
  void* p = fake::Allocate(size, 512);
  if (p == nullptr) return fake::Fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "aclrtMalloc: out of device memory");
  std::lock_guard<std::mutex> lock(TheDevice().mutex);
  TheDevice().device_memory[reinterpret_cast<uintptr_t>(p)] = size;
  *devPtr = p;
  return ACL_SUCCESS;
}

aclError aclrtFree(void* devPtr) {
  {
    std::lock_guard<std::mutex> lock(TheDevice().mutex);
    if (!TheDevice().device_memory.erase(reinterpret_cast<uintptr_t>(devPtr))) return ACL_ERROR_INVALID_PARAM;
  }
  std::free(devPtr);
  return ACL_SUCCESS;
}

aclError aclrtMemcpy(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind) {
  if (count > destMax) return fake::Fail(ACL_ERROR_INVALID_PARAM, "aclrtMemcpy: count > destMax");
  std::memcpy(dst, src, count);
  return ACL_SUCCESS;
}

aclError aclrtMemcpyAsync(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream) {
  auto& d = TheDevice();
  const auto dst_address = reinterpret_cast<uintptr_t>(dst);
  const auto src_address = reinterpret_cast<uintptr_t>(src);
  if (count > destMax || count == 0) return fake::Fail(ACL_ERROR_INVALID_PARAM, "aclrtMemcpyAsync: count");
  if (dst_address % fake::kCopyAlign != 0 || src_address % fake::kCopyAlign != 0) {
    return fake::Fail(ACL_ERROR_INVALID_PARAM, "aclrtMemcpyAsync: source and destination must be 64 B aligned");
  }
  bool pageable = false;
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    if (d.fail_async_copy_at == 0) {
      d.fail_async_copy_at = -1;
      d.last_error = "aclrtMemcpyAsync: injected failure (fake)";
      return ACL_ERROR_RT_PARAM_INVALID;
    }
    if (d.fail_async_copy_at > 0) --d.fail_async_copy_at;
    const bool to_device = kind == ACL_MEMCPY_HOST_TO_DEVICE;
    const bool device_side_ok = fake::Device::Inside(d.device_memory, to_device ? dst_address : src_address, count);
    if (!device_side_ok) {
      d.last_error = "aclrtMemcpyAsync: the device side is not device memory";
      return ACL_ERROR_INVALID_PARAM;
    }
    pageable = !d.PageLocked(to_device ? src_address : dst_address, count);
    ++d.async_copies;
    if (pageable) ++d.pageable_async_copies;
  }
  fake::Stream* s = fake::AsStream(stream);
  s->Push(kind == ACL_MEMCPY_HOST_TO_DEVICE ? "memcpy_h2d" : "memcpy_d2h",
          [dst, src, count] { std::memcpy(dst, src, count); });
  if (pageable) s->Drain();  // CANN: an async copy from pageable memory returns after the copy
  return ACL_SUCCESS;
}

aclError aclrtMemsetAsync(void* devPtr, size_t maxCount, int32_t value, size_t count, aclrtStream stream) {
  if (count > maxCount) return fake::Fail(ACL_ERROR_INVALID_PARAM, "aclrtMemsetAsync: count > maxCount");
  {
    std::lock_guard<std::mutex> lock(TheDevice().mutex);
    if (!fake::Device::Inside(TheDevice().device_memory, reinterpret_cast<uintptr_t>(devPtr), count)) {
      TheDevice().last_error = "aclrtMemsetAsync: not device memory";
      return ACL_ERROR_INVALID_PARAM;
    }
  }
  fake::AsStream(stream)->Push("memset", [devPtr, value, count] { std::memset(devPtr, value, count); });
  return ACL_SUCCESS;
}

aclError aclrtPointerGetAttributes(const void* ptr, aclrtPtrAttributes* attributes) {
  auto& d = TheDevice();
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(d.mutex);
  std::memset(attributes, 0, sizeof(*attributes));
  attributes->pageSize = 4096;
  if (fake::Device::Inside(d.device_memory, address, 1)) {
    attributes->location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
  } else if (fake::Device::Inside(d.malloc_host, address, 1)) {
    attributes->location.type = ACL_MEM_LOCATION_TYPE_HOST;
  } else if (d.PageLocked(address, 1) || fake::Device::Inside(d.registered, address, 1)) {
    const std::string& said = d.pointer_host_location;
    attributes->location.type = said == "host"        ? ACL_MEM_LOCATION_TYPE_HOST
                                : said == "host_numa" ? ACL_MEM_LOCATION_TYPE_HOST_NUMA
                                : said == "device"    ? ACL_MEM_LOCATION_TYPE_DEVICE
                                                      : ACL_MEM_LOCATION_TYPE_UNREGISTERED;
  } else {
    attributes->location.type = ACL_MEM_LOCATION_TYPE_UNREGISTERED;
  }
  return ACL_SUCCESS;
}

aclError aclrtCreateEvent(aclrtEvent* event) {
  *event = new fake::Event();
  return ACL_SUCCESS;
}

aclError aclrtDestroyEvent(aclrtEvent event) {
  delete static_cast<fake::Event*>(event);
  return ACL_SUCCESS;
}

aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) {
  auto* e = static_cast<fake::Event*>(event);
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(e->mutex);
    target = ++e->recorded;
  }
  fake::AsStream(stream)->Push("record_event", [e, target] {
    {
      std::lock_guard<std::mutex> lock(e->mutex);
      e->completed = target;
    }
    e->done.notify_all();
  });
  return ACL_SUCCESS;
}

aclError aclrtSynchronizeEventWithTimeout(aclrtEvent event, int32_t timeout) {
  auto* e = static_cast<fake::Event*>(event);
  {
    std::unique_lock<std::mutex> lock(e->mutex);
    const uint64_t target = e->recorded;
    auto reached = [&] { return e->completed >= target; };
    if (timeout < 0) {
      e->done.wait(lock, reached);
    } else if (!e->done.wait_for(lock, std::chrono::milliseconds(timeout), reached)) {
      return ACL_ERROR_RT_EVENT_SYNC_TIMEOUT;
    }
  }
  std::lock_guard<std::mutex> lock(TheDevice().mutex);
  if (!TheDevice().stream_error.empty()) {
    TheDevice().last_error = TheDevice().stream_error;
    return ACL_ERROR_RT_AICORE_EXCEPTION;
  }
  return ACL_SUCCESS;
}

}  // extern "C"

// The AscendC platform query the module makes for UB size and core count: an A2 (910B1) unless told otherwise.
namespace platform_ascendc {

PlatformAscendC* PlatformAscendCManager::GetInstance(const char* soc) {
  static PlatformAscendC a2("Ascend910B1");
  return soc != nullptr && std::strlen(soc) > 0 ? &a2 : nullptr;
}

uint32_t PlatformAscendC::GetCoreNumAiv() const { return 48; }

void PlatformAscendC::GetCoreMemSize(const CoreMemType& type, uint64_t& size) const {
  size = type == CoreMemType::UB ? 196608 : 0;
}

}  // namespace platform_ascendc
