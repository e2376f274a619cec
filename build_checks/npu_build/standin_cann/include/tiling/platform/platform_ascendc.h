// Stand-in for CANN's tiling/platform/platform_ascendc.h (x86 CI only, see docs/npu_build.md): the part of the
// PlatformAscendC API that lmcache_npu calls, with the real names, argument types and constness, so a call that
// compiles here names the same C++ symbols as on CANN. Implemented by the stand-in libplatform.so.
#ifndef LMCACHE_NPU_STANDIN_PLATFORM_ASCENDC_H
#define LMCACHE_NPU_STANDIN_PLATFORM_ASCENDC_H

#include <cstdint>

namespace platform_ascendc {

enum class CoreMemType { L0_A = 0, L0_B = 1, L0_C = 2, L1 = 3, L2 = 4, UB = 5, HBM = 6, RESERVED };

class PlatformAscendC {
 public:
  PlatformAscendC() = delete;
  explicit PlatformAscendC(const char* soc_version) : soc_version_(soc_version) {}
  uint32_t GetCoreNum(void) const;
  uint32_t GetCoreNumAic(void) const;
  uint32_t GetCoreNumAiv(void) const;
  void GetCoreMemSize(const CoreMemType& mem_type, uint64_t& size) const;

 private:
  const char* soc_version_;
};

class PlatformAscendCManager {
 public:
  static PlatformAscendC* GetInstance();
  static PlatformAscendC* GetInstance(const char* custom_soc_version);

 private:
  PlatformAscendCManager();
};

}  // namespace platform_ascendc

#endif  // LMCACHE_NPU_STANDIN_PLATFORM_ASCENDC_H
