// Tiny kernels, each breaking exactly one hardware rule, plus correct controls.
// Compiled by tests/emu/test_rules.py against csrc/ascendc/emu; run_case() reports the
// emulator's verdict as (rule, message) so the test can assert the rule it trips.
#include <cstring>
#include <map>
#include <string>

#include "emu/ascendc_emu.h"

using namespace AscendC;

namespace {

constexpr uint32_t kBytes = 1024;
uint8_t* g_src = nullptr;
uint8_t* g_dst = nullptr;
uint8_t* g_readonly = nullptr;

GlobalTensor<uint8_t> Src() {
  GlobalTensor<uint8_t> t;
  t.SetGlobalBuffer(g_src, kBytes);
  return t;
}
GlobalTensor<uint8_t> Dst() {
  GlobalTensor<uint8_t> t;
  t.SetGlobalBuffer(g_dst, kBytes);
  return t;
}

using BindQueue = TQueBind<TPosition::VECIN, TPosition::VECOUT, 2>;

// A correct depth-2 copy of kBytes through 256 B tiles, each core its own stripe.
void CorrectCopy() {
  TPipe pipe;
  BindQueue q;
  pipe.InitBuffer(q, 2, 256);
  const uint32_t stripe = kBytes / static_cast<uint32_t>(GetBlockNum());
  const uint32_t begin = stripe * static_cast<uint32_t>(GetBlockIdx());
  bool pending = false;
  uint32_t pending_off = 0;
  for (uint32_t off = begin; off < begin + stripe; off += 256) {
    LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
    DataCopyPad(t, Src()[off], DataCopyExtParams(1, 256, 0, 0, 0), DataCopyPadExtParams<uint8_t>(false, 0, 0, 0));
    q.EnQue(t);
    if (pending) {
      LocalTensor<uint8_t> out = q.DeQue<uint8_t>();
      DataCopyPad(Dst()[pending_off], out, DataCopyExtParams(1, 256, 0, 0, 0));
      q.FreeTensor(out);
    }
    pending = true;
    pending_off = off;
  }
  if (pending) {
    LocalTensor<uint8_t> out = q.DeQue<uint8_t>();
    DataCopyPad(Dst()[pending_off], out, DataCopyExtParams(1, 256, 0, 0, 0));
    q.FreeTensor(out);
  }
}

// A correct manual double buffer with TBuf and explicit flags (310P-legal: DataCopy only).
void CorrectManualFlags() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 512);
  LocalTensor<uint8_t> tiles = buf.Get<uint8_t>();
  SetFlag<HardEvent::MTE3_MTE2>(0);
  SetFlag<HardEvent::MTE3_MTE2>(1);
  for (uint32_t i = 0; i < kBytes / 256 && GetBlockIdx() == 0; ++i) {
    const int32_t id = static_cast<int32_t>(i % 2);
    LocalTensor<uint8_t> tile = tiles[(i % 2) * 256];
    WaitFlag<HardEvent::MTE3_MTE2>(id);
    DataCopy(tile, Src()[i * 256], 256);
    SetFlag<HardEvent::MTE2_MTE3>(id);
    WaitFlag<HardEvent::MTE2_MTE3>(id);
    DataCopy(Dst()[i * 256], tile, 256);
    SetFlag<HardEvent::MTE3_MTE2>(id);
  }
  WaitFlag<HardEvent::MTE3_MTE2>(0);
  WaitFlag<HardEvent::MTE3_MTE2>(1);
}

void DataCopyNot32() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  DataCopy(buf.Get<uint8_t>(), Src(), 48);  // 48 B: the NPU would silently move 32
}

void DataCopyBlockCountZero() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  DataCopy(buf.Get<uint8_t>(), Src(), DataCopyParams(0, 1, 0, 0));
}

void PadBlockCount() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  DataCopyPad(buf.Get<uint8_t>(), Src(), DataCopyExtParams(4096, 1, 0, 0, 0),
              DataCopyPadExtParams<uint8_t>(false, 0, 0, 0));
}

void PadBlockLen() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  DataCopyPad(buf.Get<uint8_t>(), Src(), DataCopyExtParams(1, 2097152, 0, 0, 0),
              DataCopyPadExtParams<uint8_t>(false, 0, 0, 0));
}

