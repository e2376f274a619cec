// lmcache_npu._host: the transfer contract with memcpy over host memory (vLLM's CPU platform).
// Takes raw host addresses (no torch C++ types), like _emu; the GIL is released while bytes move.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>

#include "../common/transfer_plan.h"
#include "../host/kv_transfer_host.h"
#include "../host/block_slots.h"
#include "../host/sliced_order.h"
#include "../host/slot_runs.h"

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

// A C-contiguous array's bytes as `count` records of T (numpy structured dtypes arrive as plain bytes).
template <typename T>
const T* Records(const py::array& array, const char* name, size_t* count) {
  if (!(array.flags() & py::array::c_style) || array.itemsize() != static_cast<py::ssize_t>(sizeof(T))) {
    throw py::value_error(std::string(name) + ": needs C-contiguous records of " + std::to_string(sizeof(T)) +
                          " B, got items of " + std::to_string(array.itemsize()) + " B");
  }
  *count = static_cast<size_t>(array.size());
  return static_cast<const T*>(array.data());
}

template <typename T, size_t N>
py::array_t<T> Rows(const std::vector<std::array<T, N>>& rows) {
  py::array_t<T> out({static_cast<py::ssize_t>(rows.size()), static_cast<py::ssize_t>(N)});
  if (!rows.empty()) std::memcpy(out.mutable_data(), rows.data(), rows.size() * sizeof(rows[0]));
  return out;
}

template <typename T>
py::array_t<uint8_t> Bytes(const std::vector<T>& records) {
  py::array_t<uint8_t> out(static_cast<py::ssize_t>(records.size() * sizeof(T)));
  if (!records.empty()) std::memcpy(out.mutable_data(), records.data(), records.size() * sizeof(T));
  return out;
}

py::tuple SlicedLoadOrderBinding(const py::array& planes, const py::array& groups, const py::array& runs,
                                 const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& plane_slice,
                                 uint32_t num_slices, uint32_t num_chunks, uint64_t piece_bytes,
                                 uint64_t object_bytes, const py::object& object_addresses,
                                 const py::object& object_storages) {
  size_t num_planes = 0, num_groups = 0, num_runs = 0;
  lmcache_npu::host::SlicedOrderInput input;
  input.planes = Records<lmcache_npu::PlaneDesc>(planes, "planes", &num_planes);
  input.groups = Records<lmcache_npu::GroupDesc>(groups, "groups", &num_groups);
  input.runs = Records<lmcache_npu::RunDesc>(runs, "runs", &num_runs);
  if (static_cast<size_t>(plane_slice.size()) != num_planes) {
    throw py::value_error("plane_slice has " + std::to_string(plane_slice.size()) + " entries for " +
                          std::to_string(num_planes) + " planes");
  }
  input.plane_slice = plane_slice.data();
  input.num_planes = static_cast<uint32_t>(num_planes);
  input.num_groups = static_cast<uint32_t>(num_groups);
  input.num_runs = static_cast<uint32_t>(num_runs);
  input.num_chunks = num_chunks;
  input.num_slices = num_slices;
  input.piece_bytes = piece_bytes;
  input.object_bytes = object_bytes;
  py::array_t<uint64_t, py::array::c_style> addresses, storages;
  if (!object_addresses.is_none()) {
    addresses = py::array_t<uint64_t, py::array::c_style>::ensure(object_addresses);
    storages = py::array_t<uint64_t, py::array::c_style>::ensure(object_storages);
    if (!addresses || !storages || static_cast<uint64_t>(addresses.size()) != num_chunks ||
        static_cast<uint64_t>(storages.size()) != num_chunks) {
      throw py::value_error("object_addresses and object_storages need one uint64 per chunk (" +
                            std::to_string(num_chunks) + ")");
    }
    input.object_addresses = addresses.data();
    input.object_storages = storages.data();
  }
  lmcache_npu::host::SlicedOrder order;
  try {
    order = lmcache_npu::host::PlanSlicedLoad(input);
  } catch (const std::invalid_argument& error) {
    throw py::value_error(error.what());
  }
  py::array_t<uint32_t> slice_items(static_cast<py::ssize_t>(order.slice_items.size()));
  std::memcpy(slice_items.mutable_data(), order.slice_items.data(), order.slice_items.size() * sizeof(uint32_t));
  py::object copies = py::none();
  if (input.object_addresses != nullptr) copies = Rows(order.copies);
  return py::make_tuple(Bytes(order.runs), Bytes(order.groups), Rows(order.items), slice_items, Rows(order.pieces),
                        copies);
}

py::tuple SlotRunsBinding(const py::array_t<int64_t, py::array::c_style>& slots, uint64_t rows_per_block,
                          int64_t limit, bool zero_runs, bool unique) {
  if (slots.ndim() != 2) throw py::value_error("slots must be a (chunks, rows) matrix");
  if (rows_per_block == 0) throw py::value_error("rows_per_block must be positive");
  const lmcache_npu::host::SlotRuns runs = lmcache_npu::host::CutSlotRuns(
      slots.data(), static_cast<uint64_t>(slots.shape(0)), static_cast<uint64_t>(slots.shape(1)), rows_per_block,
      limit, zero_runs, unique);
  return py::make_tuple(Bytes(runs.runs), static_cast<uint32_t>(runs.problem), runs.at, runs.again);
}

