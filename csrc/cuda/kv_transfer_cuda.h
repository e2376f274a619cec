// C interface of the CUDA kv-transfer kernel (csrc/cuda/kv_transfer.cu), shared with the pybind module.
// Raw device/UVA addresses and a cudaStream_t passed as an integer: no torch or CUDA types cross it.
#ifndef LMCACHE_NPU_KV_TRANSFER_CUDA_H_
#define LMCACHE_NPU_KV_TRANSFER_CUDA_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Counters the kernel accumulates with atomics; zero at launch (the host uploads zeros with the tables).
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
  uint64_t host_objects;  // uint64 mapped host object address per chunk: where a mapped prefix's items go
  uint64_t items;         // uint32 x4 (run, plane, slice, 0) in staging-byte order
  uint64_t slice_items;   // uint32 per slice: work items in it (pipelined staging only)
  uint64_t slice_counters;  // uint32 per slice, zero at launch: items finished
  uint64_t slice_flags;   // uint32 per slice: set to `epoch` when a slice's bytes are ready
  uint64_t status;        // LmcacheCudaStatus, device memory, zero at launch
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
  kLmcacheMappedPrefix = 3,   // slice 0's items move straight to/from host_objects, the rest through objects
};

// One copy-engine step between the staging buffer and a host object.
typedef struct {
  uint64_t staging;  // device address
  uint64_t host;     // host address (pinned for an asynchronous copy)
  uint64_t bytes;
  uint64_t slice;    // pipelined: a store's copy waits for this slice's flag; a load's copy raises it
} LmcacheCudaCopy;

// The events a transfer records, as cudaEvent_t handles (lmcache_cuda_event_create).
enum LmcacheTransferEvent {
  kLmcacheEventFirst = 0,    // before the table upload: the transfer's window starts
  kLmcacheEventKernelBegin,
  kLmcacheEventKernelEnd,    // the pages are free once this completes (a store's kernel read them)
  kLmcacheEventLast,         // the transfer's work on the caller's stream is done (before the status read-back)
  kLmcacheEventCopiesDone,   // pipelined: the copy stream's last copy is done
  kLmcacheEventReturned,     // the status sits in host memory
  kLmcacheEventFirstSliceIn,  // a pipelined load's first slice is in staging: the kernel's stream waits for it
  kLmcacheEventPagesFree,    // the caller's own event (0: none), recorded right after the kernel for its waiters
  kLmcacheEventCount,
};

// Everything one transfer enqueues, in the order it runs: table upload, staging zeroing, (load) copies in,
// kernel, (store) copies out, status read-back. Plain 64-bit fields so Python can fill it as a numpy record.
typedef struct {
  LmcacheCudaLaunch kernel;
  uint64_t copy_stream;   // copies run here: pipelined, meeting the kernel through slice flags; a sliced load's,
                          // back to back, each kernel joining its slice's copies; 0: on kernel.stream
  uint64_t table_host;    // pinned host bytes uploaded to table_device before the kernel (0 bytes: none)
  uint64_t table_device;
  uint64_t table_bytes;
  uint64_t zero_address;  // staging bytes zeroed before the kernel (0 bytes: none)
  uint64_t zero_bytes;
  uint64_t copies;        // LmcacheCudaCopy[num_copies], host memory, in slice order
  uint64_t num_copies;
  uint64_t direction;     // lmcache_npu::Direction: a store copies after the kernel, a load before it
  uint64_t status_host;   // pinned host bytes the status is read back into
  uint64_t events[kLmcacheEventCount];
} LmcacheCudaTransfer;

// Returns a cudaError_t value (0 on success). Enqueues exactly one kernel on launch->stream.
int lmcache_cuda_kv_transfer(const LmcacheCudaLaunch* launch);
// Enqueues the whole transfer in one call (no host step between the kernel and a store's copies): table upload,
// zeroing, a load's copies, the kernel, the caller's pages-free event, a store's copies, the status read-back.
// Every stream wait is queued after what ends it (streams may share a hardware queue).
int lmcache_cuda_transfer(const LmcacheCudaTransfer* transfer);
// A sliced load (issue 41): slice k's items are consecutive in kernel.items, in slice order; its copies carry
// slice k. Per slice, in order on the caller's stream: its copies, one kernel over its items, its event. The model's
// stream waits on slice_events[k] before the layers of window k: no host step between slices. With copy_stream set,
// the copies run there back to back instead and each kernel waits for its slice's copies, queued right after them:
// a first version that queued every copy before any wait held each kernel until the whole load was in on the H200
// (docs/performance.md, "Slice-pipelined loads"), as streams may share a hardware queue.
typedef struct {
  uint64_t num_slices;
  uint64_t slice_items;   // uint32 per slice, host memory: items of each slice
  uint64_t slice_events;  // out, cudaEvent_t per slice (made here, no timing): its kernel has written the pages
  uint64_t copied_ahead;  // 0 or 1: slice 0's copies (and the First event) were enqueued ahead by
                          // lmcache_cuda_copy_ahead on this stream, so this call skips them
} LmcacheCudaSlices;
// One call enqueues the whole sliced load: table upload, every slice as above, the caller's pages-free event after
// the last kernel, the status read-back. Requires a load with kernel.pipeline == kLmcacheNoPipeline. Each slice's
// event is created right after its kernel is enqueued (fresh per load, so a wait the model queued on an earlier
// load's event is never moved; made in one native call, not per slice from Python); slice_events holds every event
// made, also when an error stops the call, and the caller destroys them.
int lmcache_cuda_sliced_load(const LmcacheCudaTransfer* transfer, const LmcacheCudaSlices* slices);
// A sliced load's first copies enqueued before its work order is planned (issue 41), so the copy engine starts while
// the host still plans: on `stream`, the `first` event, the host-to-device copies (their slice field is ignored),
// then the `copied` event (either event 0: none). The sliced load that follows on the same stream sets copied_ahead
// and skips them; a caller that never launches it waits for `copied` before the host objects may go.
int lmcache_cuda_copy_ahead(uint64_t stream, uint64_t first, uint64_t copied, const LmcacheCudaCopy* copies,
                            uint64_t num_copies);
// blocking: a host thread that synchronizes on the event sleeps until it completes instead of spinning (a lane
// waiting out a transfer then takes no core, nor the driver's time, from the model's thread launching its forward)
int lmcache_cuda_event_create(uint64_t* event, int blocking);
int lmcache_cuda_event_destroy(uint64_t event);
int lmcache_cuda_event_synchronize(uint64_t event);
// 1 when the event's work is done, 0 when not yet, -1 on an error
int lmcache_cuda_event_query(uint64_t event);
int lmcache_cuda_stream_wait_event(uint64_t stream, uint64_t event);
int lmcache_cuda_event_elapsed_ms(uint64_t begin, uint64_t end, float* ms);
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
