// CUDA implementation of the transfer contract (csrc/common/transfer_plan.h), DESIGN §4.
//
// One launch moves every (run, plane) work item of a batch. A thread block owns one item at a
// time (items grid-strided, chunk-major), so each item is one contiguous span (ND) that the
// block copies with the widest vector both addresses allow (16 B when src and dst agree modulo
// 16, narrower otherwise; odd widths stay byte-exact). Object addresses may be device memory
// (staging) or pinned host memory through UVA (mapped, zero-copy): the same code serves both,
// with 4 independent loads in flight per thread to cover PCIe read latency.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "../common/transfer_plan.h"
#include "kv_transfer_cuda.h"

namespace lmcache_npu {
namespace {

template <typename V>
__device__ __forceinline__ void CopyVectors(uint8_t* dst, const uint8_t* src, uint64_t count, unsigned lane,
                                            unsigned lanes) {
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  uint64_t i = lane;
  for (; i + 3ull * lanes < count; i += 4ull * lanes) {
    const V a = s[i], b = s[i + lanes], c = s[i + 2ull * lanes], e = s[i + 3ull * lanes];
    d[i] = a;
    d[i + lanes] = b;
    d[i + 2ull * lanes] = c;
    d[i + 3ull * lanes] = e;
  }
  for (; i < count; i += lanes) d[i] = s[i];
}

// Copies `bytes` with the widest access on which src and dst agree; head and tail go byte by byte.
__device__ __forceinline__ void CopySpan(uint8_t* dst, const uint8_t* src, uint64_t bytes, unsigned lane,
                                         unsigned lanes) {
  const uintptr_t skew = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  const unsigned width = (skew & 15) == 0 ? 16 : (skew & 7) == 0 ? 8 : (skew & 3) == 0 ? 4 : (skew & 1) == 0 ? 2 : 1;
  uint64_t head = (width - (reinterpret_cast<uintptr_t>(dst) & (width - 1))) & (width - 1);
  if (head > bytes) head = bytes;
  for (uint64_t i = lane; i < head; i += lanes) dst[i] = src[i];
  const uint64_t count = (bytes - head) / width;
  uint8_t* d = dst + head;
  const uint8_t* s = src + head;
  switch (width) {
    case 16: CopyVectors<uint4>(d, s, count, lane, lanes); break;
    case 8: CopyVectors<uint2>(d, s, count, lane, lanes); break;
    case 4: CopyVectors<uint32_t>(d, s, count, lane, lanes); break;
    case 2: CopyVectors<uint16_t>(d, s, count, lane, lanes); break;
    default: CopyVectors<uint8_t>(d, s, count, lane, lanes); break;
  }
  for (uint64_t i = head + count * width + lane; i < bytes; i += lanes) dst[i] = src[i];
}

__device__ __forceinline__ void ZeroSpan(uint8_t* dst, uint64_t bytes, unsigned lane, unsigned lanes) {
  uint64_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (head > bytes) head = bytes;
  for (uint64_t i = lane; i < head; i += lanes) dst[i] = 0;
  const uint64_t count = (bytes - head) / 16;
  uint4* d = reinterpret_cast<uint4*>(dst + head);
  for (uint64_t i = lane; i < count; i += lanes) d[i] = make_uint4(0, 0, 0, 0);
  for (uint64_t i = head + count * 16 + lane; i < bytes; i += lanes) dst[i] = 0;
}

__device__ __forceinline__ void MoveItem(const PlaneDesc* __restrict__ planes, const GroupDesc* __restrict__ groups,
                                         const RunDesc* __restrict__ runs, const uint64_t* __restrict__ objects,
                                         const uint4& work, uint32_t num_planes, uint32_t num_groups,
                                         uint32_t num_runs, uint32_t num_chunks, bool store, unsigned lane,
                                         unsigned lanes, LmcacheCudaStatus* status) {
  if (!ContractItemInTables(work.y, num_planes, work.x, num_runs)) {
    if (lane == 0) atomicAdd(&status->items_rejected, 1ull);
    return;
  }
  const PlaneDesc plane = planes[work.y];
  const RunDesc run = runs[work.x];
  // Work items come from the host, not from arithmetic as on AscendC: the plane names the item's group, and the
  // contract then requires the run and the plane to lie in that group's ranges.
  if (plane.group_index >= num_groups ||
      !ContractAdmissible(plane.group_index, groups[plane.group_index], work.y, plane, work.x, run, num_chunks)) {
    if (lane == 0) atomicAdd(&status->items_rejected, 1ull);
    return;
  }
  uint8_t* obj = reinterpret_cast<uint8_t*>(objects[run.chunk] + plane.object_offset_bytes +
                                            static_cast<uint64_t>(run.first_row) * plane.row_bytes);
  const uint64_t bytes = static_cast<uint64_t>(run.num_rows) * plane.row_bytes;
  if (run.first_slot < 0) {
    if (store) ZeroSpan(obj, bytes, lane, lanes);  // a load leaves skipped rows untouched
  } else {
    const uint32_t slot = static_cast<uint32_t>(run.first_slot);
    uint8_t* block = reinterpret_cast<uint8_t*>(plane.base_addr +
                                                static_cast<uint64_t>(slot / plane.rows_per_block) *
                                                    plane.block_stride_bytes);
    const uint32_t first = slot % plane.rows_per_block;
    if (plane.layout == kPageND) {
      uint8_t* page = block + static_cast<uint64_t>(first) * plane.row_bytes;
      store ? CopySpan(obj, page, bytes, lane, lanes) : CopySpan(page, obj, bytes, lane, lanes);
    } else {  // FRACTAL_NZ: unit (row t, column j) at j * rows_per_block * unit + t * unit
      const uint32_t unit = plane.nz_unit_bytes, cols = plane.row_bytes / unit;
      const uint64_t units = static_cast<uint64_t>(run.num_rows) * cols;
      for (uint64_t u = lane / 2; u < units; u += lanes / 2) {  // two threads per unit
        const uint64_t r = u / cols, j = u % cols;
        uint8_t* page = block + j * plane.rows_per_block * unit + (first + r) * unit;
        uint8_t* row = obj + r * plane.row_bytes + j * unit;
        for (uint32_t k = lane % 2; k < unit; k += 2) {
          if (store) row[k] = page[k]; else page[k] = row[k];
        }
      }
    }
  }
  if (lane == 0) {
    atomicAdd(&status->items_done, 1ull);
    if (store || run.first_slot >= 0) atomicAdd(&status->bytes_moved, static_cast<unsigned long long>(bytes));
  }
}

struct Slices {
  const uint32_t* items;  // work items per slice
  uint32_t* counters;
  uint32_t* flags;
  uint32_t count;
  uint32_t epoch;
  uint32_t pipeline;
};

// Load: the copy engine raises a slice's flag once its bytes sit in staging.
__device__ __forceinline__ void AcquireSlice(const Slices& slices, uint32_t slice) {
  if (threadIdx.x == 0) {
    volatile uint32_t* flag = slices.flags + slice;
    while (static_cast<int32_t>(*flag - slices.epoch) < 0) __nanosleep(200);
    __threadfence();
  }
  __syncthreads();
}

// Store: the last block to finish an item of a slice raises its flag for the copy engine.
__device__ __forceinline__ void ReleaseSlice(const Slices& slices, uint32_t slice) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(slices.counters + slice, 1u) + 1 == slices.items[slice]) {
      __threadfence_system();
      atomicExch(slices.flags + slice, slices.epoch);
    }
  }
}

