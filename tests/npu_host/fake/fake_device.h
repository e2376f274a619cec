// A fake Ascend device for x86 tests of lmcache_npu's native NPU code: ACL's runtime calls, torch_npu's task queue
// and the kernel launch, compiled against the REAL ACL headers, with device memory in host RAM.
//
// Strict where the hardware is: streams run their operations asynchronously on a worker thread, in order; an async
// copy's host side must be page-locked (a pageable one is counted and, as CANN does, runs synchronously); copies
// must be 64 B aligned; the kernel runs under the AscendC emulator, whose GM is only what aclrtMalloc returned, so a
// kernel that touches host memory faults. Tests steer it through the extern "C" lmcache_fake_* controls (ctypes).
#ifndef LMCACHE_NPU_TESTS_FAKE_DEVICE_H_
#define LMCACHE_NPU_TESTS_FAKE_DEVICE_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fake {

// An in-order queue of device operations run by its own thread.
class Stream {
 public:
  Stream();
  ~Stream();
  void Push(std::string name, std::function<void()> op);
  void Drain();  // blocks until everything pushed so far has run
  void SetPaused(bool paused);  // a hung device: nothing more runs until resumed

 private:
  void Loop();
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::pair<std::string, std::function<void()>>> ops_;
  uint64_t pushed_ = 0, ran_ = 0;
  bool stop_ = false;
  bool paused_ = false;
  std::thread worker_;
};

struct Event {
  std::mutex mutex;
  std::condition_variable done;
  uint64_t recorded = 0;   // records enqueued
  uint64_t completed = 0;  // records the stream has reached
};

// Everything the fake device knows; one per process.
struct Device {
  std::mutex mutex;
  std::map<uintptr_t, uint64_t> device_memory;  // aclrtMalloc'd: the kernel's GM
  std::map<uintptr_t, uint64_t> malloc_host;    // aclrtMallocHost'd: page-locked
  std::map<uintptr_t, uint64_t> registered;     // aclrtHostRegister'ed (V1 or V2): page-locked when the runtime says
  std::map<uintptr_t, uint32_t> registered_flags;  // aclrtHostRegisterV2's flags per range (V1: none)
  std::vector<std::string> device_log;          // the names of operations in the order the device ran them
  std::string soc = "Ascend910B1";
  bool soc_null = false;
  int host_register_error = 0;   // what aclrtHostRegister returns (0: success)
  int host_register_v2_error = 0;  // what aclrtHostRegisterV2 returns (0: success; an older runtime refuses it)
  int logic_device_offset = 0;   // aclrtGetLogicDevIdByUserDevId: user id + this (renumbered devices)
  int logic_device_error = 0;    // what it returns instead (0: success)
  int malloc_host_error = 0;
  int launch_error = 0;          // what aclrtlaunch_* returns
  int64_t fail_async_copy_at = -1;  // the n-th aclrtMemcpyAsync from now fails (-1: none)
  uint32_t op_delay_us = 0;      // each stream operation takes at least this long: asynchrony is visible
  uint64_t async_copies = 0;
  uint64_t pageable_async_copies = 0;  // async copies whose host side was not page-locked (ran synchronously)
  uint64_t launches = 0;
  std::string stream_error;      // a kernel fault: every later synchronization reports it
  std::string last_error;        // aclGetRecentErrMsg
  // What aclrtPointerGetAttributes says of registered host memory; anything but "host" is memory the runtime does
  // not treat as page-locked, so async copies from it run synchronously (as CANN's do).
  std::string pointer_host_location = "host";

  bool PageLocked(uintptr_t address, uint64_t bytes);  // caller holds `mutex`
  static bool Inside(const std::map<uintptr_t, uint64_t>& ranges, uintptr_t address, uint64_t bytes);
  void Log(const std::string& name);
};

Device& TheDevice();
bool HalCovers(uintptr_t address, uint64_t bytes);
Stream* DefaultStream();

}  // namespace fake

#endif  // LMCACHE_NPU_TESTS_FAKE_DEVICE_H_
