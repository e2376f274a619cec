// A fake libascend_hal: halHostRegister / halHostUnregister as the driver exports them, for the registration
// chain's last path. Built as its own shared library; the NPU module under test dlopens it by path.
#include <sys/mman.h>

#include <cstdint>
#include <map>
#include <mutex>

namespace {

std::mutex g_mutex;
std::map<uintptr_t, uint64_t> g_registered;
int g_error = 0;  // what halHostRegister returns (0: DRV_ERROR_NONE)
constexpr uint32_t kHostMemMapDevPcieTh = 3;

}  // namespace

extern "C" {

int halHostRegister(void* src, uint64_t size, uint32_t flag, uint32_t /*devId*/, void** dst) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_error != 0) return g_error;
  if (flag != kHostMemMapDevPcieTh || size == 0 || dst == nullptr) return 1;  // DRV_ERROR_INVALID_VALUE
  g_registered[reinterpret_cast<uintptr_t>(src)] = size;
  *dst = src;
  return 0;
}

int halHostUnregister(void* src, uint32_t /*devId*/) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_registered.erase(reinterpret_cast<uintptr_t>(src)) ? 0 : 1;
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