__global__ void KvTransferKernel(const PlaneDesc* __restrict__ planes, const GroupDesc* __restrict__ groups,
                                 const RunDesc* __restrict__ runs, const uint64_t* __restrict__ objects,
                                 const uint64_t* __restrict__ host_objects, const uint4* __restrict__ items,
                                 uint64_t num_items, uint32_t num_planes, uint32_t num_groups, uint32_t num_runs,
                                 uint32_t num_chunks, uint32_t direction, Slices slices, LmcacheCudaStatus* status) {
  const bool store = direction == kStore;
  const unsigned lane = threadIdx.x, lanes = blockDim.x;
  for (uint64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    const uint4 work = items[item];  // (run, plane, slice)
    const bool sliced = slices.pipeline != kLmcacheNoPipeline && work.z < slices.count;
    if (sliced && slices.pipeline == kLmcacheAcquireSlices) AcquireSlice(slices, work.z);
    // A mapped prefix: PCIe carries slice 0 while the other blocks gather or scatter the rest through staging, so
    // the link does not sit idle during the kernel.
    const bool mapped = slices.pipeline == kLmcacheMappedPrefix && work.z == 0;
    MoveItem(planes, groups, runs, mapped ? host_objects : objects, work, num_planes, num_groups, num_runs,
             num_chunks, store, lane, lanes, status);
    if (sliced && slices.pipeline == kLmcacheReleaseSlices) ReleaseSlice(slices, work.z);
  }
}

}  // namespace
}  // namespace lmcache_npu

