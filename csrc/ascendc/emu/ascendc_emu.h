// The AscendC API subset our kernels use, emulated on x86 (include instead of kernel_operator.h).
//
// Signatures and parameter widths follow the real headers (uint16_t blockCount, uint32_t
// LocalTensor offsets, ...) so narrowing happens exactly where it happens on device. Every
// call checks the rules the hardware does not report; see emu_runtime.h for the model.
#ifndef LMCACHE_NPU_ASCENDC_EMU_H_
#define LMCACHE_NPU_ASCENDC_EMU_H_

#include <deque>

#include "emu_runtime.h"

#define __global__
#define __aicore__
#define __gm__
#define __ubuf__
#define GM_ADDR uint8_t*
#define KERNEL_TASK_TYPE_DEFAULT(type)

typedef enum {
  PIPE_S = 0, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL, PIPE_MTE4 = 7, PIPE_MTE5 = 8,
  PIPE_V2 = 9, PIPE_FIX = 10
} pipe_t;

typedef enum { EVENT_ID0 = 0, EVENT_ID1, EVENT_ID2, EVENT_ID3, EVENT_ID4, EVENT_ID5, EVENT_ID6, EVENT_ID7 } event_t;

namespace AscendC {

enum class TPosition : uint8_t {
  GM, A1, A2, B1, B2, C1, C2, CO1, CO2, VECIN, VECOUT, VECCALC, LCM = VECCALC, SPM, SHM = SPM, TSCM,
  C2PIPE2GM, C2PIPE2LOCAL, MAX
};
using QuePosition = TPosition;

enum class HardEvent : uint8_t {
  MTE2_MTE1, MTE1_MTE2, MTE1_M, M_MTE1, MTE2_V, V_MTE2, MTE3_V, V_MTE3, M_V, V_M, V_V, MTE3_MTE1, MTE1_MTE3,
  MTE1_V, MTE2_M, M_MTE2, V_MTE1, M_FIX, FIX_M, MTE3_MTE2, MTE2_MTE3, S_V, V_S, S_MTE2, MTE2_S, S_MTE3, MTE3_S,
  MTE2_FIX, FIX_MTE2, FIX_S, M_S, FIX_MTE3, MTE1_FIX, FIX_MTE1, FIX_FIX, MAX
};

using TEventID = int8_t;

struct DataCopyParams {
  uint16_t blockCount = 1;
  uint16_t blockLen = 0;   // 32 B units
  uint16_t srcStride = 0;  // 32 B units, end of one block to start of the next
  uint16_t dstStride = 0;
  DataCopyParams() = default;
  DataCopyParams(uint16_t count, uint16_t len, uint16_t src_stride, uint16_t dst_stride)
      : blockCount(count), blockLen(len), srcStride(src_stride), dstStride(dst_stride) {}
};

struct DataCopyExtParams {
  uint16_t blockCount = 1;
  uint32_t blockLen = 0;   // bytes
  uint32_t srcStride = 0;  // GM->UB: bytes on GM; UB->GM: 32 B units on UB
  uint32_t dstStride = 0;  // GM->UB: 32 B units on UB; UB->GM: bytes on GM
  uint32_t rsv = 0;
  DataCopyExtParams() = default;
  DataCopyExtParams(uint16_t count, uint32_t len, uint32_t src_stride, uint32_t dst_stride, uint32_t rsv_in)
      : blockCount(count), blockLen(len), srcStride(src_stride), dstStride(dst_stride), rsv(rsv_in) {}
};

template <typename T>
struct DataCopyPadExtParams {
  bool isPad = false;
  uint8_t leftPadding = 0;
  uint8_t rightPadding = 0;
  T paddingValue = 0;
  DataCopyPadExtParams() = default;
  DataCopyPadExtParams(bool is_pad, uint8_t left, uint8_t right, T value)
      : isPad(is_pad), leftPadding(left), rightPadding(right), paddingValue(value) {}
};

}  // namespace AscendC

namespace emu {

// Source and destination pipes of each HardEvent we model (-1: pipe not modelled).
inline std::pair<int, int> EventPipes(AscendC::HardEvent e) {
  using H = AscendC::HardEvent;
  switch (e) {
    case H::MTE2_V: return {kMte2, kV};
    case H::V_MTE2: return {kV, kMte2};
    case H::MTE3_V: return {kMte3, kV};
    case H::V_MTE3: return {kV, kMte3};
    case H::V_V: return {kV, kV};
    case H::MTE3_MTE2: return {kMte3, kMte2};
    case H::MTE2_MTE3: return {kMte2, kMte3};
    case H::S_V: return {kS, kV};
    case H::V_S: return {kV, kS};
    case H::S_MTE2: return {kS, kMte2};
    case H::MTE2_S: return {kMte2, kS};
    case H::S_MTE3: return {kS, kMte3};
    case H::MTE3_S: return {kMte3, kS};
    default: return {-1, -1};
  }
}

inline std::pair<int, int> CheckedEventPipes(AscendC::HardEvent e, const char* api, const Site& site) {
  auto pipes = EventPipes(e);
  if (pipes.first < 0) Fail(rule::kEvent, api, site, "event between pipes an AIV kernel does not have");
  return pipes;
}

enum class BufState { kFree, kOccupied, kEnqueued, kDequeued };

struct QueBuffer {
  uint32_t offset = 0;
  uint32_t len = 0;
  BufState state = BufState::kFree;
  uint32_t generation = 0;
  bool in_queue = false;            // TBuf buffers are never freed
  AscendC::HardEvent enq_event{};   // EnQue sets / DeQue waits
  AscendC::HardEvent free_event{};  // FreeTensor sets / AllocTensor waits
  int enq_id = -1;
  int free_id = -1;
  bool free_pending = false;        // FreeTensor's flag not yet consumed by AllocTensor
  Site enqueued_at{"", 0};          // the last EnQue: named when the kernel ends with the tensor still queued
};

// The part of TPipe the LocalTensors need to validate themselves.
class TPipeState {
 public:
  std::vector<QueBuffer> buffers;
  uint32_t high_water = 0;
  std::array<uint32_t, static_cast<size_t>(AscendC::TPosition::MAX) + 1> per_position{};
  std::string end_error;  // raised by CheckKernelEnd (destructors must not throw)
  std::string end_error_rule;
};

inline int ReserveEventId(AscendC::HardEvent e, const char* api, const Site& site) {
  CoreCtx& c = *g_core;
  auto& ids = c.event_reserved[static_cast<size_t>(e)];
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!ids[i]) {
      ids[i] = true;
      return static_cast<int>(i);
    }
  }
  Fail(rule::kQueueBuffers, api, site,
       "all " + std::to_string(ids.size()) + " event ids of this HardEvent are taken by queue buffers");
}