py::tuple BlockSlotsBinding(int64_t chunk_tokens, int64_t stored_tokens, int64_t tokens_per_block,
                            int64_t compress_ratio, int64_t rows_per_block, int64_t rows_per_chunk, bool recurrent,
                            const std::vector<int64_t>& block_ids, int64_t first_block, int64_t null_block,
                            const std::vector<int64_t>& index, const py::object& first_token,
                            const py::object& end_token, const py::object& store, const py::object& bare) {
  lmcache_npu::host::SlotGroup group{chunk_tokens, stored_tokens, tokens_per_block, compress_ratio, rows_per_block,
                                     rows_per_chunk, recurrent};
  lmcache_npu::host::ChunkMoves moves;
  moves.index = index.data();
  moves.count = index.size();
  moves.transfer = !first_token.is_none();
  std::vector<int64_t> first, end;
  std::vector<uint8_t> stores, bares;
  if (moves.transfer) {
    first = first_token.cast<std::vector<int64_t>>();
    end = end_token.cast<std::vector<int64_t>>();
    stores = store.cast<std::vector<uint8_t>>();
    bares = bare.cast<std::vector<uint8_t>>();
    if (first.size() != index.size() || end.size() != index.size() || stores.size() != index.size() ||
        bares.size() != index.size()) {
      throw py::value_error("block_slots: first_token, end_token, store and bare need one entry per chunk (" +
                            std::to_string(index.size()) + ")");
    }
    moves.first_token = first.data();
    moves.end_token = end.data();
    moves.store = stores.data();
    moves.bare = bares.data();
  }
  if (rows_per_chunk < 0) throw py::value_error("block_slots: rows_per_chunk must not be negative");
  py::array_t<int64_t> slots({static_cast<py::ssize_t>(index.size()), static_cast<py::ssize_t>(rows_per_chunk)});
  py::array_t<bool> refused(static_cast<py::ssize_t>(index.size()));
  try {
    lmcache_npu::host::BlockSlots(group, block_ids, first_block, null_block, moves, slots.mutable_data(),
                                  reinterpret_cast<uint8_t*>(refused.mutable_data()));
  } catch (const std::invalid_argument& error) {
    throw py::value_error(error.what());
  }
  return py::make_tuple(slots, refused);
}

}  // namespace

PYBIND11_MODULE(_host, m) {
  m.doc() = "KV-cache transfer contract with memcpy over host memory";
  m.def("transfer", &TransferBinding, "Move every work item of a batch; returns the counts", py::arg("planes"),
        py::arg("groups"), py::arg("runs"), py::arg("objects"), py::arg("total_items"), py::arg("num_planes"),
        py::arg("num_groups"), py::arg("num_runs"), py::arg("num_chunks"), py::arg("object_bytes"),
        py::arg("direction"), py::arg("threads") = 1);
  m.def("sliced_load_order", &SlicedLoadOrderBinding,
        "A sliced load's work order (csrc/host/sliced_order.h): run and group table bytes, items, per-slice item "
        "counts, copy pieces, and copies relative to staging (None without object addresses)",
        py::arg("planes"), py::arg("groups"), py::arg("runs"), py::arg("plane_slice"), py::arg("num_slices"),
        py::arg("num_chunks"), py::arg("piece_bytes"), py::arg("object_bytes"), py::arg("object_addresses") = py::none(),
        py::arg("object_storages") = py::none());
  m.def("slot_runs", &SlotRunsBinding,
        "A group's slot matrix checked and cut into runs (csrc/host/slot_runs.h): run table bytes, the problem "
        "found (0 none, 1 a slot out of range, 2 a slot a load writes twice) and its row-major positions",
        py::arg("slots"), py::arg("rows_per_block"), py::arg("limit"), py::arg("zero_runs"), py::arg("unique"));
  m.def("block_slots", &BlockSlotsBinding,
        "Chunk rows to page slots (csrc/host/block_slots.h): the (chunks, rows) slot matrix and, for a transfer "
        "(first_token given), which stores are refused",
        py::arg("chunk_tokens"), py::arg("stored_tokens"), py::arg("tokens_per_block"), py::arg("compress_ratio"),
        py::arg("rows_per_block"), py::arg("rows_per_chunk"), py::arg("recurrent"), py::arg("block_ids"),
        py::arg("first_block"), py::arg("null_block"), py::arg("index"), py::arg("first_token") = py::none(),
        py::arg("end_token") = py::none(), py::arg("store") = py::none(), py::arg("bare") = py::none());
  m.attr("MAX_THREADS") = kMaxThreads;
  m.attr("LAYOUT_VERSION") = lmcache_npu::kLayoutVersion;
  m.attr("PLANE_DESC_BYTES") = sizeof(lmcache_npu::PlaneDesc);
  m.attr("GROUP_DESC_BYTES") = sizeof(lmcache_npu::GroupDesc);
  m.attr("RUN_DESC_BYTES") = sizeof(lmcache_npu::RunDesc);
}