extern "C" int lmcache_cuda_kv_transfer(const LmcacheCudaLaunch* a) {
  using namespace lmcache_npu;
  if (a->threads < 32 || a->threads > 1024 || a->threads % 32 != 0) return cudaErrorInvalidConfiguration;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(a->stream));
  if (a->pipeline == kLmcacheMappedPrefix && a->host_objects == 0) {
    return cudaErrorInvalidValue;  // a mapped prefix moves through host objects it was given, never through null
  }
  if (a->num_items == 0) return cudaSuccess;
  uint64_t blocks = a->blocks == 0 ? a->num_items : a->blocks;
  if (blocks > a->num_items) blocks = a->num_items;
  if (blocks > 65535) blocks = 65535;
  const Slices slices{reinterpret_cast<const uint32_t*>(a->slice_items), reinterpret_cast<uint32_t*>(a->slice_counters),
                      reinterpret_cast<uint32_t*>(a->slice_flags), a->num_slices, a->epoch, a->pipeline};
  KvTransferKernel<<<static_cast<unsigned>(blocks), a->threads, 0, stream>>>(
      reinterpret_cast<const PlaneDesc*>(a->planes), reinterpret_cast<const GroupDesc*>(a->groups),
      reinterpret_cast<const RunDesc*>(a->runs), reinterpret_cast<const uint64_t*>(a->objects),
      reinterpret_cast<const uint64_t*>(a->host_objects), reinterpret_cast<const uint4*>(a->items), a->num_items,
      a->num_planes, a->num_groups, a->num_runs, a->num_chunks, a->direction, slices,
      reinterpret_cast<LmcacheCudaStatus*>(a->status));
  return cudaGetLastError();
}

namespace {

cudaStream_t AsStream(uint64_t handle) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(handle)); }
cudaEvent_t AsEvent(uint64_t handle) { return reinterpret_cast<cudaEvent_t>(static_cast<uintptr_t>(handle)); }

int Record(const LmcacheCudaTransfer* t, LmcacheTransferEvent which, uint64_t stream) {
  return t->events[which] == 0 ? cudaSuccess : cudaEventRecord(AsEvent(t->events[which]), AsStream(stream));
}

int StreamValue(bool wait, uint64_t stream, uint64_t address, uint32_t value);