inline uint32_t PipeAlloc(uint32_t len, const char* api, const Site& site) {
  CoreCtx& c = *g_core;
  if (c.pipe == nullptr) Fail(rule::kPipe, api, site, "no live TPipe");
  TPipeState& p = *c.pipe;
  if (static_cast<uint64_t>(p.high_water) + len > c.ub_bytes) {
    Fail(rule::kUbCapacity, api, site,
         "needs " + std::to_string(p.high_water + static_cast<uint64_t>(len)) + " B of UB > " +
             std::to_string(c.ub_bytes) + " B on " + c.spec->name);
  }
  const uint32_t at = p.high_water;
  p.high_water += len;
  c.stats.ub_high_water = std::max(c.stats.ub_high_water, p.high_water);
  return at;
}

}  // namespace emu

namespace AscendC {

__aicore__ inline int64_t GetBlockIdx() { return emu::Core("GetBlockIdx", {__FILE__, __LINE__}).idx; }
__aicore__ inline int64_t GetBlockNum() { return emu::Core("GetBlockNum", {__FILE__, __LINE__}).num; }

// ----------------------------------------------------------------------------- tensors

template <typename T>
class LocalTensor {
 public:
  using PrimType = T;
  LocalTensor() = default;
  LocalTensor(uint32_t offset, uint32_t len, int buf, uint32_t gen, TPosition pos)
      : offset_(offset), len_(len), buf_(buf), gen_(gen), pos_(pos) {}

  // operator[] cannot take a call site; a slice past the end is reported where it is used.
  LocalTensor operator[](const uint32_t offset) const {
    const uint64_t bytes = static_cast<uint64_t>(offset) * sizeof(T);
    LocalTensor t(offset_ + static_cast<uint32_t>(bytes), bytes < len_ ? len_ - static_cast<uint32_t>(bytes) : 0,
                  buf_, gen_, pos_);
    t.bad_slice_ = bad_slice_ || bytes >= len_;
    return t;
  }

  T GetValue(const uint32_t index, EMU_SITE) const {
    EMU_BIND_SITE;
    const uint32_t at = CheckScalar(index, "LocalTensor::GetValue", site);
    emu::UbAccess(emu::kS, at, sizeof(T), 0, 0, "LocalTensor::GetValue", site);
    T v;
    std::memcpy(&v, emu::g_core->ub.data() + at, sizeof(T));
    return v;
  }

  template <typename U>
  void SetValue(const uint32_t index, const U value, EMU_SITE) const {
    EMU_BIND_SITE;
    const uint32_t at = CheckScalar(index, "LocalTensor::SetValue", site);
    emu::UbAccess(emu::kS, 0, 0, at, sizeof(T), "LocalTensor::SetValue", site);
    const T v = static_cast<T>(value);
    std::memcpy(emu::g_core->ub.data() + at, &v, sizeof(T));
  }

  template <typename U>
  LocalTensor<U> ReinterpretCast() const {
    LocalTensor<U> t(offset_, len_, buf_, gen_, pos_);
    t.bad_slice_ = bad_slice_;
    return t;
  }

  uint32_t GetSize() const { return len_ / sizeof(T); }
  TPosition GetPosition() const { return pos_; }

  // Emulator internals: validated byte range of this tensor.
  uint32_t EmuOffset() const { return offset_; }
  uint32_t EmuBytes() const { return len_; }
  int EmuBuffer() const { return buf_; }
  uint32_t EmuGeneration() const { return gen_; }

  void EmuCheckLive(const char* api, const emu::Site& site) const {
    emu::CoreCtx& c = emu::Core(api, site);
    if (bad_slice_) {
      emu::Fail(emu::rule::kUbBounds, api, site, "LocalTensor was sliced with operator[] at or past its end");
    }
    if (buf_ < 0) {
      if (len_ == 0) emu::Fail(emu::rule::kUbBounds, api, site, "LocalTensor was never allocated");
      return;
    }
    if (c.pipe == nullptr) emu::Fail(emu::rule::kUseAfterFree, api, site, "LocalTensor used after its TPipe ended");
    const emu::QueBuffer& b = c.pipe->buffers[static_cast<size_t>(buf_)];
    if (b.generation != gen_ || (b.in_queue && b.state == emu::BufState::kFree)) {
      emu::Fail(emu::rule::kUseAfterFree, api, site,
                "LocalTensor at UB offset " + std::to_string(offset_) + " used after FreeTensor");
    }
  }

 private:
  uint32_t CheckScalar(uint32_t index, const char* api, const emu::Site& site) const {
    EmuCheckLive(api, site);
    if (static_cast<uint64_t>(index + 1) * sizeof(T) > len_) {
      emu::Fail(emu::rule::kUbBounds, api, site, "index " + std::to_string(index) + " outside the tensor");
    }
    return offset_ + index * static_cast<uint32_t>(sizeof(T));
  }

