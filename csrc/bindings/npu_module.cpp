// lmcache_npu._npu: the AscendC kv-transfer kernel, host memory registration and device buffers on an Ascend NPU
// (built only with CANN, against torch_npu). Raw addresses in, raw addresses out; no torch C++ types cross here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

#include "../common/transfer_plan.h"
#include "../npu/host_memory.h"
#include "../npu/npu_runtime.h"
#include "../npu/task_queue.h"
#include "../npu/transfer.h"
#include "acl/acl.h"
#include "tiling/platform/platform_ascendc.h"

#ifndef LMCACHE_NPU_MODULE_NAME
#define LMCACHE_NPU_MODULE_NAME _npu
#endif
// The SOC_VERSION the kernel library was compiled for (csrc/ascendc/CMakeLists.txt defines it): CANN's generated
// launcher registers no kernel on a SoC of another family, so Python compares it with the running SoC first.
#ifndef LMCACHE_NPU_BUILT_SOC
#define LMCACHE_NPU_BUILT_SOC ""
#endif
// The same, findable in the file's bytes: doctor reads it without importing the module (which needs a device).
extern "C" __attribute__((used)) const char lmcache_npu_built_soc_tag[] =
    "LMCACHE_NPU_BUILT_SOC=" LMCACHE_NPU_BUILT_SOC;

namespace py = pybind11;
namespace npu = lmcache_npu::npu;

namespace {

// The device the calling thread has selected (torch.npu.set_device), checked against the one asked for: an ACL call
// on a thread without a device acts on whatever context is current, or none.
void RequireDevice(int32_t device) {
  int32_t current = -1;
  const aclError rc = aclrtGetDevice(&current);
  if (rc != ACL_SUCCESS) {
    throw std::runtime_error(npu::AclErrorText("aclrtGetDevice", rc) +
                             " (select the device first: torch.npu.set_device)");
  }
  if (current != device) {
    throw std::runtime_error("this thread's current NPU is " + std::to_string(current) + ", not " +
                             std::to_string(device) + " (torch.npu.set_device first)");
  }
}

py::dict Platform(int32_t device) {
  RequireDevice(device);
  const char* soc = aclrtGetSocName();
  if (soc == nullptr || soc[0] == '\0') {
    throw std::runtime_error(npu::AclErrorText("aclrtGetSocName", -1) + ": no SoC name for NPU " +
                             std::to_string(device));
  }
  auto* platform = platform_ascendc::PlatformAscendCManager::GetInstance(soc);
  if (platform == nullptr) throw std::runtime_error(std::string("no AscendC platform info for SoC ") + soc);
  uint64_t ub_bytes = 0;
  platform->GetCoreMemSize(platform_ascendc::CoreMemType::UB, ub_bytes);
  py::dict info;
  info["soc"] = std::string(soc);
  info["vector_cores"] = platform->GetCoreNumAiv();  // AIVs on A2/A3, AI cores on 310P
  info["ub_bytes"] = ub_bytes;
  info["task_queue"] = npu::TaskQueueEnabled();
  info["built_soc"] = std::string(LMCACHE_NPU_BUILT_SOC);
  return info;
}

py::tuple HostRegister(uint64_t address, uint64_t bytes) {
  npu::Registration registration;
  {
    py::gil_scoped_release release;
    registration = npu::HostRegister(address, bytes);
  }
  return py::make_tuple(registration.device_address, registration.api);
}

py::dict PointerAttributes(uint64_t address) {
  const npu::PointerInfo info = npu::PointerAttributes(address);
  py::dict out;
  out["location"] = info.location;
  out["id"] = info.id;
  out["page_bytes"] = info.page_bytes;
  return out;
}

// Field name -> byte offset of the descriptors Python fills, so a stale build is refused by name, not misread.
py::list LaunchFields() {
  using L = npu::LaunchDesc;
  py::list fields;
  auto add = [&](const char* name, size_t offset) { fields.append(py::make_tuple(name, offset)); };
  add("table_host", offsetof(L, table_host));
  add("table_device", offsetof(L, table_device));
  add("table_bytes", offsetof(L, table_bytes));
  add("planes", offsetof(L, planes));
  add("groups", offsetof(L, groups));
  add("runs", offsetof(L, runs));
  add("objects", offsetof(L, objects));
  add("status_device", offsetof(L, status_device));
  add("status_host", offsetof(L, status_host));
  add("status_bytes", offsetof(L, status_bytes));
  add("zero_device", offsetof(L, zero_device));
  add("zero_bytes", offsetof(L, zero_bytes));
  add("copies_in", offsetof(L, copies_in));
  add("num_copies_in", offsetof(L, num_copies_in));
  add("copies_out", offsetof(L, copies_out));
  add("num_copies_out", offsetof(L, num_copies_out));
  add("total_items", offsetof(L, total_items));
  add("block_dim", offsetof(L, block_dim));
  add("num_planes", offsetof(L, num_planes));
  add("num_groups", offsetof(L, num_groups));
  add("num_runs", offsetof(L, num_runs));
  add("num_chunks", offsetof(L, num_chunks));
  add("direction", offsetof(L, direction));
  add("tile_bytes", offsetof(L, tile_bytes));
  add("zero_tile_bytes", offsetof(L, zero_tile_bytes));
  return fields;
}

}  // namespace

