// lmcache_npu._host: the transfer contract with memcpy over host memory (vLLM's CPU platform).
// Takes raw host addresses (no torch C++ types), like _emu; the GIL is released while bytes move.
#include <pybind11/pybind11.h>

#include <string>

#include "../common/transfer_plan.h"
#include "../host/kv_transfer_host.h"

namespace py = pybind11;

namespace {

// Enough for the largest host's cores; more would only add thread start-up cost.
constexpr uint32_t kMaxThreads = 1024;

template <typename T>
const T* Table(uint64_t addr) { return reinterpret_cast<const T*>(static_cast<uintptr_t>(addr)); }

py::dict TransferBinding(uint64_t planes, uint64_t groups, uint64_t runs, uint64_t objects, uint64_t total_items,
                         uint32_t num_planes, uint32_t num_groups, uint32_t num_runs, uint32_t num_chunks,
                         uint64_t object_bytes, uint32_t direction, uint32_t threads) {
  if (direction != lmcache_npu::kStore && direction != lmcache_npu::kLoad) {
    throw py::value_error("direction " + std::to_string(direction) + " is neither 0 (store) nor 1 (load)");
  }
  if (threads < 1 || threads > kMaxThreads) {
    throw py::value_error("threads " + std::to_string(threads) + " must be in [1, " + std::to_string(kMaxThreads) +
                          "]");
  }
  if (total_items > 0 && (planes == 0 || groups == 0 || runs == 0 || objects == 0)) {
    throw py::value_error("a transfer with work items needs the plane, group, run and object tables");
  }
  lmcache_npu::host::HostTables tables;
  tables.planes = Table<lmcache_npu::PlaneDesc>(planes);
  tables.groups = Table<lmcache_npu::GroupDesc>(groups);
  tables.runs = Table<lmcache_npu::RunDesc>(runs);
  tables.objects = Table<uint64_t>(objects);
  tables.num_planes = num_planes;
  tables.num_groups = num_groups;
  tables.num_runs = num_runs;
  tables.num_chunks = num_chunks;
  tables.object_bytes = object_bytes;
  tables.total_items = total_items;
  lmcache_npu::host::HostReport report;
  {
    py::gil_scoped_release release;
    report = lmcache_npu::host::Transfer(tables, static_cast<lmcache_npu::Direction>(direction), threads);
  }
  py::dict d;
  d["items_done"] = report.items_done;
  d["items_rejected"] = report.items_rejected;
  d["bytes_moved"] = report.bytes_moved;
  d["dma_ops"] = report.dma_ops;
  return d;
}

}  // namespace

PYBIND11_MODULE(_host, m) {
  m.doc() = "KV-cache transfer contract with memcpy over host memory";
  m.def("transfer", &TransferBinding, "Move every work item of a batch; returns the counts", py::arg("planes"),
        py::arg("groups"), py::arg("runs"), py::arg("objects"), py::arg("total_items"), py::arg("num_planes"),
        py::arg("num_groups"), py::arg("num_runs"), py::arg("num_chunks"), py::arg("object_bytes"),
        py::arg("direction"), py::arg("threads") = 1);
  m.attr("MAX_THREADS") = kMaxThreads;
  m.attr("LAYOUT_VERSION") = lmcache_npu::kLayoutVersion;
  m.attr("PLANE_DESC_BYTES") = sizeof(lmcache_npu::PlaneDesc);
  m.attr("GROUP_DESC_BYTES") = sizeof(lmcache_npu::GroupDesc);
  m.attr("RUN_DESC_BYTES") = sizeof(lmcache_npu::RunDesc);
}