  uint32_t offset_ = 0;
  uint32_t len_ = 0;
  int buf_ = -1;
  uint32_t gen_ = 0;
  TPosition pos_ = TPosition::VECCALC;
  bool bad_slice_ = false;

  template <typename U>
  friend class LocalTensor;
};

namespace emu_detail {
constexpr uint64_t kUnbounded = ~uint64_t{0};  // a GlobalTensor bound without a size

// A GlobalTensor bound with a size is the buffer it names: an access past it is a named error even where the bytes
// belong to another registered buffer (another plane, another chunk object).
inline void CheckTensorSpan(uint64_t bound, uint64_t bytes, const char* api, const ::emu::Site& site) {
  if (bytes > bound) {
    ::emu::Fail(::emu::rule::kGmTensorBounds, api, site,
                "touches " + std::to_string(bytes) + " B from its start, but the GlobalTensor was bound to " +
                    std::to_string(bound) + " B (SetGlobalBuffer size, less any offset)");
  }
}
}  // namespace emu_detail

template <typename T>
class GlobalTensor {
 public:
  using PrimType = T;
  void SetGlobalBuffer(__gm__ T* buffer, uint64_t buffer_size, EMU_SITE) {
    EMU_BIND_SITE;
    emu::CheckGm(buffer, buffer_size == 0 ? 1 : buffer_size * sizeof(T), false, "GlobalTensor::SetGlobalBuffer",
                 site);
    ptr_ = buffer;
    size_ = buffer_size;
    bounded_ = true;
  }
  void SetGlobalBuffer(__gm__ T* buffer, EMU_SITE) {
    EMU_BIND_SITE;
    emu::CheckGm(buffer, 1, false, "GlobalTensor::SetGlobalBuffer", site);
    ptr_ = buffer;
    size_ = 0;
    bounded_ = false;
  }
  GlobalTensor operator[](const uint64_t offset) const {
    GlobalTensor t;
    t.ptr_ = ptr_ + offset;
    t.size_ = size_ > offset ? size_ - offset : 0;
    t.bounded_ = bounded_;
    return t;
  }
  uint64_t EmuBound() const { return bounded_ ? size_ * sizeof(T) : emu_detail::kUnbounded; }
  void EmuCheckSpan(uint64_t bytes, const char* api, const emu::Site& site) const {
    emu_detail::CheckTensorSpan(EmuBound(), bytes, api, site);
  }
  T GetValue(const uint64_t offset, EMU_SITE) const {
    EMU_BIND_SITE;
    EmuCheckSpan((offset + 1) * sizeof(T), "GlobalTensor::GetValue", site);
    emu::CheckGm(ptr_ + offset, sizeof(T), false, "GlobalTensor::GetValue", site, emu::kS);
    ++emu::g_core->stats.scalar_gm_reads;
    T v;
    std::memcpy(&v, ptr_ + offset, sizeof(T));
    return v;
  }
  void SetValue(const uint64_t offset, T value, EMU_SITE) {
    EMU_BIND_SITE;
    EmuCheckSpan((offset + 1) * sizeof(T), "GlobalTensor::SetValue", site);
    // Scalar writes go through the 64 B DCache line: record the whole line as written.
    const uintptr_t addr = reinterpret_cast<uintptr_t>(ptr_ + offset);
    emu::CheckGm(ptr_ + offset, sizeof(T), true, "GlobalTensor::SetValue", site, emu::kS);
    emu::g_launch->writes.back().begin = addr & ~uintptr_t{63};
    emu::g_launch->writes.back().end = (addr + sizeof(T) + 63) & ~uintptr_t{63};
    ++emu::g_core->stats.scalar_gm_writes;
    std::memcpy(ptr_ + offset, &value, sizeof(T));
  }
  uint64_t GetSize() const { return size_; }
  __gm__ T* GetPhyAddr() const { return ptr_; }
  __gm__ T* GetPhyAddr(uint64_t offset) const { return ptr_ + offset; }

 private:
  __gm__ T* ptr_ = nullptr;
  uint64_t size_ = 0;
  bool bounded_ = false;  // SetGlobalBuffer with a size
};

// ----------------------------------------------------------------------------- pipe and queues

template <TPosition pos>
class TBuf;

class TPipe : public emu::TPipeState {
 public:
  TPipe(EMU_SITE) {
    EMU_BIND_SITE;
    emu::CoreCtx& c = emu::Core("TPipe::TPipe", site);
    if (c.pipe != nullptr) emu::Fail(emu::rule::kPipe, "TPipe::TPipe", site, "a second TPipe while one is alive");
    c.pipe = this;
  }
  ~TPipe() { Destroy(); }
  TPipe(const TPipe&) = delete;
  TPipe& operator=(const TPipe&) = delete;

