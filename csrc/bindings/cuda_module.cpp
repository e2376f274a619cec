// lmcache_npu._cuda: launches the CUDA kv-transfer kernel. Raw addresses and the stream handle
// come from Python as integers; this module links only the CUDA runtime, not torch.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "../common/transfer_plan.h"
#include "../cuda/kv_transfer_cuda.h"

namespace py = pybind11;

namespace {

void Check(int error, const char* what) {
  if (error != 0) throw std::runtime_error(std::string(what) + ": " + lmcache_cuda_error_string(error));
}

void Launch(uint64_t stream, uint64_t planes, uint64_t groups, uint64_t runs, uint64_t objects, uint64_t items,
            uint64_t slice_items, uint64_t slice_counters, uint64_t slice_flags, uint64_t status, uint64_t num_items,
            uint32_t num_planes, uint32_t num_groups, uint32_t num_runs, uint32_t num_chunks, uint32_t direction,
            uint32_t blocks, uint32_t threads, uint32_t num_slices, uint32_t epoch, uint32_t pipeline) {
  LmcacheCudaLaunch launch{};
  launch.stream = stream;
  launch.planes = planes;
  launch.groups = groups;
  launch.runs = runs;
  launch.objects = objects;
  launch.items = items;
  launch.slice_items = slice_items;
  launch.slice_counters = slice_counters;
  launch.slice_flags = slice_flags;
  launch.status = status;
  launch.num_items = num_items;
  launch.num_planes = num_planes;
  launch.num_groups = num_groups;
  launch.num_runs = num_runs;
  launch.num_chunks = num_chunks;
  launch.direction = direction;
  launch.blocks = blocks;
  launch.threads = threads;
  launch.num_slices = num_slices;
  launch.epoch = epoch;
  launch.pipeline = pipeline;
  Check(lmcache_cuda_kv_transfer(&launch), "lmcache_cuda_kv_transfer");
}

bool WaitValue(uint64_t stream, uint64_t address, uint32_t value) {
  const int rc = lmcache_cuda_stream_wait_value32(stream, address, value);
  if (rc > 0) Check(rc, "cuStreamWaitValue32");
  return rc == 0;
}

bool WriteValue(uint64_t stream, uint64_t address, uint32_t value) {
  const int rc = lmcache_cuda_stream_write_value32(stream, address, value);
  if (rc > 0) Check(rc, "cuStreamWriteValue32");
  return rc == 0;
}

int Multiprocessors(int device) {
  int count = 0;
  Check(lmcache_cuda_multiprocessors(device, &count), "cudaDeviceGetAttribute");
  return count;
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "CUDA kv-transfer kernel launcher (raw addresses, cudaStream_t as int)";
  m.def("launch", &Launch, py::arg("stream"), py::arg("planes"), py::arg("groups"), py::arg("runs"),
        py::arg("objects"), py::arg("items"), py::arg("slice_items"), py::arg("slice_counters"),
        py::arg("slice_flags"), py::arg("status"), py::arg("num_items"), py::arg("num_planes"),
        py::arg("num_groups"), py::arg("num_runs"), py::arg("num_chunks"), py::arg("direction"), py::arg("blocks"),
        py::arg("threads"), py::arg("num_slices"), py::arg("epoch"), py::arg("pipeline"),
        py::call_guard<py::gil_scoped_release>());
  m.def("stream_wait_value32", &WaitValue, "enqueue: wait until *address >= value; False if unsupported",
        py::arg("stream"), py::arg("address"), py::arg("value"));
  m.def("stream_write_value32", &WriteValue, "enqueue: *address = value; False if unsupported", py::arg("stream"),
        py::arg("address"), py::arg("value"));
  m.def("multiprocessors", &Multiprocessors, py::arg("device"));
  m.def(
      "host_mapped", [](uint64_t address, uint64_t size) { return lmcache_cuda_host_mapped(address, size) == 1; },
      "True when the host range is page-locked and mapped at the same address (cudaHostAlloc or cudaHostRegister)",
      py::arg("address"), py::arg("size"));
  m.attr("STATUS_BYTES") = sizeof(LmcacheCudaStatus);
  m.attr("LAYOUT_VERSION") = lmcache_npu::kLayoutVersion;
}
