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
            uint64_t status, uint64_t num_items, uint32_t num_planes, uint32_t num_groups, uint32_t num_runs,
            uint32_t num_chunks, uint32_t direction, uint32_t blocks, uint32_t threads) {
  const LmcacheCudaLaunch launch{stream,    planes,     groups,     runs,     objects,    items,     status,  num_items,
                                 num_planes, num_groups, num_runs, num_chunks, direction, blocks, threads};
  Check(lmcache_cuda_kv_transfer(&launch), "lmcache_cuda_kv_transfer");
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
        py::arg("objects"), py::arg("items"), py::arg("status"), py::arg("num_items"), py::arg("num_planes"),
        py::arg("num_groups"), py::arg("num_runs"), py::arg("num_chunks"), py::arg("direction"), py::arg("blocks"),
        py::arg("threads"), py::call_guard<py::gil_scoped_release>());
  m.def("multiprocessors", &Multiprocessors, py::arg("device"));
  m.attr("STATUS_BYTES") = sizeof(LmcacheCudaStatus);
  m.attr("LAYOUT_VERSION") = lmcache_npu::kLayoutVersion;
}