void PadOnAnySoc() {  // run on 310P: the API does not exist there
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  DataCopyPad(buf.Get<uint8_t>(), Src(), DataCopyExtParams(1, 3, 0, 0, 0),
              DataCopyPadExtParams<uint8_t>(false, 0, 0, 0));
}

void UbOverflow() {
  TPipe pipe;
  BindQueue q;
  pipe.InitBuffer(q, 2, 100 * 1024);  // 200 KiB > 192 KiB on A2
}

void UbMisaligned() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  DataCopy(buf.Get<uint8_t>()[16], Src(), 32);
}

void QueueDepth() {
  TPipe pipe;
  TQueBind<TPosition::VECIN, TPosition::VECOUT, 1> q;
  pipe.InitBuffer(q, 2, 64);
  LocalTensor<uint8_t> a = q.AllocTensor<uint8_t>();
  LocalTensor<uint8_t> b = q.AllocTensor<uint8_t>();
  DataCopy(a, Src(), 64);
  DataCopy(b, Src()[64], 64);
  q.EnQue(a);
  q.EnQue(b);  // depth 1
}

void QueueTooManyBuffers() {
  TPipe pipe;
  BindQueue q;
  pipe.InitBuffer(q, 9, 64);  // at most 8 per TPosition
}

void QueueExhausted() {
  TPipe pipe;
  BindQueue q;
  pipe.InitBuffer(q, 2, 64);
  q.AllocTensor<uint8_t>();
  q.AllocTensor<uint8_t>();
  q.AllocTensor<uint8_t>();  // no FreeTensor: hangs on NPU
}

void UseAfterFree() {
  TPipe pipe;
  BindQueue q;
  pipe.InitBuffer(q, 2, 64);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  DataCopy(t, Src(), 64);
  q.EnQue(t);
  LocalTensor<uint8_t> out = q.DeQue<uint8_t>();
  q.FreeTensor(out);
  DataCopy(Dst(), out, 64);
}

void MissingEnqueSync() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>();
  DataCopy(t, Src(), 256);
  DataCopy(Dst(), t, 256);  // MTE3 may read before MTE2 lands
}

void MissingFreeSync() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>();
  DataCopy(t, Src(), 256);
  SetFlag<HardEvent::MTE2_MTE3>(0);
  WaitFlag<HardEvent::MTE2_MTE3>(0);
  DataCopy(Dst(), t, 256);
  DataCopy(t, Src()[256], 256);  // overwrites the tile MTE3 may still be reading
}

void UninitialisedRead() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  DataCopy(Dst(), buf.Get<uint8_t>(), 256);
}

void GmOutOfBounds() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>();
  DataCopy(t, Src(), 256);
  SetFlag<HardEvent::MTE2_MTE3>(0);
  WaitFlag<HardEvent::MTE2_MTE3>(0);
  GlobalTensor<uint8_t> unbounded;  // no size: only the registered buffers bound it
  unbounded.SetGlobalBuffer(g_dst);
  DataCopy(unbounded[kBytes - 128], t, 256);  // 128 B past the end
}

// The tensor names the first half of the buffer; the write lands in the second half, memory the launch owns but the
// tensor does not (as a write into the next plane or the next chunk's object would).
void GmTensorBounds() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>();
  DataCopy(t, Src(), 256);
  SetFlag<HardEvent::MTE2_MTE3>(0);
  WaitFlag<HardEvent::MTE2_MTE3>(0);
  GlobalTensor<uint8_t> half;
  half.SetGlobalBuffer(g_dst, kBytes / 2);
  DataCopy(half[kBytes / 2 - 64], t, 128);
}

void GmGuardOverwrite() {
  if (GetBlockIdx() == 0) g_dst[kBytes + 3] = 0x11;  // raw pointer write past the buffer
}

void GmReadOnly() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>();
  DataCopy(t, Src(), 64);
  SetFlag<HardEvent::MTE2_MTE3>(0);
  WaitFlag<HardEvent::MTE2_MTE3>(0);
  GlobalTensor<uint8_t> ro;
  ro.SetGlobalBuffer(g_readonly, 64);
  DataCopy(ro, t, 64);
}

void CrossCoreWrite() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>();
  DataCopy(t, Src(), 64);
  SetFlag<HardEvent::MTE2_MTE3>(0);
  WaitFlag<HardEvent::MTE2_MTE3>(0);
  DataCopy(Dst()[GetBlockIdx() * 32], t, 64);  // neighbours overlap by 32 B
}

