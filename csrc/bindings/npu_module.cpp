// lmcache_npu._npu: launches the AscendC kv-transfer kernel on an Ascend NPU (built only with CANN).
// Takes raw device addresses and the aclrtStream handle from torch_npu; no torch C++ types.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "acl/acl.h"
#include "aclrtlaunch_lmcache_kv_transfer.h"
#include "tiling/platform/platform_ascendc.h"

#include "../common/transfer_plan.h"

namespace py = pybind11;

namespace {

void* Dev(uint64_t addr) { return reinterpret_cast<void*>(static_cast<uintptr_t>(addr)); }

py::dict Platform() {
  const char* soc = aclrtGetSocName();
  auto* platform = platform_ascendc::PlatformAscendCManager::GetInstance(soc);
  if (platform == nullptr) throw std::runtime_error(std::string("no AscendC platform info for SoC ") + (soc ? soc : "?"));
  uint64_t ub_bytes = 0;
  platform->GetCoreMemSize(platform_ascendc::CoreMemType::UB, ub_bytes);
  py::dict d;
  d["soc"] = soc ? std::string(soc) : std::string();
  d["vector_cores"] = platform->GetCoreNumAiv();  // AIVs on A2/A3, AI cores on 310P
  d["ub_bytes"] = ub_bytes;
  return d;
}

void Launch(uint64_t stream, uint32_t block_dim, uint64_t planes, uint64_t groups, uint64_t runs, uint64_t objects,
            uint64_t status, uint64_t total_items, uint32_t num_planes, uint32_t num_groups, uint32_t num_runs,
            uint32_t num_chunks, uint32_t direction, uint32_t tile_bytes, uint32_t zero_tile_bytes) {
  if (block_dim < 1 || block_dim > 65535) throw std::invalid_argument("block_dim must be in [1, 65535]");
  const uint32_t rc = ACLRT_LAUNCH_KERNEL(lmcache_kv_transfer)(
      block_dim, reinterpret_cast<aclrtStream>(static_cast<uintptr_t>(stream)), Dev(planes), Dev(groups), Dev(runs),
      Dev(objects), Dev(status), total_items, num_planes, num_groups, num_runs, num_chunks, direction, tile_bytes,
      zero_tile_bytes);
  if (rc != 0) throw std::runtime_error("aclrtlaunch_lmcache_kv_transfer failed with error " + std::to_string(rc));
}

std::string AclError(const char* what, aclError rc) {
  const char* detail = aclGetRecentErrMsg();
  return std::string(what) + " failed with ACL error " + std::to_string(rc) + (detail ? std::string(": ") + detail : "");
}

// Maps page-aligned host memory (an arena segment) for the current device; returns the device's address of it.
uint64_t HostRegister(uint64_t address, uint64_t size) {
  if (address % 4096 != 0) throw std::invalid_argument("aclrtHostRegister needs a 4 KiB aligned host address");
  if (size == 0) throw std::invalid_argument("aclrtHostRegister needs a non-empty range");
  void* device = nullptr;
  const aclError rc = aclrtHostRegister(Dev(address), size, ACL_HOST_REGISTER_MAPPED, &device);
  if (rc != ACL_SUCCESS) throw std::runtime_error(AclError("aclrtHostRegister", rc));
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(device));
}

void HostUnregister(uint64_t address) {
  const aclError rc = aclrtHostUnregister(Dev(address));
  if (rc != ACL_SUCCESS) throw std::runtime_error(AclError("aclrtHostUnregister", rc));
}

}  // namespace

PYBIND11_MODULE(_npu, m) {
  m.doc() = "AscendC kv-transfer kernel launcher";
  m.def("platform", &Platform, "SoC name, vector core count and UB bytes of the current device");
  m.def("launch", &Launch, py::arg("stream"), py::arg("block_dim"), py::arg("planes"), py::arg("groups"),
        py::arg("runs"), py::arg("objects"), py::arg("status"), py::arg("total_items"), py::arg("num_planes"),
        py::arg("num_groups"), py::arg("num_runs"), py::arg("num_chunks"), py::arg("direction"),
        py::arg("tile_bytes"), py::arg("zero_tile_bytes"), py::call_guard<py::gil_scoped_release>());
  m.def("host_register", &HostRegister, "aclrtHostRegister(MAPPED) of [address, address + size); the device address",
        py::arg("address"), py::arg("size"), py::call_guard<py::gil_scoped_release>());
  m.def("host_unregister", &HostUnregister, "aclrtHostUnregister of a range host_register registered",
        py::arg("address"), py::call_guard<py::gil_scoped_release>());
  m.attr("LAYOUT_VERSION") = lmcache_npu::kLayoutVersion;
}
