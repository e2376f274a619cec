// lmcache_npu._cuda: launches the CUDA kv-transfer kernel. Raw addresses and the stream handle
// come from Python as integers; this module links only the CUDA runtime, not torch.
#include <pybind11/pybind11.h>

#include <pybind11/stl.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/transfer_plan.h"
#include "../cuda/kv_transfer_cuda.h"

namespace py = pybind11;

namespace {

void Check(int error, const char* what) {
  if (error != 0) throw std::runtime_error(std::string(what) + ": " + lmcache_cuda_error_string(error));
}

// The transfer record lives in a numpy array the caller owns; its address crosses as an integer.
const LmcacheCudaTransfer* Record(uint64_t address) { return reinterpret_cast<const LmcacheCudaTransfer*>(address); }

void Transfer(uint64_t transfer) { Check(lmcache_cuda_transfer(Record(transfer)), "lmcache_cuda_transfer"); }

void SlicedLoad(uint64_t transfer, uint64_t slices) {
  Check(lmcache_cuda_sliced_load(Record(transfer), reinterpret_cast<const LmcacheCudaSlices*>(slices)),
        "lmcache_cuda_sliced_load");
}

// Slice 0's copies of a sliced load, one per chunk and segment: chunk c's object at addresses[c] lands at
// staging + c * object_bytes (staging mirrors the object layout); segments are (offset, length) pairs in an object.
void CopyAhead(uint64_t stream, uint64_t first, uint64_t copied, uint64_t staging, uint64_t object_bytes,
               const std::vector<uint64_t>& addresses, const std::vector<uint64_t>& segments) {
  if (segments.size() % 2 != 0) throw py::value_error("copy_ahead: segments are (offset, length) pairs");
  if (staging == 0) throw py::value_error("copy_ahead: no staging buffer (address 0)");
  for (size_t s = 0; s < segments.size(); s += 2) {
    if (segments[s + 1] > object_bytes || segments[s] > object_bytes - segments[s + 1]) {
      throw py::value_error("copy_ahead: segment " + std::to_string(s / 2) + " [" + std::to_string(segments[s]) +
                            ", +" + std::to_string(segments[s + 1]) + ") lies outside the " +
                            std::to_string(object_bytes) + "-byte object");
    }
  }
  static thread_local std::vector<LmcacheCudaCopy> copies;
  copies.clear();
  for (size_t c = 0; c < addresses.size(); ++c) {
    if (addresses[c] == 0) throw py::value_error("copy_ahead: chunk " + std::to_string(c) + " has no object (0)");
    for (size_t s = 0; s < segments.size(); s += 2) {
      if (segments[s + 1] == 0) continue;
      copies.push_back({staging + c * object_bytes + segments[s], addresses[c] + segments[s], segments[s + 1], 0});
    }
  }
  py::gil_scoped_release unlocked;  // the enqueue holds no Python object
  Check(lmcache_cuda_copy_ahead(stream, first, copied, copies.data(), copies.size()), "lmcache_cuda_copy_ahead");
}

uint64_t EventCreate(bool blocking) {
  uint64_t event = 0;
  Check(lmcache_cuda_event_create(&event, blocking ? 1 : 0), "cudaEventCreateWithFlags");
  return event;
}

float ElapsedMs(uint64_t begin, uint64_t end) {
  float ms = 0.0f;
  Check(lmcache_cuda_event_elapsed_ms(begin, end, &ms), "cudaEventElapsedTime");
  return ms;
}

// Byte offsets of the record's fields, so Python builds the same layout and checks it at import.
py::dict TransferFields() {
  py::dict fields;
#define LMCACHE_FIELD(name, member) fields[name] = offsetof(LmcacheCudaTransfer, member)
  LMCACHE_FIELD("stream", kernel.stream);
  LMCACHE_FIELD("planes", kernel.planes);
  LMCACHE_FIELD("groups", kernel.groups);
  LMCACHE_FIELD("runs", kernel.runs);
  LMCACHE_FIELD("objects", kernel.objects);
  LMCACHE_FIELD("host_objects", kernel.host_objects);
  LMCACHE_FIELD("items", kernel.items);
  LMCACHE_FIELD("slice_items", kernel.slice_items);
  LMCACHE_FIELD("slice_counters", kernel.slice_counters);
  LMCACHE_FIELD("slice_flags", kernel.slice_flags);
  LMCACHE_FIELD("status", kernel.status);
  LMCACHE_FIELD("num_items", kernel.num_items);
  LMCACHE_FIELD("num_planes", kernel.num_planes);
  LMCACHE_FIELD("num_groups", kernel.num_groups);
  LMCACHE_FIELD("num_runs", kernel.num_runs);
  LMCACHE_FIELD("num_chunks", kernel.num_chunks);
  LMCACHE_FIELD("kernel_direction", kernel.direction);
  LMCACHE_FIELD("blocks", kernel.blocks);
  LMCACHE_FIELD("threads", kernel.threads);
  LMCACHE_FIELD("num_slices", kernel.num_slices);
  LMCACHE_FIELD("epoch", kernel.epoch);
  LMCACHE_FIELD("pipeline", kernel.pipeline);
  LMCACHE_FIELD("copy_stream", copy_stream);
  LMCACHE_FIELD("table_host", table_host);
  LMCACHE_FIELD("table_device", table_device);
  LMCACHE_FIELD("table_bytes", table_bytes);
  LMCACHE_FIELD("zero_address", zero_address);
  LMCACHE_FIELD("zero_bytes", zero_bytes);
  LMCACHE_FIELD("copies", copies);
  LMCACHE_FIELD("num_copies", num_copies);
  LMCACHE_FIELD("direction", direction);
  LMCACHE_FIELD("status_host", status_host);
  LMCACHE_FIELD("events", events);
#undef LMCACHE_FIELD
  return fields;
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
  m.def("transfer", &Transfer, "enqueue a whole transfer (tables, zeroing, copies, kernel, events, status)",
        py::arg("transfer"), py::call_guard<py::gil_scoped_release>());
  m.def("sliced_load", &SlicedLoad, "enqueue a sliced load: per slice its copies, its kernel, its event",
        py::arg("transfer"), py::arg("slices"), py::call_guard<py::gil_scoped_release>());
  m.def("copy_ahead", &CopyAhead,
        "enqueue a sliced load's slice-0 copies between two events before the load is planned", py::arg("stream"),
        py::arg("first"), py::arg("copied"), py::arg("staging"), py::arg("object_bytes"), py::arg("addresses"),
        py::arg("segments"));
  m.def("event_create", &EventCreate, "a cudaEvent_t with timing, as an int; blocking: host waits sleep",
        py::arg("blocking") = false);
  m.attr("BLOCKING_EVENTS") = true;
  m.def(
      "event_destroy", [](uint64_t event) { Check(lmcache_cuda_event_destroy(event), "cudaEventDestroy"); },
      py::arg("event"));
  m.def(
      "event_synchronize", [](uint64_t event) { Check(lmcache_cuda_event_synchronize(event), "cudaEventSynchronize"); },
      py::arg("event"), py::call_guard<py::gil_scoped_release>());
  m.def("event_elapsed_ms", &ElapsedMs, py::arg("begin"), py::arg("end"));
  m.def(
      "event_query",
      [](uint64_t event) {
        const int done = lmcache_cuda_event_query(event);
        if (done < 0) throw std::runtime_error("cudaEventQuery: the event reported an error");
        return done == 1;
      },
      "True once the event's work is done", py::arg("event"));
  m.def(
      "stream_wait_event",
      [](uint64_t stream, uint64_t event) {
        Check(lmcache_cuda_stream_wait_event(stream, event), "cudaStreamWaitEvent");
      },
      "enqueue: the stream's later work waits for the event", py::arg("stream"), py::arg("event"));
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
  m.attr("COPY_BYTES") = sizeof(LmcacheCudaCopy);
  m.attr("TRANSFER_BYTES") = sizeof(LmcacheCudaTransfer);
  m.attr("SLICES_BYTES") = sizeof(LmcacheCudaSlices);
  m.attr("TRANSFER_FIELDS") = TransferFields();
  m.attr("EVENTS") = static_cast<int>(kLmcacheEventCount);
  m.attr("LAYOUT_VERSION") = lmcache_npu::kLayoutVersion;
}
