// A fake libascend_hal: halHostRegister / halHostUnregister as the driver exports them, for the registration
// chain's last path. Built as its own shared library; the NPU module under test dlopens it by path.
#include <sys/mman.h>

#include <cstdint>
#include <map>
#include <mutex>

namespace {

std::mutex g_mutex;
std::map<uintptr_t, uint64_t> g_registered;
std::map<uintptr_t, uint32_t> g_devices;  // the device id each range was registered for
int g_error = 0;  // what halHostRegister returns (0: DRV_ERROR_NONE)
int64_t g_last_register_device = -1, g_last_unregister_device = -1;
uint64_t g_unregister_ex_calls = 0;
constexpr uint32_t kHostMemMapDevPcieTh = 3;

}  // namespace

extern "C" {

int halHostRegister(void* src, uint64_t size, uint32_t flag, uint32_t devId, void** dst) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_error != 0) return g_error;
  if (flag != kHostMemMapDevPcieTh || size == 0 || dst == nullptr) return 1;  // DRV_ERROR_INVALID_VALUE
  g_registered[reinterpret_cast<uintptr_t>(src)] = size;
  g_devices[reinterpret_cast<uintptr_t>(src)] = devId;
  g_last_register_device = devId;
  *dst = src;
  return 0;
}

// The driver refuses an unregistration for another device than the registration's.
static int Unregister(void* src, uint32_t devId) {
  const auto address = reinterpret_cast<uintptr_t>(src);
  auto it = g_devices.find(address);
  if (it == g_devices.end() || it->second != devId) return 1;
  g_devices.erase(it);
  g_registered.erase(address);
  g_last_unregister_device = devId;
  return 0;
}

int halHostUnregister(void* src, uint32_t devId) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return Unregister(src, devId);
}

int halHostUnregisterEx(void* src, uint32_t devId, uint32_t flag) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (flag != kHostMemMapDevPcieTh) return 1;  // the type must be the registration's
  ++g_unregister_ex_calls;
  return Unregister(src, devId);
}

// -1 when none yet: the device ids the last registration and unregistration named, and halHostUnregisterEx's calls.
int64_t lmcache_fake_hal_last_device(int unregister) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return unregister ? g_last_unregister_device : g_last_register_device;
}

uint64_t lmcache_fake_hal_unregister_ex_calls() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_unregister_ex_calls;
}

void lmcache_fake_hal_set_error(int error) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_error = error;
}

// 1 when [address, address + bytes) lies in one registered range.
int lmcache_fake_hal_covers(uint64_t address, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_registered.upper_bound(address);
  if (it == g_registered.begin()) return 0;
  --it;
  return address >= it->first && address + bytes <= it->first + it->second ? 1 : 0;
}

uint64_t lmcache_fake_hal_count() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_registered.size();
}

}  // extern "C"