  template <class Q>
  bool InitBuffer(Q& que, uint8_t num, uint32_t len, EMU_SITE) {
    EMU_BIND_SITE;
    const char* api = "TPipe::InitBuffer";
    emu::CoreCtx& c = emu::Core(api, site);
    len = (len + 31) / 32 * 32;
    if (num < 1) emu::Fail(emu::rule::kQueueBuffers, api, site, "num must be at least 1");
    if (len == 0) emu::Fail(emu::rule::kUbCapacity, api, site, "buffer length 0");
    auto& count = per_position[static_cast<size_t>(Q::kEmuBufferPosition)];
    if (count + num > c.spec->max_que_buf_per_pos) {
      emu::Fail(emu::rule::kQueueBuffers, api, site,
                std::to_string(count + num) + " queue buffers in one TPosition; " + c.spec->name + " allows " +
                    std::to_string(c.spec->max_que_buf_per_pos));
    }
    if (buffers.size() + num > c.spec->max_pipe_buffers) {
      emu::Fail(emu::rule::kQueueBuffers, api, site, "more than " + std::to_string(c.spec->max_pipe_buffers) +
                                                         " buffers in one TPipe");
    }
    count += num;
    const uint32_t base = emu::PipeAlloc(static_cast<uint32_t>(num) * len, api, site);
    for (uint8_t i = 0; i < num; ++i) {
      emu::QueBuffer b;
      b.offset = base + i * len;
      b.len = len;
      b.in_queue = true;
      b.enq_event = Q::kEmuEnqueEvent;
      b.free_event = Q::kEmuFreeEvent;
      b.enq_id = emu::ReserveEventId(b.enq_event, api, site);
      b.free_id = emu::ReserveEventId(b.free_event, api, site);
      que.EmuAttach(static_cast<int>(buffers.size()));
      buffers.push_back(b);
    }
    return true;
  }

  template <TPosition pos>
  bool InitBuffer(TBuf<pos>& buf, uint32_t len, EMU_SITE);

  template <HardEvent evt>
  TEventID FetchEventID(EMU_SITE) {
    EMU_BIND_SITE;
    emu::CoreCtx& c = emu::Core("TPipe::FetchEventID", site);
    // Like the hardware: the first id no AllocEventID holds, whether or not its flag is set; two fetched ids in
    // flight are one id, and the second SetFlag trips "set twice" instead of hiding a real hang
    const auto& reserved = c.event_reserved[static_cast<size_t>(evt)];
    for (size_t i = 0; i < reserved.size(); ++i) {
      if (!reserved[i]) return static_cast<TEventID>(i);
    }
    emu::Fail(emu::rule::kEvent, "TPipe::FetchEventID", site, "no free event id for this HardEvent");
  }
  template <HardEvent evt>
  TEventID AllocEventID(EMU_SITE) {
    EMU_BIND_SITE;
    emu::CoreCtx& c = emu::Core("TPipe::AllocEventID", site);
    const TEventID id = FetchEventID<evt>(site.file, site.line);
    c.event_reserved[static_cast<size_t>(evt)][static_cast<size_t>(id)] = true;
    return id;
  }
  template <HardEvent evt>
  void ReleaseEventID(TEventID id, EMU_SITE) {
    EMU_BIND_SITE;
    emu::CoreCtx& c = emu::Core("TPipe::ReleaseEventID", site);
    c.event_reserved[static_cast<size_t>(evt)][static_cast<size_t>(id)] = false;
  }

  void Destroy() {
    emu::CoreCtx* c = emu::g_core;
    if (c == nullptr || c->pipe != this) return;
    // The real TPipe waits for the queues' outstanding flags when it ends.
    for (emu::QueBuffer& b : buffers) {
      if (!b.in_queue) continue;
      if (b.state == emu::BufState::kEnqueued && end_error.empty()) {
        end_error = std::string("kernel ended with a tensor still enqueued (missing DeQue/FreeTensor); it was "
                                "enqueued at ") + b.enqueued_at.file + ":" + std::to_string(b.enqueued_at.line);
        end_error_rule = emu::rule::kQueueState;
      }
      if (b.free_pending) {
        auto& slot = c->events[static_cast<size_t>(b.free_event)][static_cast<size_t>(b.free_id)];
        slot.set = false;
        b.free_pending = false;
      }
      c->event_reserved[static_cast<size_t>(b.enq_event)][static_cast<size_t>(b.enq_id)] = false;
      c->event_reserved[static_cast<size_t>(b.free_event)][static_cast<size_t>(b.free_id)] = false;
    }
    if (!end_error.empty()) {
      c->pending_end_error = end_error;
      c->pending_end_rule = end_error_rule;
    }
    c->pipe = nullptr;
  }
};

inline TPipe* GetTPipePtr() { return static_cast<TPipe*>(emu::g_core->pipe); }

template <TPosition src, TPosition dst, int32_t depth, auto mask = 0>
class TQueBind {
 public:
  // Position whose buffer budget the queue draws from, and the events its hidden sync uses.
  static constexpr TPosition kEmuBufferPosition = src == TPosition::GM ? dst : src;
  static constexpr HardEvent kEmuEnqueEvent =
      src == TPosition::GM ? HardEvent::MTE2_V : (dst == TPosition::GM ? HardEvent::V_MTE3 : HardEvent::MTE2_MTE3);
  static constexpr HardEvent kEmuFreeEvent =
      src == TPosition::GM ? HardEvent::V_MTE2 : (dst == TPosition::GM ? HardEvent::MTE3_V : HardEvent::MTE3_MTE2);

  void EmuAttach(int buffer) { buffers_.push_back(buffer); }

  template <typename T>
  LocalTensor<T> AllocTensor(EMU_SITE) {
    EMU_BIND_SITE;
    const char* api = "TQueBind::AllocTensor";
    emu::CoreCtx& c = emu::Core(api, site);
    if (buffers_.empty()) emu::Fail(emu::rule::kQueueBuffers, api, site, "queue has no buffers (InitBuffer missing)");
    for (size_t k = 0; k < buffers_.size(); ++k) {
      const size_t slot = (cursor_ + k) % buffers_.size();
      emu::QueBuffer& b = c.pipe->buffers[static_cast<size_t>(buffers_[slot])];
      if (b.state != emu::BufState::kFree) continue;
      cursor_ = (slot + 1) % buffers_.size();
      if (b.free_pending) {
        const auto pipes = emu::EventPipes(b.free_event);
        emu::WaitEvent(static_cast<int>(b.free_event), pipes.second, b.free_id, api, site);
        b.free_pending = false;
      }
      b.state = emu::BufState::kOccupied;
      emu::UbPoison(b.offset, b.len);
      return LocalTensor<T>(b.offset, b.len, buffers_[slot], b.generation, kEmuBufferPosition);
    }
    emu::Fail(emu::rule::kQueueBuffers, api, site,
              "all " + std::to_string(buffers_.size()) +
                  " buffers of the queue are in use: the core would hang on NPU (missing FreeTensor?)");
  }