void WaitWithoutSet() {
  TPipe pipe;
  WaitFlag<HardEvent::MTE2_MTE3>(0);
}

void SetTwice() {
  TPipe pipe;
  SetFlag<HardEvent::MTE2_MTE3>(1);
  SetFlag<HardEvent::MTE2_MTE3>(1);
}

// The hardware's FetchEventID returns the same id until that id is reserved (AllocEventID): two flags in flight
// from two fetches share one id, and the second set hits a flag already set.
void FetchedTwice() {
  TPipe pipe;
  const TEventID first = pipe.FetchEventID<HardEvent::MTE2_MTE3>();
  SetFlag<HardEvent::MTE2_MTE3>(first);
  const TEventID second = pipe.FetchEventID<HardEvent::MTE2_MTE3>();
  SetFlag<HardEvent::MTE2_MTE3>(second);
  WaitFlag<HardEvent::MTE2_MTE3>(first);
  WaitFlag<HardEvent::MTE2_MTE3>(second);
}

// The control: ids held by AllocEventID are distinct, so two flags can be in flight.
void AllocatedTwice() {
  TPipe pipe;
  const TEventID first = pipe.AllocEventID<HardEvent::MTE2_MTE3>();
  SetFlag<HardEvent::MTE2_MTE3>(first);
  const TEventID second = pipe.AllocEventID<HardEvent::MTE2_MTE3>();
  SetFlag<HardEvent::MTE2_MTE3>(second);
  WaitFlag<HardEvent::MTE2_MTE3>(first);
  WaitFlag<HardEvent::MTE2_MTE3>(second);
  pipe.ReleaseEventID<HardEvent::MTE2_MTE3>(first);
  pipe.ReleaseEventID<HardEvent::MTE2_MTE3>(second);
}

void SetNeverWaited() {
  TPipe pipe;
  SetFlag<HardEvent::S_MTE3>(2);
}

void TwoPipes() {
  TPipe a;
  TPipe b;
}

// ---- variants and rules that had no broken kernel (issue 12 item 9); each "ordered_*" case is its clean control.

void DataCopyBlockLenZero() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  DataCopy(buf.Get<uint8_t>(), Src(), DataCopyParams(1, 0, 0, 0));
}

void DataCopyBlockCountTooBig() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  DataCopy(buf.Get<uint8_t>(), Src(), DataCopyParams(4096, 1, 0, 0));
}

void PadPaddingTooWide() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  DataCopyPad(buf.Get<uint8_t>(), Src(), DataCopyExtParams(1, 16, 0, 0, 0),
              DataCopyPadExtParams<uint8_t>(true, 40, 0, 0));  // 40 B of left padding: at most 32
}

void PadBlockLenNotElements() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  GlobalTensor<uint16_t> src;
  src.SetGlobalBuffer(reinterpret_cast<uint16_t*>(g_src), kBytes / 2);
  DataCopyPad(buf.Get<uint16_t>(), src, DataCopyExtParams(1, 3, 0, 0, 0),  // 3 B of 2 B elements
              DataCopyPadExtParams<uint16_t>(false, 0, 0, 0));
}

void UbSlicePastEnd() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>()[256];
  DataCopy(t, Src(), 32);
}

void UbDmaPastEnd() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  DataCopy(buf.Get<uint8_t>()[192], Src(), 128);  // 64 B past the tensor
}

void UbScalarPastEnd() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  buf.Get<uint8_t>().SetValue(300, 1);
}

void UbGetWithOffsetMisaligned() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  LocalTensor<uint8_t> t = buf.GetWithOffset<uint8_t>(64, 16);
  DataCopy(t, Src(), 32);
}

void DuplicateMisaligned() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  Duplicate(buf.Get<uint8_t>()[16], static_cast<uint8_t>(0), 16);
}

void QueueDeQueEmpty() {
  TPipe pipe;
  BindQueue q;
  pipe.InitBuffer(q, 2, 64);
  LocalTensor<uint8_t> t = q.DeQue<uint8_t>();  // nothing was enqueued: the core would wait forever
  q.FreeTensor(t);
}