// The copies of one direction, in slice order. Pipelined, a store's copy first waits for its slice's flag and a
// load raises the flag once the slice's last copy is in; back to back on the caller's stream otherwise.
int EnqueueCopies(const LmcacheCudaTransfer* t, bool to_device) {
  const bool pipelined = t->copy_stream != 0;
  const uint64_t stream = pipelined ? t->copy_stream : t->kernel.stream;
  const auto* copies = reinterpret_cast<const LmcacheCudaCopy*>(t->copies);
  const uint64_t flags = t->kernel.slice_flags;
  for (uint64_t i = 0; i < t->num_copies; ++i) {
    const LmcacheCudaCopy& c = copies[i];
    const bool slice_begins = i == 0 || copies[i - 1].slice != c.slice;
    const bool slice_ends = i + 1 == t->num_copies || copies[i + 1].slice != c.slice;
    if (pipelined && !to_device && slice_begins) {
      const int rc = StreamValue(true, stream, flags + 4 * c.slice, t->kernel.epoch);
      if (rc != 0) return rc < 0 ? cudaErrorNotSupported : rc;
    }
    void* dst = reinterpret_cast<void*>(to_device ? c.staging : c.host);
    const void* src = reinterpret_cast<const void*>(to_device ? c.host : c.staging);
    const cudaError_t err = cudaMemcpyAsync(dst, src, c.bytes, to_device ? cudaMemcpyHostToDevice
                                                                           : cudaMemcpyDeviceToHost, AsStream(stream));
    if (err != cudaSuccess) return err;
    if (pipelined && to_device && slice_ends) {
      const int rc = StreamValue(false, stream, flags + 4 * c.slice, t->kernel.epoch);
      if (rc != 0) return rc < 0 ? cudaErrorNotSupported : rc;
      // The kernel's stream waits for the first slice by event, which wakes a stream about 1 µs sooner than a wait
      // on the slice's flag (lmcache_npu/tools/bench/studies/cuda_gate_latency.py).
      if (c.slice == copies[0].slice) {
        const int err = Record(t, kLmcacheEventFirstSliceIn, stream);
        if (err != cudaSuccess) return err;
      }
    }
  }
  return pipelined ? Record(t, kLmcacheEventCopiesDone, stream) : cudaSuccess;
}

}  // namespace

#define LMCACHE_TRY(expr)            \
  do {                               \
    const int rc_ = (expr);          \
    if (rc_ != 0) return rc_;        \
  } while (0)

namespace {

// The transfer up to its kernel and the caller's pages-free event.
int EnqueueHead(const LmcacheCudaTransfer* t) {
  const cudaStream_t stream = AsStream(t->kernel.stream);
  const bool load = t->direction == lmcache_npu::kLoad;
  LMCACHE_TRY(Record(t, kLmcacheEventFirst, t->kernel.stream));
  if (t->table_bytes != 0) {
    LMCACHE_TRY(cudaMemcpyAsync(reinterpret_cast<void*>(t->table_device), reinterpret_cast<const void*>(t->table_host),
                                t->table_bytes, cudaMemcpyHostToDevice, stream));
  }
  if (t->zero_bytes != 0) {
    LMCACHE_TRY(cudaMemsetAsync(reinterpret_cast<void*>(t->zero_address), 0, t->zero_bytes, stream));
  }
  const bool pipelined = t->copy_stream != 0 && t->num_copies != 0;
  if (load) {
    // A pipelined load's copies start with the transfer's turn on the caller's stream, not before: its window is
    // then First to the last copy, and the lane's ordering holds for every operation of the transfer.
    if (pipelined) {
      if (t->events[kLmcacheEventFirst] == 0) return cudaErrorInvalidValue;
      LMCACHE_TRY(cudaStreamWaitEvent(AsStream(t->copy_stream), AsEvent(t->events[kLmcacheEventFirst]), 0));
    }
    LMCACHE_TRY(EnqueueCopies(t, true));
    // Pipelined, the kernel starts once the first slice is in: its blocks then wait only for the later slices.
    if (pipelined) {
      if (t->events[kLmcacheEventFirstSliceIn] == 0) return cudaErrorInvalidValue;
      LMCACHE_TRY(cudaStreamWaitEvent(stream, AsEvent(t->events[kLmcacheEventFirstSliceIn]), 0));
    }
  }
  LMCACHE_TRY(Record(t, kLmcacheEventKernelBegin, t->kernel.stream));
  LMCACHE_TRY(lmcache_cuda_kv_transfer(&t->kernel));
  LMCACHE_TRY(Record(t, kLmcacheEventKernelEnd, t->kernel.stream));
  return Record(t, kLmcacheEventPagesFree, t->kernel.stream);
}

// The rest: a store's copies out, the last events and the status read-back.
int EnqueueTail(const LmcacheCudaTransfer* t) {
  // A store's copies are queued after its kernel, also when they wait for its flags on the copy stream: streams may
  // share a hardware queue, and a wait queued there ahead of the kernel that ends it would never end.
  if (t->direction == lmcache_npu::kStore) LMCACHE_TRY(EnqueueCopies(t, false));
  LMCACHE_TRY(Record(t, kLmcacheEventLast, t->kernel.stream));
  if (t->status_host != 0) {
    LMCACHE_TRY(cudaMemcpyAsync(reinterpret_cast<void*>(t->status_host),
                                reinterpret_cast<const void*>(t->kernel.status), sizeof(LmcacheCudaStatus),
                                cudaMemcpyDeviceToHost, AsStream(t->kernel.stream)));
  }
  return Record(t, kLmcacheEventReturned, t->kernel.stream);
}

}  // namespace