  template <typename T>
  bool EnQue(const LocalTensor<T>& t, EMU_SITE) {
    EMU_BIND_SITE;
    const char* api = "TQueBind::EnQue";
    emu::QueBuffer& b = Own(t, api, site);
    if (b.state != emu::BufState::kOccupied && b.state != emu::BufState::kDequeued) {
      emu::Fail(emu::rule::kQueueState, api, site, "EnQue of a tensor that is already enqueued");
    }
    if (static_cast<int32_t>(fifo_.size()) >= depth) {
      emu::Fail(emu::rule::kQueueDepth, api, site,
                "EnQue with " + std::to_string(fifo_.size()) + " tensors already queued; depth is " +
                    std::to_string(depth));
    }
    const auto pipes = emu::EventPipes(b.enq_event);
    emu::SetEvent(static_cast<int>(b.enq_event), pipes.first, b.enq_id, api, site);
    b.state = emu::BufState::kEnqueued;
    b.enqueued_at = site;
    fifo_.push_back(t.EmuBuffer());
    return true;
  }

  template <typename T>
  LocalTensor<T> DeQue(EMU_SITE) {
    EMU_BIND_SITE;
    const char* api = "TQueBind::DeQue";
    emu::CoreCtx& c = emu::Core(api, site);
    if (fifo_.empty()) emu::Fail(emu::rule::kQueueState, api, site, "DeQue on an empty queue: the core would hang");
    const int id = fifo_.front();
    fifo_.pop_front();
    emu::QueBuffer& b = c.pipe->buffers[static_cast<size_t>(id)];
    const auto pipes = emu::EventPipes(b.enq_event);
    emu::WaitEvent(static_cast<int>(b.enq_event), pipes.second, b.enq_id, api, site);
    b.state = emu::BufState::kDequeued;
    return LocalTensor<T>(b.offset, b.len, id, b.generation, kEmuBufferPosition);
  }

  template <typename T>
  void FreeTensor(LocalTensor<T>& t, EMU_SITE) {
    EMU_BIND_SITE;
    const char* api = "TQueBind::FreeTensor";
    emu::QueBuffer& b = Own(t, api, site);
    if (b.state == emu::BufState::kEnqueued) {
      emu::Fail(emu::rule::kQueueState, api, site, "FreeTensor of a tensor that is still enqueued");
    }
    const auto pipes = emu::EventPipes(b.free_event);
    emu::SetEvent(static_cast<int>(b.free_event), pipes.first, b.free_id, api, site);
    b.free_pending = true;
    b.state = emu::BufState::kFree;
    ++b.generation;
  }

  int32_t GetTensorCountInQue() const { return static_cast<int32_t>(fifo_.size()); }
  bool HasTensorInQue() const { return !fifo_.empty(); }

 private:
  template <typename T>
  emu::QueBuffer& Own(const LocalTensor<T>& t, const char* api, const emu::Site& site) {
    t.EmuCheckLive(api, site);
    if (std::find(buffers_.begin(), buffers_.end(), t.EmuBuffer()) == buffers_.end()) {
      emu::Fail(emu::rule::kQueueState, api, site, "tensor does not belong to this queue");
    }
    return emu::g_core->pipe->buffers[static_cast<size_t>(t.EmuBuffer())];
  }

  std::vector<int> buffers_;
  size_t cursor_ = 0;
  std::deque<int> fifo_;
};

template <TPosition pos, int32_t depth, auto mask = 0>
class TQue : public TQueBind<(pos == TPosition::VECIN ? TPosition::GM : pos),
                             (pos == TPosition::VECIN ? TPosition::VECIN : TPosition::GM), depth, mask> {};

template <TPosition pos = TPosition::VECCALC>
class TBuf {
 public:
  template <typename T>
  LocalTensor<T> Get(EMU_SITE) const {
    EMU_BIND_SITE;
    if (buffer_ < 0) emu::Fail(emu::rule::kUbBounds, "TBuf::Get", site, "TBuf used before InitBuffer");
    const emu::QueBuffer& b = emu::g_core->pipe->buffers[static_cast<size_t>(buffer_)];
    return LocalTensor<T>(b.offset, b.len, buffer_, b.generation, pos);
  }
  template <typename T>
  LocalTensor<T> Get(uint32_t len, EMU_SITE) const {
    EMU_BIND_SITE;
    return GetWithOffset<T>(len, 0, site.file, site.line);
  }
  template <typename T>
  LocalTensor<T> GetWithOffset(uint32_t size, uint32_t offset_bytes, EMU_SITE) const {
    EMU_BIND_SITE;
    if (buffer_ < 0) emu::Fail(emu::rule::kUbBounds, "TBuf::GetWithOffset", site, "TBuf used before InitBuffer");
    const emu::QueBuffer& b = emu::g_core->pipe->buffers[static_cast<size_t>(buffer_)];
    if (offset_bytes % 32 != 0) {
      emu::Fail(emu::rule::kUbAlign, "TBuf::GetWithOffset", site,
                "offset " + std::to_string(offset_bytes) + " B is not 32 B aligned");
    }
    if (static_cast<uint64_t>(size) * sizeof(T) + offset_bytes > b.len) {
      emu::Fail(emu::rule::kUbBounds, "TBuf::GetWithOffset", site, "slice exceeds the buffer");
    }
    return LocalTensor<T>(b.offset + offset_bytes, size * static_cast<uint32_t>(sizeof(T)), buffer_, b.generation,
                          pos);
  }
  void EmuAttach(int buffer) { buffer_ = buffer; }

