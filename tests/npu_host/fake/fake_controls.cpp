// The extern "C" knobs and readings tests use (through ctypes) to steer and inspect the fake device.
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "fake_device.h"

namespace {

// Copies `text` into the caller's buffer (NUL-terminated, truncated); returns its full length.
uint64_t CopyOut(const std::string& text, char* out, uint64_t capacity) {
  if (capacity > 0) {
    const uint64_t n = text.size() < capacity - 1 ? text.size() : capacity - 1;
    std::memcpy(out, text.data(), n);
    out[n] = '\0';
  }
  return text.size();
}

}  // namespace

extern "C" {

void lmcache_fake_reset() {
  fake::DefaultStream()->SetPaused(false);
  fake::DefaultStream()->Drain();
  auto& d = fake::TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  d.device_log.clear();
  d.soc = "Ascend910B1";
  d.soc_null = false;
  d.host_register_error = d.host_register_v2_error = d.malloc_host_error = d.launch_error = 0;
  d.logic_device_offset = d.logic_device_error = 0;
  d.fail_async_copy_at = -1;
  d.op_delay_us = 0;
  d.async_copies = d.pageable_async_copies = d.launches = 0;
  d.stream_error.clear();
  d.last_error.clear();
  d.pointer_host_location = "host";
}

void lmcache_fake_set_soc(const char* soc) {
  std::lock_guard<std::mutex> lock(fake::TheDevice().mutex);
  fake::TheDevice().soc_null = soc == nullptr;
  if (soc != nullptr) fake::TheDevice().soc = soc;
}

void lmcache_fake_set_errors(int host_register, int malloc_host, int launch) {
  std::lock_guard<std::mutex> lock(fake::TheDevice().mutex);
  fake::TheDevice().host_register_error = host_register;
  fake::TheDevice().malloc_host_error = malloc_host;
  fake::TheDevice().launch_error = launch;
}

void lmcache_fake_set_host_register_v2_error(int error) {
  std::lock_guard<std::mutex> lock(fake::TheDevice().mutex);
  fake::TheDevice().host_register_v2_error = error;
}

void lmcache_fake_set_logic_device(int offset, int error) {
  std::lock_guard<std::mutex> lock(fake::TheDevice().mutex);
  fake::TheDevice().logic_device_offset = offset;
  fake::TheDevice().logic_device_error = error;
}

// The flags aclrtHostRegisterV2 was given for the range at `address`; -1 when V2 did not register it.
int64_t lmcache_fake_registered_flags(uint64_t address) {
  std::lock_guard<std::mutex> lock(fake::TheDevice().mutex);
  auto it = fake::TheDevice().registered_flags.find(static_cast<uintptr_t>(address));
  return it == fake::TheDevice().registered_flags.end() ? -1 : static_cast<int64_t>(it->second);
}

void lmcache_fake_stream_set_paused(int paused) { fake::DefaultStream()->SetPaused(paused != 0); }

// `us` microseconds of device work on the stream (a long kernel of the model's), queued at once.
void lmcache_fake_stream_busy_us(uint32_t us) {
  fake::DefaultStream()->Push("busy", [us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); });
}

void lmcache_fake_fail_async_copy_at(int64_t n) {
  std::lock_guard<std::mutex> lock(fake::TheDevice().mutex);
  fake::TheDevice().fail_async_copy_at = n;
}

void lmcache_fake_set_op_delay_us(uint32_t us) { fake::TheDevice().op_delay_us = us; }

void lmcache_fake_set_pointer_host_location(const char* location) {
  std::lock_guard<std::mutex> lock(fake::TheDevice().mutex);
  fake::TheDevice().pointer_host_location = location;
}

void lmcache_fake_stream_drain() { fake::DefaultStream()->Drain(); }

uint64_t lmcache_fake_counter(const char* name) {
  auto& d = fake::TheDevice();
  std::lock_guard<std::mutex> lock(d.mutex);
  const std::string n(name);
  if (n == "async_copies") return d.async_copies;
  if (n == "pageable_async_copies") return d.pageable_async_copies;
  if (n == "launches") return d.launches;
  if (n == "device_allocations") return d.device_memory.size();
  if (n == "malloc_host_allocations") return d.malloc_host.size();
  if (n == "registered") return d.registered.size();
  return ~uint64_t{0};
}

// The device log joined by '\n'.
uint64_t lmcache_fake_device_log(char* out, uint64_t capacity) {
  std::string text;
  {
    std::lock_guard<std::mutex> lock(fake::TheDevice().mutex);
    for (const std::string& name : fake::TheDevice().device_log) text += name + "\n";
  }
  return CopyOut(text, out, capacity);
}

uint64_t lmcache_fake_stream_error(char* out, uint64_t capacity) {
  std::lock_guard<std::mutex> lock(fake::TheDevice().mutex);
  return CopyOut(fake::TheDevice().stream_error, out, capacity);
}

}  // extern "C"