extern "C" int lmcache_cuda_transfer(const LmcacheCudaTransfer* t) {
  LMCACHE_TRY(EnqueueHead(t));
  return EnqueueTail(t);
}

namespace {

// `waiter`'s later work waits for `done`'s work so far (a fresh event, released once the wait is queued).
int JoinStreams(cudaStream_t done, cudaStream_t waiter) {
  cudaEvent_t event = nullptr;
  LMCACHE_TRY(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  int rc = cudaEventRecord(event, done);
  if (rc == cudaSuccess) rc = cudaStreamWaitEvent(waiter, event, 0);
  const int destroyed = cudaEventDestroy(event);  // a queued wait keeps what it needs
  return rc != cudaSuccess ? rc : destroyed;
}

// Host-to-device copies [first, end) of one slice on `stream`: one batched call where the runtime has it (each
// cudaMemcpyAsync costs microseconds of host time and a sliced load makes one per chunk and slice), else one each.
int EnqueueHostToDevice(const LmcacheCudaCopy* copies, uint64_t first, uint64_t end, cudaStream_t stream) {
#if CUDART_VERSION >= 13000
  if (end - first > 1) {
    static thread_local std::vector<void*> dsts;
    static thread_local std::vector<const void*> srcs;
    static thread_local std::vector<size_t> sizes;
    dsts.clear();
    srcs.clear();
    sizes.clear();
    for (uint64_t i = first; i < end; ++i) {
      dsts.push_back(reinterpret_cast<void*>(copies[i].staging));
      srcs.push_back(reinterpret_cast<const void*>(copies[i].host));
      sizes.push_back(copies[i].bytes);
    }
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // the host bytes are read in stream order
    size_t attribute_index = 0;
    if (cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attributes, &attribute_index, 1,
                             stream) == cudaSuccess) {
      return cudaSuccess;
    }
    cudaGetLastError();  // a driver without batched copies: one call each below
  }
#endif
  for (uint64_t i = first; i < end; ++i) {
    LMCACHE_TRY(cudaMemcpyAsync(reinterpret_cast<void*>(copies[i].staging),
                                reinterpret_cast<const void*>(copies[i].host), copies[i].bytes,
                                cudaMemcpyHostToDevice, stream));
  }
  return cudaSuccess;
}

}  // namespace