 private:
  int buffer_ = -1;
};

template <TPosition pos>
bool TPipe::InitBuffer(TBuf<pos>& buf, uint32_t len, const char* emu_file, int emu_line) {
  EMU_BIND_SITE;
  const char* api = "TPipe::InitBuffer(TBuf)";
  emu::CoreCtx& c = emu::Core(api, site);
  len = (len + 31) / 32 * 32;
  if (len == 0) emu::Fail(emu::rule::kUbCapacity, api, site, "buffer length 0");
  if (buffers.size() + 1 > c.spec->max_pipe_buffers) {
    emu::Fail(emu::rule::kQueueBuffers, api, site, "more than " + std::to_string(c.spec->max_pipe_buffers) +
                                                       " buffers in one TPipe");
  }
  emu::QueBuffer b;
  b.offset = emu::PipeAlloc(len, api, site);
  b.len = len;
  b.state = emu::BufState::kOccupied;
  buf.EmuAttach(static_cast<int>(buffers.size()));
  buffers.push_back(b);
  emu::UbPoison(b.offset, b.len);
  return true;
}

// ----------------------------------------------------------------------------- synchronisation

template <HardEvent evt>
__aicore__ inline void SetFlag(int32_t event_id, EMU_SITE) {
    EMU_BIND_SITE;
  emu::Core("SetFlag", site);
  const auto pipes = emu::CheckedEventPipes(evt, "SetFlag", site);
  emu::SetEvent(static_cast<int>(evt), pipes.first, event_id, "SetFlag", site);
}

template <HardEvent evt>
__aicore__ inline void WaitFlag(int32_t event_id, EMU_SITE) {
    EMU_BIND_SITE;
  emu::Core("WaitFlag", site);
  const auto pipes = emu::CheckedEventPipes(evt, "WaitFlag", site);
  emu::WaitEvent(static_cast<int>(evt), pipes.second, event_id, "WaitFlag", site);
}

template <pipe_t pipe>
__aicore__ inline void PipeBarrier(EMU_SITE) {
    EMU_BIND_SITE;
  emu::Core("PipeBarrier", site);
  static_assert(pipe != PIPE_S, "PipeBarrier<PIPE_S> is not allowed: the scalar pipe is ordered by itself");
  if constexpr (pipe == PIPE_ALL) {
    emu::Barrier(-1);
  } else if constexpr (pipe == PIPE_V) {
    emu::Barrier(emu::kV);
  } else if constexpr (pipe == PIPE_MTE2) {
    emu::Barrier(emu::kMte2);
  } else if constexpr (pipe == PIPE_MTE3) {
    emu::Barrier(emu::kMte3);
  } else {
    emu::Fail(emu::rule::kEvent, "PipeBarrier", site, "barrier on a pipe an AIV kernel does not have");
  }
}

__aicore__ inline void SetAtomicNone(EMU_SITE) {
    EMU_BIND_SITE;
  emu::Core("SetAtomicNone", site).atomic_add = false;
}

// ----------------------------------------------------------------------------- data movement

namespace emu_detail {

inline void CheckUbDma(uint32_t ub_offset, uint64_t footprint, const LocalTensor<uint8_t>& t, const char* api,
                       const emu::Site& site) {
  t.EmuCheckLive(api, site);
  if (ub_offset % 32 != 0) {
    emu::Fail(emu::rule::kUbAlign, api, site,
              "UB address " + std::to_string(ub_offset) + " is not 32 B aligned");
  }
  if (footprint > t.EmuBytes()) {
    emu::Fail(emu::rule::kUbBounds, api, site,
              "UB footprint " + std::to_string(footprint) + " B exceeds the tensor's " +
                  std::to_string(t.EmuBytes()) + " B");
  }
}

// An MTE3 write: overwrites GM, or adds to it while a previous kernel's atomic add is still on (bytes as uint8).
inline void WriteGm(uint8_t* gm, const uint8_t* ub, uint64_t len) {
  if (!emu::g_core->atomic_add) {
    std::memcpy(gm, ub, len);
    return;
  }
  for (uint64_t i = 0; i < len; ++i) gm[i] = static_cast<uint8_t>(gm[i] + ub[i]);
}

inline void CountDma(int pipe, uint64_t bytes) {
  emu::CoreStats& s = emu::g_core->stats;
  if (pipe == emu::kMte2) {
    ++s.mte2_ops;
    s.mte2_bytes += bytes;
  } else {
    ++s.mte3_ops;
    s.mte3_bytes += bytes;
  }
}

// Strided block copy in 32 B units (DataCopy with DataCopyParams, and the count form); `gm_bound`: the bytes the
// GM side's GlobalTensor was bound to.
inline void BlockCopy(bool to_ub, uint8_t* gm, uint64_t gm_bound, const LocalTensor<uint8_t>& ub,
                      const DataCopyParams& p, const char* api, const emu::Site& site) {
  if (p.blockCount < 1 || p.blockCount > 4095) {
    emu::Fail(emu::rule::kDataCopyParams, api, site,
              "blockCount " + std::to_string(p.blockCount) + " outside [1, 4095]");
  }
  if (p.blockLen < 1) emu::Fail(emu::rule::kDataCopyParams, api, site, "blockLen 0 (32 B units)");
  const uint64_t len = static_cast<uint64_t>(p.blockLen) * 32;
  const uint64_t gm_pitch = (static_cast<uint64_t>(p.blockLen) + (to_ub ? p.srcStride : p.dstStride)) * 32;
  const uint64_t ub_pitch = (static_cast<uint64_t>(p.blockLen) + (to_ub ? p.dstStride : p.srcStride)) * 32;
  const uint64_t ub_span = ub_pitch * (p.blockCount - 1) + len;
  CheckUbDma(ub.EmuOffset(), ub_span, ub, api, site);
  CheckTensorSpan(gm_bound, gm_pitch * (p.blockCount - 1) + len, api, site);
  const int pipe = to_ub ? emu::kMte2 : emu::kMte3;
  for (uint16_t k = 0; k < p.blockCount; ++k) {
    emu::CheckGm(gm + k * gm_pitch, len, !to_ub, api, site, to_ub ? emu::kMte2 : emu::kMte3);
  }
  for (uint16_t k = 0; k < p.blockCount; ++k) {
    const uint32_t u = ub.EmuOffset() + static_cast<uint32_t>(k * ub_pitch);
    if (to_ub) {
      emu::UbAccess(pipe, 0, 0, u, static_cast<uint32_t>(len), api, site);
      std::memcpy(emu::g_core->ub.data() + u, gm + k * gm_pitch, len);
    } else {
      emu::UbAccess(pipe, u, static_cast<uint32_t>(len), 0, 0, api, site);
      WriteGm(gm + k * gm_pitch, emu::g_core->ub.data() + u, len);
    }
  }
  CountDma(pipe, len * p.blockCount);
}

}  // namespace emu_detail

namespace emu_detail {

// The count form: one contiguous block of count * sizeof(T) bytes, which must be whole 32 B units.
inline void CountCopy(bool to_ub, uint8_t* gm, uint64_t gm_bound, const LocalTensor<uint8_t>& ub, uint64_t bytes,
                      const char* api, const emu::Site& site) {
  emu::Core(api, site);
  if (bytes == 0 || bytes % 32 != 0) {
    emu::Fail(emu::rule::kDataCopyLen, api, site,
              std::to_string(bytes) + " B is not a positive multiple of 32 (the NPU silently rounds down to " +
                  std::to_string(bytes / 32 * 32) + " B)");
  }
  if (bytes / 32 > 65535) emu::Fail(emu::rule::kDataCopyParams, api, site, "more than 65535 x 32 B in one DataCopy");
  BlockCopy(to_ub, gm, gm_bound, ub, DataCopyParams(1, static_cast<uint16_t>(bytes / 32), 0, 0), api, site);
}

}  // namespace emu_detail

template <typename T>
__aicore__ inline void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const uint32_t count,
                                EMU_SITE) {
  EMU_BIND_SITE;
  emu_detail::CountCopy(true, reinterpret_cast<uint8_t*>(src.GetPhyAddr()), src.EmuBound(),
                        dst.template ReinterpretCast<uint8_t>(),
                        static_cast<uint64_t>(count) * sizeof(T), "DataCopy(GM->UB)", site);
}

