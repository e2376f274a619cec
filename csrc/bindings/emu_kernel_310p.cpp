// The kernel source compiled for an emulated 310P AI core (no DataCopyPad).
#define __CCE_AICORE__ 200
#define LMCACHE_KV_TRANSFER_KERNEL lmcache_kv_transfer_310p
#include "../ascendc/kv_transfer_kernel.cpp"