void QueueFreeWhileQueued() {
  TPipe pipe;
  BindQueue q;
  pipe.InitBuffer(q, 2, 64);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  DataCopy(t, Src(), 64);
  q.EnQue(t);
  q.FreeTensor(t);  // still in the queue
}

void QueueStillQueuedAtEnd() {
  TPipe pipe;
  BindQueue q;
  pipe.InitBuffer(q, 2, 64);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  DataCopy(t, Src(), 64);
  q.EnQue(t);  // never dequeued: the pipeline's last tile is lost
}

// Scalar writes to UB, then MTE3 reads them: needs SetFlag/WaitFlag<S_MTE3>.
void ScalarThenMte3(bool ordered) {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>();
  for (uint32_t i = 0; i < 32; ++i) t.SetValue(i, static_cast<uint8_t>(i));
  if (ordered) {
    SetFlag<HardEvent::S_MTE3>(0);
    WaitFlag<HardEvent::S_MTE3>(0);
  }
  if (GetBlockIdx() == 0) DataCopy(Dst(), t, 32);
}
void MissingSMte3() { ScalarThenMte3(false); }
void OrderedSMte3() { ScalarThenMte3(true); }

// A vector op writes UB, then MTE3 reads it: needs SetFlag/WaitFlag<V_MTE3>.
void VectorThenMte3(bool ordered) {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>();
  Duplicate(t, static_cast<uint8_t>(7), 32);
  if (ordered) {
    SetFlag<HardEvent::V_MTE3>(0);
    WaitFlag<HardEvent::V_MTE3>(0);
  }
  if (GetBlockIdx() == 0) DataCopy(Dst(), t, 32);
}
void MissingVMte3() { VectorThenMte3(false); }
void OrderedVMte3() { VectorThenMte3(true); }

// MTE2 fills UB, then the scalar unit reads it: needs SetFlag/WaitFlag<MTE2_S>.
void Mte2ThenScalar(bool ordered) {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>();
  DataCopy(t, Src(), 32);
  if (ordered) {
    SetFlag<HardEvent::MTE2_S>(0);
    WaitFlag<HardEvent::MTE2_S>(0);
  }
  (void)t.GetValue(0);
}
void MissingMte2S() { Mte2ThenScalar(false); }
void OrderedMte2S() { Mte2ThenScalar(true); }

// Scalar GM writes go through the data cache in 64 B lines: two cores writing one line lose each other's bytes.
void CrossCoreScalarLine(uint32_t spacing) {
  GlobalTensor<uint8_t> dst = Dst();
  dst.SetValue(GetBlockIdx() * spacing, static_cast<uint8_t>(GetBlockIdx() + 1));
}
void CrossCoreSetValueSameLine() { CrossCoreScalarLine(8); }
void CrossCoreSetValueOwnLines() { CrossCoreScalarLine(64); }

void PipeTooManyBuffers() {
  TPipe pipe;
  static TBuf<TPosition::VECCALC> bufs[65];
  for (auto& b : bufs) pipe.InitBuffer(b, 32);  // at most 64 buffers per TPipe
}

// ---- GM hazards (issue 12 item 7); each "ordered_*" twin is the same code with the ordering and must run clean.

// Two MTE3 writes of the same GM bytes: their completion order is not the issue order without PipeBarrier<PIPE_MTE3>.
void GmWriteTwice(bool ordered) {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 512);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>();
  DataCopy(t, Src(), 512);
  SetFlag<HardEvent::MTE2_MTE3>(0);
  WaitFlag<HardEvent::MTE2_MTE3>(0);
  DataCopy(Dst(), t, 256);
  if (ordered) PipeBarrier<PIPE_MTE3>();
  DataCopy(Dst(), t[256], 256);
}
void GmMte3WriteAfterWrite() { GmWriteTwice(false); }
void OrderedGmMte3WriteAfterWrite() { GmWriteTwice(true); }

// MTE3 writes GM, then MTE2 reads it back: MTE2 may read before the write lands without an MTE3_MTE2 flag.
void GmWriteThenRead(bool ordered) {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 512);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>();
  DataCopy(t, Src(), 256);
  SetFlag<HardEvent::MTE2_MTE3>(0);
  WaitFlag<HardEvent::MTE2_MTE3>(0);
  DataCopy(Dst(), t, 256);
  if (ordered) {
    SetFlag<HardEvent::MTE3_MTE2>(0);
    WaitFlag<HardEvent::MTE3_MTE2>(0);
  }
  DataCopy(t[256], Dst(), 256);
}
void GmMte3ThenMte2() { GmWriteThenRead(false); }
void OrderedGmMte3ThenMte2() { GmWriteThenRead(true); }