template <typename T>
__aicore__ inline void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const uint32_t count,
                                EMU_SITE) {
  EMU_BIND_SITE;
  emu_detail::CountCopy(false, reinterpret_cast<uint8_t*>(dst.GetPhyAddr()), dst.EmuBound(),
                        src.template ReinterpretCast<uint8_t>(),
                        static_cast<uint64_t>(count) * sizeof(T), "DataCopy(UB->GM)", site);
}

template <typename T>
__aicore__ inline void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyParams& params,
                                EMU_SITE) {
    EMU_BIND_SITE;
  emu::Core("DataCopy", site);
  emu_detail::BlockCopy(true, reinterpret_cast<uint8_t*>(src.GetPhyAddr()), src.EmuBound(),
                        dst.template ReinterpretCast<uint8_t>(),
                        params, "DataCopy(GM->UB, params)", site);
}

template <typename T>
__aicore__ inline void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyParams& params,
                                EMU_SITE) {
    EMU_BIND_SITE;
  emu::Core("DataCopy", site);
  emu_detail::BlockCopy(false, reinterpret_cast<uint8_t*>(dst.GetPhyAddr()), dst.EmuBound(),
                        src.template ReinterpretCast<uint8_t>(),
                        params, "DataCopy(UB->GM, params)", site);
}

namespace emu_detail {

inline void CheckPad(const DataCopyExtParams& p, size_t elem, const char* api, const emu::Site& site) {
  emu::CoreCtx& c = emu::Core(api, site);
  if (!c.spec->has_datacopy_pad) {
    emu::Fail(emu::rule::kPadUnsupported, api, site,
              std::string("DataCopyPad does not exist on ") + c.spec->name +
                  " (it compiles with a deprecation warning and silently does nothing on the device)");
  }
  if (p.blockCount > 4095) {
    emu::Fail(emu::rule::kPadLimits, api, site, "blockCount " + std::to_string(p.blockCount) + " > 4095");
  }
  if (p.blockLen > 2097151) {
    emu::Fail(emu::rule::kPadLimits, api, site, "blockLen " + std::to_string(p.blockLen) + " B > 2097151");
  }
  if (p.blockLen % elem != 0) {
    emu::Fail(emu::rule::kPadLimits, api, site, "blockLen is not a multiple of the element size");
  }
}

}  // namespace emu_detail