extern "C" int lmcache_cuda_sliced_load(const LmcacheCudaTransfer* t, const LmcacheCudaSlices* s) {
  if (t->direction != lmcache_npu::kLoad || t->kernel.pipeline != kLmcacheNoPipeline || s->num_slices == 0) {
    return cudaErrorInvalidValue;
  }
  const auto* copies = reinterpret_cast<const LmcacheCudaCopy*>(t->copies);
  for (uint64_t i = 1; i < t->num_copies; ++i) {
    if (copies[i].slice < copies[i - 1].slice) return cudaErrorInvalidValue;  // a copy out of slice order
  }
  if (t->num_copies != 0 && copies[t->num_copies - 1].slice >= s->num_slices) return cudaErrorInvalidValue;
  if (s->copied_ahead > 1) return cudaErrorInvalidValue;  // only slice 0's copies are ever enqueued ahead
  const auto* slice_items = reinterpret_cast<const uint32_t*>(s->slice_items);
  auto* slice_events = reinterpret_cast<uint64_t*>(s->slice_events);
  uint64_t total = 0;
  for (uint64_t k = 0; k < s->num_slices; ++k) total += slice_items[k];
  if (total != t->kernel.num_items) return cudaErrorInvalidValue;  // the slices must cover the items exactly
  const cudaStream_t stream = AsStream(t->kernel.stream);
  // Copied ahead, the window already started before those copies.
  if (s->copied_ahead == 0) LMCACHE_TRY(Record(t, kLmcacheEventFirst, t->kernel.stream));
  // With a copy stream the copies run back to back beside the kernels. The copy stream starts where the caller's
  // stream is now (staging is free of earlier transfers; slice 0's copies ahead come first).
  uint64_t copied_here = 0;  // copies this call enqueues (slice 0's may have gone ahead)
  for (uint64_t i = 0; i < t->num_copies; ++i) copied_here += copies[i].slice >= s->copied_ahead ? 1 : 0;
  const cudaStream_t copy_stream = t->copy_stream != 0 && copied_here != 0 ? AsStream(t->copy_stream) : stream;
  if (copy_stream != stream) LMCACHE_TRY(JoinStreams(stream, copy_stream));
  if (t->table_bytes != 0) {
    LMCACHE_TRY(cudaMemcpyAsync(reinterpret_cast<void*>(t->table_device), reinterpret_cast<const void*>(t->table_host),
                                t->table_bytes, cudaMemcpyHostToDevice, stream));
  }
  LmcacheCudaLaunch kernel = t->kernel;
  uint64_t copy = 0, first_item = 0;
  for (uint64_t k = 0; k < s->num_slices; ++k) {
    const uint64_t first_copy = copy;
    while (copy < t->num_copies && copies[copy].slice == k) ++copy;
    if (k >= s->copied_ahead && copy > first_copy) {
      LMCACHE_TRY(EnqueueHostToDevice(copies, first_copy, copy, copy_stream));
      // Queued right after the copies it waits for: where the two streams share a hardware queue, this order is
      // the one-stream order (a wait queued behind every copy would hold each kernel until the whole load was in).
      if (copy_stream != stream) LMCACHE_TRY(JoinStreams(copy_stream, stream));
    }
    if (k == 0) LMCACHE_TRY(Record(t, kLmcacheEventKernelBegin, t->kernel.stream));
    kernel.items = t->kernel.items + 16 * first_item;  // uint32 x4 per item
    kernel.num_items = slice_items[k];
    LMCACHE_TRY(lmcache_cuda_kv_transfer(&kernel));
    cudaEvent_t landed = nullptr;
    LMCACHE_TRY(cudaEventCreateWithFlags(&landed, cudaEventDisableTiming));
    slice_events[k] = reinterpret_cast<uint64_t>(landed);
    LMCACHE_TRY(cudaEventRecord(landed, stream));
    first_item += slice_items[k];
  }
  LMCACHE_TRY(Record(t, kLmcacheEventKernelEnd, t->kernel.stream));
  LMCACHE_TRY(Record(t, kLmcacheEventPagesFree, t->kernel.stream));
  return EnqueueTail(t);
}

