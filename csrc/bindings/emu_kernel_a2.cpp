// The kernel source compiled for an emulated A2/A3 vector core.
#define __CCE_AICORE__ 220
#define LMCACHE_KV_TRANSFER_KERNEL lmcache_kv_transfer_a2
#include "../ascendc/kv_transfer_kernel.cpp"