template <typename T>
__aicore__ inline void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src,
                                   const DataCopyExtParams& p, const DataCopyPadExtParams<T>& pad, EMU_SITE) {
    EMU_BIND_SITE;
  const char* api = "DataCopyPad(GM->UB)";
  emu_detail::CheckPad(p, sizeof(T), api, site);
  if ((pad.leftPadding + pad.rightPadding) * sizeof(T) > 64 || pad.leftPadding * sizeof(T) > 32 ||
      pad.rightPadding * sizeof(T) > 32) {
    emu::Fail(emu::rule::kPadLimits, api, site, "left/right padding above 32 B");
  }
  if (p.blockCount == 0 || p.blockLen == 0) return;
  const uint64_t lp = pad.leftPadding * sizeof(T), rp = pad.rightPadding * sizeof(T);
  const uint64_t footprint = (lp + p.blockLen + rp + 31) / 32 * 32;
  const uint64_t ub_pitch = footprint + static_cast<uint64_t>(p.dstStride) * 32;
  const uint64_t gm_pitch = static_cast<uint64_t>(p.blockLen) + p.srcStride;
  src.EmuCheckSpan(gm_pitch * (p.blockCount - 1) + p.blockLen, api, site);
  LocalTensor<uint8_t> ub = dst.template ReinterpretCast<uint8_t>();
  emu_detail::CheckUbDma(ub.EmuOffset(), ub_pitch * (p.blockCount - 1) + footprint, ub, api, site);
  uint8_t* gm = reinterpret_cast<uint8_t*>(src.GetPhyAddr());
  for (uint16_t k = 0; k < p.blockCount; ++k) emu::CheckGm(gm + k * gm_pitch, p.blockLen, false, api, site, emu::kMte2);
  for (uint16_t k = 0; k < p.blockCount; ++k) {
    const uint32_t u = ub.EmuOffset() + static_cast<uint32_t>(k * ub_pitch);
    emu::UbAccess(emu::kMte2, 0, 0, u, static_cast<uint32_t>(footprint), api, site);
    uint8_t* dst_bytes = emu::g_core->ub.data() + u;
    std::memset(dst_bytes, 0xEE, footprint);  // pad and dummy bytes carry no data a kernel may rely on
    std::memcpy(dst_bytes + lp, gm + k * gm_pitch, p.blockLen);
  }
  emu_detail::CountDma(emu::kMte2, static_cast<uint64_t>(p.blockLen) * p.blockCount);
}

template <typename T>
__aicore__ inline void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src,
                                   const DataCopyExtParams& p, EMU_SITE) {
    EMU_BIND_SITE;
  const char* api = "DataCopyPad(UB->GM)";
  emu_detail::CheckPad(p, sizeof(T), api, site);
  if (p.blockCount == 0 || p.blockLen == 0) return;
  const uint64_t footprint = (static_cast<uint64_t>(p.blockLen) + 31) / 32 * 32;
  const uint64_t ub_pitch = footprint + static_cast<uint64_t>(p.srcStride) * 32;
  const uint64_t gm_pitch = static_cast<uint64_t>(p.blockLen) + p.dstStride;
  dst.EmuCheckSpan(gm_pitch * (p.blockCount - 1) + p.blockLen, api, site);
  LocalTensor<uint8_t> ub = src.template ReinterpretCast<uint8_t>();
  emu_detail::CheckUbDma(ub.EmuOffset(), ub_pitch * (p.blockCount - 1) + footprint, ub, api, site);
  uint8_t* gm = reinterpret_cast<uint8_t*>(dst.GetPhyAddr());
  for (uint16_t k = 0; k < p.blockCount; ++k) emu::CheckGm(gm + k * gm_pitch, p.blockLen, true, api, site, emu::kMte3);
  for (uint16_t k = 0; k < p.blockCount; ++k) {
    const uint32_t u = ub.EmuOffset() + static_cast<uint32_t>(k * ub_pitch);
    emu::UbAccess(emu::kMte3, u, p.blockLen, 0, 0, api, site);
    emu_detail::WriteGm(gm + k * gm_pitch, emu::g_core->ub.data() + u, p.blockLen);
  }
  emu_detail::CountDma(emu::kMte3, static_cast<uint64_t>(p.blockLen) * p.blockCount);
}

// ----------------------------------------------------------------------------- vector

template <typename T>
__aicore__ inline void Duplicate(const LocalTensor<T>& dst, const T& scalar, const int32_t count, EMU_SITE) {
    EMU_BIND_SITE;
  const char* api = "Duplicate";
  emu::CoreCtx& c = emu::Core(api, site);
  dst.EmuCheckLive(api, site);
  const uint64_t bytes = static_cast<uint64_t>(count) * sizeof(T);
  if (count <= 0 || bytes > dst.EmuBytes()) {
    emu::Fail(emu::rule::kUbBounds, api, site, "count " + std::to_string(count) + " outside the tensor");
  }
  if (dst.EmuOffset() % 32 != 0) emu::Fail(emu::rule::kUbAlign, api, site, "UB address not 32 B aligned");
  emu::UbAccess(emu::kV, 0, 0, dst.EmuOffset(), static_cast<uint32_t>(bytes), api, site);
  for (int32_t i = 0; i < count; ++i) std::memcpy(c.ub.data() + dst.EmuOffset() + i * sizeof(T), &scalar, sizeof(T));
  ++c.stats.vector_ops;
}

}  // namespace AscendC

namespace emu {

inline void CheckKernelEnd(CoreCtx& c) {
  const Site site{"<kernel end>", 0};  // pending end errors come from the TPipe's destructor
  if (c.pipe != nullptr) c.pipe = nullptr;
  if (!c.pending_end_error.empty()) Fail(c.pending_end_rule.c_str(), "kernel end", site, c.pending_end_error);
  for (size_t e = 0; e < c.events.size(); ++e) {
    for (size_t id = 0; id < c.events[e].size(); ++id) {
      const EventSlot& slot = c.events[e][id];
      if (slot.set) {
        Fail(rule::kEvent, "SetFlag", slot.site,
             "HardEvent " + std::to_string(e) + " id " + std::to_string(id) +
                 " was set and never waited before the kernel ended: the flag leaks into the next kernel");
      }
    }
  }
}

}  // namespace emu

#endif  // LMCACHE_NPU_ASCENDC_EMU_H_