// Core 0 writes what core 1 reads: cores of a launch are not synchronised.
void CrossCoreRead() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>();
  if (GetBlockIdx() == 0) {
    DataCopy(t, Src(), 64);
    SetFlag<HardEvent::MTE2_MTE3>(0);
    WaitFlag<HardEvent::MTE2_MTE3>(0);
    DataCopy(Dst(), t, 64);
  } else {
    DataCopy(t, Dst(), 64);
  }
}

// The vector unit writes a tile, it is freed and allocated again, MTE2 overwrites it: the allocation orders MTE2
// after MTE3's reads, not after the vector write, which needs V_MTE2.
void RewriteAfterFree(bool ordered) {
  TPipe pipe;
  BindQueue q;
  pipe.InitBuffer(q, 1, 64);
  LocalTensor<uint8_t> t = q.AllocTensor<uint8_t>();
  Duplicate(t, static_cast<uint8_t>(1), 64);
  if (ordered) {
    SetFlag<HardEvent::V_MTE2>(0);
    WaitFlag<HardEvent::V_MTE2>(0);
  }
  q.FreeTensor(t);
  LocalTensor<uint8_t> again = q.AllocTensor<uint8_t>();
  DataCopy(again, Src(), 64);
  q.FreeTensor(again);
}
void UbRewriteAfterFree() { RewriteAfterFree(false); }
void OrderedUbRewriteAfterFree() { RewriteAfterFree(true); }

// Without the compiler's automatic sync (run with v_auto_sync off), dependent vector ops need PipeBarrier<PIPE_V>.
void VectorAfterVector(bool ordered) {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 256);
  LocalTensor<uint8_t> t = buf.Get<uint8_t>();
  Duplicate(t, static_cast<uint8_t>(1), 64);
  if (ordered) PipeBarrier<PIPE_V>();
  Duplicate(t, static_cast<uint8_t>(2), 64);
}
void ManualSyncVectorAfterVector() { VectorAfterVector(false); }
void ManualSyncOrderedVectorAfterVector() { VectorAfterVector(true); }

const std::map<std::string, void (*)()>& Cases() {
  static const std::map<std::string, void (*)()> cases = {
      {"correct_copy", CorrectCopy},
      {"correct_manual_flags", CorrectManualFlags},
      {"datacopy_not_32", DataCopyNot32},
      {"datacopy_block_count_zero", DataCopyBlockCountZero},
      {"pad_block_count", PadBlockCount},
      {"pad_block_len", PadBlockLen},
      {"pad_on_soc", PadOnAnySoc},
      {"ub_overflow", UbOverflow},
      {"ub_misaligned", UbMisaligned},
      {"queue_depth", QueueDepth},
      {"queue_too_many_buffers", QueueTooManyBuffers},
      {"queue_exhausted", QueueExhausted},
      {"use_after_free", UseAfterFree},
      {"missing_enque_sync", MissingEnqueSync},
      {"missing_free_sync", MissingFreeSync},
      {"uninitialised_read", UninitialisedRead},
      {"gm_out_of_bounds", GmOutOfBounds},
      {"gm_tensor_bounds", GmTensorBounds},
      {"gm_guard_overwrite", GmGuardOverwrite},
      {"gm_read_only", GmReadOnly},
      {"cross_core_write", CrossCoreWrite},
      {"wait_without_set", WaitWithoutSet},
      {"set_twice", SetTwice},
      {"fetched_twice", FetchedTwice},
      {"allocated_twice", AllocatedTwice},
      {"set_never_waited", SetNeverWaited},
      {"datacopy_block_len_zero", DataCopyBlockLenZero},
      {"datacopy_block_count_4096", DataCopyBlockCountTooBig},
      {"pad_padding_too_wide", PadPaddingTooWide},
      {"pad_block_len_not_elements", PadBlockLenNotElements},
      {"ub_slice_past_end", UbSlicePastEnd},
      {"ub_dma_past_end", UbDmaPastEnd},
      {"ub_scalar_past_end", UbScalarPastEnd},
      {"ub_get_with_offset_misaligned", UbGetWithOffsetMisaligned},
      {"duplicate_misaligned", DuplicateMisaligned},
      {"queue_deque_empty", QueueDeQueEmpty},
      {"queue_free_while_queued", QueueFreeWhileQueued},
      {"queue_still_queued_at_end", QueueStillQueuedAtEnd},
      {"missing_s_mte3", MissingSMte3},
      {"ordered_s_mte3", OrderedSMte3},
      {"missing_v_mte3", MissingVMte3},
      {"ordered_v_mte3", OrderedVMte3},
      {"missing_mte2_s", MissingMte2S},
      {"ordered_mte2_s", OrderedMte2S},
      {"cross_core_setvalue_same_line", CrossCoreSetValueSameLine},
      {"cross_core_setvalue_own_lines", CrossCoreSetValueOwnLines},
      {"pipe_too_many_buffers", PipeTooManyBuffers},
      {"gm_mte3_write_after_write", GmMte3WriteAfterWrite},
      {"ordered_gm_mte3_write_after_write", OrderedGmMte3WriteAfterWrite},
      {"gm_mte3_then_mte2", GmMte3ThenMte2},
      {"ordered_gm_mte3_then_mte2", OrderedGmMte3ThenMte2},
      {"cross_core_read", CrossCoreRead},
      {"ub_rewrite_after_free", UbRewriteAfterFree},
      {"ordered_ub_rewrite_after_free", OrderedUbRewriteAfterFree},
      {"manual_sync_vector_after_vector", ManualSyncVectorAfterVector},
      {"manual_sync_ordered_vector_after_vector", ManualSyncOrderedVectorAfterVector},
      {"two_pipes", TwoPipes},
  };
  return cases;
}