extern "C" int lmcache_cuda_copy_ahead(uint64_t stream, uint64_t first, uint64_t copied, const LmcacheCudaCopy* copies,
                                       uint64_t num_copies) {
  if (first != 0) LMCACHE_TRY(cudaEventRecord(AsEvent(first), AsStream(stream)));
  LMCACHE_TRY(EnqueueHostToDevice(copies, 0, num_copies, AsStream(stream)));
  return copied == 0 ? cudaSuccess : cudaEventRecord(AsEvent(copied), AsStream(stream));
}

#undef LMCACHE_TRY

extern "C" int lmcache_cuda_event_create(uint64_t* event, int blocking) {
  cudaEvent_t handle = nullptr;
  const cudaError_t err = cudaEventCreateWithFlags(&handle, blocking ? cudaEventBlockingSync : cudaEventDefault);
  *event = reinterpret_cast<uint64_t>(handle);
  return err;
}

extern "C" int lmcache_cuda_event_destroy(uint64_t event) { return cudaEventDestroy(AsEvent(event)); }

extern "C" int lmcache_cuda_event_synchronize(uint64_t event) { return cudaEventSynchronize(AsEvent(event)); }

extern "C" int lmcache_cuda_event_query(uint64_t event) {
  const cudaError_t err = cudaEventQuery(AsEvent(event));
  if (err == cudaSuccess) return 1;
  if (err == cudaErrorNotReady) {
    cudaGetLastError();  // not ready is an answer, not a sticky error
    return 0;
  }
  return -1;
}

extern "C" int lmcache_cuda_stream_wait_event(uint64_t stream, uint64_t event) {
  return cudaStreamWaitEvent(AsStream(stream), AsEvent(event), 0);
}

extern "C" int lmcache_cuda_event_elapsed_ms(uint64_t begin, uint64_t end, float* ms) {
  return cudaEventElapsedTime(ms, AsEvent(begin), AsEvent(end));
}

extern "C" int lmcache_cuda_multiprocessors(int device, int* count) {
  return cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
}

namespace {

bool MappedHostByte(uint64_t address) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, reinterpret_cast<const void*>(address)) != cudaSuccess) {
    cudaGetLastError();  // an unknown pointer is an answer, not a sticky error
    return false;
  }
  return attributes.type == cudaMemoryTypeHost &&
         reinterpret_cast<uint64_t>(attributes.devicePointer) == address;
}

}  // namespace

extern "C" int lmcache_cuda_host_mapped(uint64_t address, uint64_t size) {
  if (size == 0) return 0;
  return MappedHostByte(address) && MappedHostByte(address + size - 1) ? 1 : 0;
}

namespace {

using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

// Driver entry points fetched through the runtime, so the module does not link libcuda.
StreamValueFn DriverFunction(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<StreamValueFn>(fn);
}

// wait: until *address >= value; else *address = value. 0 on success, -1 if the driver lacks the call.
int StreamValue(bool wait, uint64_t stream, uint64_t address, uint32_t value) {
  static const StreamValueFn wait_fn = DriverFunction("cuStreamWaitValue32");
  static const StreamValueFn write_fn = DriverFunction("cuStreamWriteValue32");
  const StreamValueFn fn = wait ? wait_fn : write_fn;
  if (fn == nullptr) return -1;
  return static_cast<int>(fn(reinterpret_cast<CUstream>(static_cast<uintptr_t>(stream)),
                             static_cast<CUdeviceptr>(address), value,
                             wait ? static_cast<unsigned>(CU_STREAM_WAIT_VALUE_GEQ)
                                  : static_cast<unsigned>(CU_STREAM_WRITE_VALUE_DEFAULT)));
}

}  // namespace

extern "C" int lmcache_cuda_stream_wait_value32(uint64_t stream, uint64_t address, uint32_t value) {
  return StreamValue(true, stream, address, value);
}

extern "C" int lmcache_cuda_stream_write_value32(uint64_t stream, uint64_t address, uint32_t value) {
  return StreamValue(false, stream, address, value);
}

extern "C" const char* lmcache_cuda_error_string(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}