PYBIND11_MODULE(LMCACHE_NPU_MODULE_NAME, m) {
  m.doc() = "AscendC kv-transfer kernel launcher, host memory registration and device buffers";
  using Release = py::call_guard<py::gil_scoped_release>;
  m.def("platform", &Platform, "SoC name, vector cores, UB bytes and task queue state of the thread's NPU",
        py::arg("device"));
  m.def("host_register", &HostRegister, "aclrtHostRegisterV2(PINNED|MAPPED), else aclrtHostRegister(MAPPED), of "
        "[address, address + bytes): (the device address or 0, the call that registered it)", py::arg("address"),
        py::arg("bytes"));
  m.def("host_unregister", &npu::HostUnregister, "aclrtHostUnregister", py::arg("address"), Release());
  m.def("malloc_host", &npu::MallocHost, "aclrtMallocHost: page-locked host memory; its address", py::arg("bytes"),
        Release());
  m.def("free_host", &npu::FreeHost, "aclrtFreeHost", py::arg("address"), Release());
  m.def("hal_register", &npu::HalRegister, "mlock + halHostRegister; the device address", py::arg("address"),
        py::arg("bytes"), Release());
  m.def("hal_unregister", &npu::HalUnregister, "halHostUnregister + munlock", py::arg("address"), py::arg("bytes"),
        Release());
  m.def("device_malloc", &npu::DeviceMalloc, "aclrtMalloc (huge pages first); the device address", py::arg("bytes"),
        Release());
  m.def("device_free", &npu::DeviceFree, "aclrtFree", py::arg("address"), Release());
  m.def("copy_to_device", &npu::CopyToDevice, "blocking aclrtMemcpy host -> device", py::arg("device"),
        py::arg("host"), py::arg("bytes"), Release());
  m.def("pointer_attributes", &PointerAttributes, "aclrtPointerGetAttributes of an address", py::arg("address"));
  m.def("task_queue_enabled", &npu::TaskQueueEnabled, "whether torch_npu's task queue is on");
  m.def("logical_device", &npu::LogicalDevice, "the driver's logical id of a user device id (halHostRegister's)",
        py::arg("user_device"));
  m.attr("BUILT_SOC") = std::string(LMCACHE_NPU_BUILT_SOC);

  py::class_<npu::Transfer>(m, "Transfer", "one lane's transfers: windows enqueued through the task queue, a tail, "
                                           "a wait")
      .def(py::init<uint32_t>(), py::arg("timeout_ms") = npu::Transfer::kDefaultTimeoutMs)
      .def("begin", &npu::Transfer::Begin)
      .def("submit_windows", &npu::Transfer::SubmitWindows, py::arg("launches"), py::arg("count"), Release())
      .def("submit_tail", &npu::Transfer::SubmitTail, py::arg("launches"), py::arg("count"), Release())
      .def("wait", &npu::Transfer::Wait, Release());

  m.attr("LAUNCH_FIELDS") = LaunchFields();
  m.attr("LAUNCH_BYTES") = sizeof(npu::LaunchDesc);
  m.attr("COPY_BYTES") = sizeof(npu::CopyDesc);
  m.attr("CORE_STATUS_BYTES") = sizeof(lmcache_npu::CoreStatus);
  m.attr("LAYOUT_VERSION") = lmcache_npu::kLayoutVersion;
}
