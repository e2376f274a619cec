// lmcache_npu._emu: runs the AscendC kernel sources on x86 under the strict emulator.
// Takes raw host addresses (no torch C++ types); Python registers every buffer the kernel may touch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "../ascendc/emu/ascendc_emu.h"
#include "../common/transfer_plan.h"
#include "kernel_entry.h"

namespace py = pybind11;

namespace {

emu::Target ParseTarget(const std::string& name) {
  if (name == "a2") return emu::Target::A2;
  if (name == "a3") return emu::Target::A3;
  if (name == "310p") return emu::Target::I310P;
  throw py::value_error("unknown emulated SoC '" + name + "'; expected one of a2, a3, 310p");
}

emu::CoreOrder ParseOrder(const std::string& name) {
  if (name == "sequential") return emu::CoreOrder::kSequential;
  if (name == "reverse") return emu::CoreOrder::kReverse;
  if (name == "shuffled") return emu::CoreOrder::kShuffled;
  throw py::value_error("unknown core order '" + name + "'; expected sequential, reverse or shuffled");
}

uint8_t* Ptr(uint64_t addr) { return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(addr)); }

using Region = std::tuple<uint64_t, uint64_t, bool, std::string>;

py::list Launch(const std::string& target, uint32_t block_dim, uint32_t ub_bytes, const std::string& order,
                uint64_t seed, uint64_t planes, uint64_t groups, uint64_t runs, uint64_t objects, uint64_t status,
                uint64_t total_items, uint32_t num_planes, uint32_t num_groups, uint32_t num_runs,
                uint32_t num_chunks, uint32_t direction, uint32_t tile_bytes, uint32_t zero_tile_bytes,
                const std::vector<Region>& regions, bool atomic_add_on_entry) {
  emu::LaunchConfig cfg;
  cfg.target = ParseTarget(target);
  cfg.ub_bytes = ub_bytes;
  cfg.block_dim = block_dim;
  cfg.order = ParseOrder(order);
  cfg.seed = seed;
  cfg.kernel = "lmcache_kv_transfer";
  cfg.atomic_add_on_entry = atomic_add_on_entry;
  std::vector<emu::GmRegion> gm;
  gm.reserve(regions.size());
  for (const Region& r : regions) {
    const uint64_t begin = std::get<0>(r);
    gm.push_back({static_cast<uintptr_t>(begin), static_cast<uintptr_t>(begin + std::get<1>(r)), std::get<2>(r),
                  std::get<3>(r)});
  }
  const KvTransferEntry entry =
      cfg.target == emu::Target::I310P ? &lmcache_kv_transfer_310p : &lmcache_kv_transfer_a2;
  emu::LaunchReport report;
  {
    py::gil_scoped_release release;
    report = emu::Launch(cfg, std::move(gm), [&]() {
      entry(Ptr(planes), Ptr(groups), Ptr(runs), Ptr(objects), Ptr(status), total_items, num_planes, num_groups,
            num_runs, num_chunks, direction, tile_bytes, zero_tile_bytes);
    });
  }
  py::list cores;
  for (const emu::CoreStats& s : report.cores) {
    py::dict d;
    d["mte2_ops"] = s.mte2_ops;
    d["mte3_ops"] = s.mte3_ops;
    d["mte2_bytes"] = s.mte2_bytes;
    d["mte3_bytes"] = s.mte3_bytes;
    d["scalar_gm_reads"] = s.scalar_gm_reads;
    d["vector_ops"] = s.vector_ops;
    d["ub_high_water"] = s.ub_high_water;
    cores.append(d);
  }
  return cores;
}

py::dict Tiling(uint32_t ub_bytes) {
  if (ub_bytes < lmcache_npu::kMinUbBytes || ub_bytes % lmcache_npu::kUbBlockBytes != 0) {
    throw py::value_error("UB capacity " + std::to_string(ub_bytes) + " B must be a multiple of 32 and at least " +
                          std::to_string(lmcache_npu::kMinUbBytes));
  }
  const lmcache_npu::UbTiling t = lmcache_npu::ComputeUbTiling(ub_bytes);
  py::dict d;
  d["tile_bytes"] = t.tile_bytes;
  d["zero_tile_bytes"] = t.zero_tile_bytes;
  d["status_bytes"] = t.status_bytes;
  d["reserve_bytes"] = t.reserve_bytes;
  return d;
}

}  // namespace

PYBIND11_MODULE(_emu, m) {
  m.doc() = "AscendC kv-transfer kernels run on x86 under the strict emulator";
  static py::exception<emu::Violation> violation(m, "EmuViolation", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const emu::Violation& e) {
      py::object exc = py::reinterpret_borrow<py::object>(violation.ptr())(e.what());
      exc.attr("rule") = e.rule();
      PyErr_SetObject(violation.ptr(), exc.ptr());
    }
  });
  m.def("launch", &Launch, "Run the kv-transfer kernel on emulated cores", py::arg("target"), py::arg("block_dim"),
        py::arg("ub_bytes"), py::arg("order"), py::arg("seed"), py::arg("planes"), py::arg("groups"),
        py::arg("runs"), py::arg("objects"), py::arg("status"), py::arg("total_items"), py::arg("num_planes"),
        py::arg("num_groups"), py::arg("num_runs"), py::arg("num_chunks"), py::arg("direction"),
        py::arg("tile_bytes"), py::arg("zero_tile_bytes"), py::arg("regions"), py::arg("atomic_add_on_entry") = false);
  m.def("ub_tiling", &Tiling, "UB split for a given UB capacity", py::arg("ub_bytes"));
  m.attr("LAYOUT_VERSION") = lmcache_npu::kLayoutVersion;
  m.attr("PLANE_DESC_BYTES") = sizeof(lmcache_npu::PlaneDesc);
  m.attr("GROUP_DESC_BYTES") = sizeof(lmcache_npu::GroupDesc);
  m.attr("RUN_DESC_BYTES") = sizeof(lmcache_npu::RunDesc);
  m.attr("CORE_STATUS_BYTES") = sizeof(lmcache_npu::CoreStatus);
}
