// The native NPU runtime behind lmcache_npu._npu: what the transfer lanes ask of ACL and of torch_npu.
//
// Three parts, each with one job:
//   task queue   (task_queue.h)   where our device work enters torch_npu's task queue, so it is ordered after what
//                                 the lane's stream already queued without draining the device-wide queue;
//   host memory  (host_memory.cpp) the ways an arena segment becomes DMA-able host memory (the registration chain);
//   transfer     (transfer.cpp)   one transfer: per window a table upload, staging zeroing, host copies, one kernel
//                                 launch and its status read-back, all enqueued as tasks of the lane's stream.
//
// Every address crossing this boundary is a plain uint64; records are POD with fixed widths so Python builds them
// as numpy structured arrays at the offsets the module reports (a stale build is refused by field names).
#ifndef LMCACHE_NPU_NPU_RUNTIME_H_
#define LMCACHE_NPU_NPU_RUNTIME_H_

#include <cstdint>
#include <string>

namespace lmcache_npu {
namespace npu {

// One host <-> device copy of a transfer (aclrtMemcpyAsync on the lane's stream).
struct CopyDesc {
  uint64_t device;  // device address (inside the staging window)
  uint64_t host;    // host address (an arena slot or another page-locked object)
  uint64_t bytes;
};
static_assert(sizeof(CopyDesc) == 24, "CopyDesc is read by address from Python");

// One kernel launch of a transfer and the work around it, in the order it runs on the stream:
//   tables H2D -> status zeroed -> staging gaps zeroed -> copies_in (H2D) -> kernel -> status D2H -> copies_out (D2H)
struct LaunchDesc {
  uint64_t table_host;     // pinned host bytes of this launch's tables (group, run, object address tables)
  uint64_t table_device;   // where they are uploaded before the kernel
  uint64_t table_bytes;
  uint64_t planes;         // device plane table (uploaded once per plan)
  uint64_t groups;         // device addresses inside [table_device, table_device + table_bytes)
  uint64_t runs;
  uint64_t objects;
  uint64_t status_device;  // per-core status blocks: zeroed before the kernel, read back after it
  uint64_t status_host;    // pinned host bytes the status blocks land in
  uint64_t status_bytes;
  uint64_t zero_device;    // staging bytes a store must find zeroed (alignment gaps), 0 bytes: none
  uint64_t zero_bytes;
  uint64_t copies_in;      // CopyDesc[num_copies_in]: host -> device before the kernel (a load's objects)
  uint64_t num_copies_in;
  uint64_t copies_out;     // CopyDesc[num_copies_out]: device -> host after the kernel (a store's objects)
  uint64_t num_copies_out;
  uint64_t total_items;
  uint32_t block_dim;
  uint32_t num_planes;
  uint32_t num_groups;
  uint32_t num_runs;
  uint32_t num_chunks;
  uint32_t direction;
  uint32_t tile_bytes;
  uint32_t zero_tile_bytes;
};
static_assert(sizeof(LaunchDesc) == 168, "LaunchDesc is read by address from Python");

// The first failure of a transfer: its ACL (or driver) code and the text naming the call, the window and the code.
struct TransferError {
  int code = 0;
  std::string message;
  bool failed() const { return code != 0; }
};

}  // namespace npu
}  // namespace lmcache_npu

#endif  // LMCACHE_NPU_NPU_RUNTIME_H_
