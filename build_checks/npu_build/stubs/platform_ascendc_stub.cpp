// The stand-in libplatform.so: defines what the stand-in platform_ascendc.h declares, with A2 (Ascend910B1) figures,
// so _npu's references to PlatformAscendC resolve at link time and in the symbol check. Never run on a card.
#include "tiling/platform/platform_ascendc.h"

namespace platform_ascendc {

uint32_t PlatformAscendC::GetCoreNum(void) const { return 24; }
uint32_t PlatformAscendC::GetCoreNumAic(void) const { return 24; }
uint32_t PlatformAscendC::GetCoreNumAiv(void) const { return 48; }

void PlatformAscendC::GetCoreMemSize(const CoreMemType& mem_type, uint64_t& size) const {
  size = mem_type == CoreMemType::UB ? 196608 : 0;
}

PlatformAscendC* PlatformAscendCManager::GetInstance() { return GetInstance("Ascend910B1"); }

PlatformAscendC* PlatformAscendCManager::GetInstance(const char* custom_soc_version) {
  static PlatformAscendC platform(custom_soc_version);
  return &platform;
}

}  // namespace platform_ascendc
