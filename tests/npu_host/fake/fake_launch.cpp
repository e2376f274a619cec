// The generated aclrtlaunch_lmcache_kv_transfer on the fake device: the kernel source, compiled for the AscendC
// emulator (emu_kernel_a2.cpp), runs on the stream's thread over the device memory aclrtMalloc handed out: the
// kernel's GM is that and nothing else, as on the card, so a kernel reading host memory faults here too.
#include <mutex>
#include <string>
#include <vector>

#include "../../../csrc/ascendc/emu/ascendc_emu.h"
#include "../../../csrc/bindings/kernel_entry.h"
#include "aclrtlaunch_lmcache_kv_transfer.h"
#include "fake_device.h"

namespace {

uint8_t* Bytes(void* p) { return static_cast<uint8_t*>(p); }

std::mutex& EmulatorMutex() {  // the emulator keeps one launch's state in a global
  static std::mutex m;
  return m;
}

}  // namespace

uint32_t aclrtlaunch_lmcache_kv_transfer(uint32_t blockDim, aclrtStream stream, void* planes, void* groups,
                                         void* runs, void* objects, void* status, uint64_t total_items,
                                         uint32_t num_planes, uint32_t num_groups, uint32_t num_runs,
                                         uint32_t num_chunks, uint32_t direction, uint32_t tile_bytes,
                                         uint32_t zero_tile_bytes) {
  auto& d = fake::TheDevice();
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    if (d.launch_error != 0) {
      d.last_error = "aclrtlaunch_lmcache_kv_transfer: injected failure (fake)";
      return static_cast<uint32_t>(d.launch_error);
    }
    ++d.launches;
  }
  fake::Stream* s = stream == nullptr ? fake::DefaultStream() : static_cast<fake::Stream*>(stream);
  s->Push("kernel", [=] {
    std::vector<emu::GmRegion> gm;
    {
      std::lock_guard<std::mutex> lock(fake::TheDevice().mutex);
      for (const auto& [begin, bytes] : fake::TheDevice().device_memory) {
        gm.push_back({begin, begin + bytes, true, "device memory"});
      }
    }
    emu::LaunchConfig cfg;
    cfg.target = emu::Target::A2;
    cfg.block_dim = blockDim;
    cfg.kernel = "lmcache_kv_transfer";
    try {
      std::lock_guard<std::mutex> lock(EmulatorMutex());
      emu::Launch(cfg, std::move(gm), [&] {
        lmcache_kv_transfer_a2(Bytes(planes), Bytes(groups), Bytes(runs), Bytes(objects), Bytes(status), total_items,
                               num_planes, num_groups, num_runs, num_chunks, direction, tile_bytes, zero_tile_bytes);
      });
    } catch (const std::exception& fault) {  // an AI core exception: the stream is broken from here on
      std::lock_guard<std::mutex> lock(fake::TheDevice().mutex);
      fake::TheDevice().stream_error = std::string("AI core exception in lmcache_kv_transfer: ") + fault.what();
    }
  });
  return 0;
}
