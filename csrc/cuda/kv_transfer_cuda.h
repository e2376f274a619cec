// C interface of the CUDA kv-transfer kernel (csrc/cuda/kv_transfer.cu), shared with the pybind module.
// Raw device/UVA addresses and a cudaStream_t passed as an integer: no torch or CUDA types cross it.
#ifndef LMCACHE_NPU_KV_TRANSFER_CUDA_H_
#define LMCACHE_NPU_KV_TRANSFER_CUDA_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Counters the kernel accumulates with atomics; the host zeroes them (cudaMemsetAsync) per launch.
typedef struct {
  unsigned long long items_done;
  unsigned long long items_rejected;
  unsigned long long bytes_moved;
  unsigned long long reserved;
} LmcacheCudaStatus;

typedef struct {
  uint64_t stream;        // cudaStream_t
  uint64_t planes;        // PlaneDesc[num_planes], device memory
  uint64_t groups;        // GroupDesc[num_groups]
  uint64_t runs;          // RunDesc[num_runs]
  uint64_t objects;       // uint64 object address per chunk (device or mapped pinned host addresses)
  uint64_t items;         // uint32 x4 (run, plane, slice, 0) in staging-byte order
  uint64_t slice_items;   // uint32 per slice: work items in it (pipelined staging only)
  uint64_t slice_counters;  // uint32 per slice, zero at launch: items finished
  uint64_t slice_flags;   // uint32 per slice: set to `epoch` when a slice's bytes are ready
  uint64_t status;        // LmcacheCudaStatus, device memory
  uint64_t num_items;
  uint32_t num_planes;
  uint32_t num_groups;
  uint32_t num_runs;
  uint32_t num_chunks;
  uint32_t direction;     // lmcache_npu::Direction
  uint32_t blocks;        // grid size; 0: one per item, at most 65535
  uint32_t threads;       // block size, a multiple of 32 in [32, 1024]
  uint32_t num_slices;
  uint32_t epoch;         // this launch's flag value
  uint32_t pipeline;      // LmcachePipeline
} LmcacheCudaLaunch;

// How the kernel meets the copy engine inside one launch.
enum LmcachePipeline {
  kLmcacheNoPipeline = 0,
  kLmcacheReleaseSlices = 1,  // store: raise a slice's flag when its last item is written
  kLmcacheAcquireSlices = 2,  // load: wait for a slice's flag before reading its bytes
};

// Returns a cudaError_t value (0 on success). Enqueues a status reset and exactly one kernel.
int lmcache_cuda_kv_transfer(const LmcacheCudaLaunch* launch);
int lmcache_cuda_multiprocessors(int device, int* count);
// 1 when [address, address + size) is page-locked host memory kernels may address with the same pointer
// (cudaHostAlloc'ed or cudaHostRegister'ed, mapped under unified addressing), else 0.
int lmcache_cuda_host_mapped(uint64_t address, uint64_t size);
// Stream memory operations (driver API, fetched through the runtime): 0 on success, -1 if unavailable.
int lmcache_cuda_stream_wait_value32(uint64_t stream, uint64_t address, uint32_t value);
int lmcache_cuda_stream_write_value32(uint64_t stream, uint64_t address, uint32_t value);
const char* lmcache_cuda_error_string(int error);

#ifdef __cplusplus
}
#endif

#endif  // LMCACHE_NPU_KV_TRANSFER_CUDA_H_