void Copy(char* out, size_t n, const std::string& s) {
  if (n == 0) return;
  std::strncpy(out, s.c_str(), n - 1);
  out[n - 1] = '\0';
}

}  // namespace

// Returns 0 when the case ran clean (and dst == src for the copy controls), 1 on a
// violation (rule and message filled in), 2 on a harness error.
extern "C" int run_case(const char* name, const char* target, uint32_t block_dim, const char* order, char* rule,
                        size_t rule_len, char* message, size_t message_len) {
  const auto it = Cases().find(name);
  if (it == Cases().end()) {
    Copy(message, message_len, std::string("unknown case ") + name);
    return 2;
  }
  g_src = emu::GmAlloc(kBytes, "src");
  g_dst = emu::GmAlloc(kBytes, "dst");
  uint8_t readonly[64] = {};
  g_readonly = readonly;
  for (uint32_t i = 0; i < kBytes; ++i) g_src[i] = static_cast<uint8_t>(i * 7 + 3);
  emu::LaunchConfig cfg;
  const std::string t = target;
  cfg.target = t == "310p" ? emu::Target::I310P : (t == "a3" ? emu::Target::A3 : emu::Target::A2);
  cfg.block_dim = block_dim;
  const std::string o = order;
  cfg.order = o == "reverse" ? emu::CoreOrder::kReverse
                             : (o == "shuffled" ? emu::CoreOrder::kShuffled : emu::CoreOrder::kSequential);
  cfg.seed = 1234;
  cfg.kernel = name;
  cfg.v_auto_sync = std::string(name).rfind("manual_sync_", 0) != 0;  // manual_sync_*: no compiler-inserted V barriers
  int rc = 0;
  try {
    std::vector<emu::GmRegion> regions = {
        {reinterpret_cast<uintptr_t>(readonly), reinterpret_cast<uintptr_t>(readonly) + sizeof(readonly), false,
         "readonly"}};
    emu::Launch(cfg, regions, it->second);
    const bool copies = std::string(name).rfind("correct_", 0) == 0;
    if (copies && std::memcmp(g_src, g_dst, kBytes) != 0) {
      Copy(message, message_len, "copy control produced wrong bytes");
      rc = 2;
    }
  } catch (const emu::Violation& v) {
    Copy(rule, rule_len, v.rule());
    Copy(message, message_len, v.what());
    rc = 1;
  }
  emu::GmFree(g_src);
  emu::GmFree(g_dst);
  return rc;
}
