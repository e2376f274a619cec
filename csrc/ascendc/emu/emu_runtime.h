// Host emulation of the AscendC execution model: cores, GM registry, UB, pipes, events.
//
// The emulator runs kernel sources on x86 and turns every rule the hardware enforces
// silently into an emu::Violation naming the core, the API, the caller's file:line and
// the rule. DMAs execute eagerly (bytes move at once), but each UB access is checked
// against the ordering the kernel actually established with EnQue/DeQue, SetFlag/WaitFlag
// and PipeBarrier (vector clocks per pipe), so a missing synchronisation is an error even
// though eager execution would have produced the right bytes.
#ifndef LMCACHE_NPU_EMU_RUNTIME_H_
#define LMCACHE_NPU_EMU_RUNTIME_H_

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <map>
#include <vector>

namespace emu {

// ----------------------------------------------------------------------------- targets

enum class Target { A2, A3, I310P };

struct TargetSpec {
  const char* name;
  uint32_t ub_bytes;             // per vector core
  uint32_t max_que_buf_per_pos;  // simultaneously initialised queue buffers per TPosition
  uint32_t max_pipe_buffers;     // buffers per TPipe
  uint32_t num_event_ids;        // per HardEvent
  bool has_datacopy_pad;
  uint32_t phys_cores;           // AIV cores (A2/A3) or AI cores (310P)
};

inline const TargetSpec& Spec(Target t) {
  static const TargetSpec a2{"A2", 196608, 8, 64, 8, true, 48};
  static const TargetSpec a3{"A3", 196608, 8, 64, 8, true, 48};
  static const TargetSpec p310{"310P", 262144, 8, 64, 8, false, 8};
  return t == Target::A2 ? a2 : (t == Target::A3 ? a3 : p310);
}

// ----------------------------------------------------------------------------- errors

// Rule identifiers; tests match on them.
namespace rule {
constexpr const char* kDataCopyLen = "datacopy-len";
constexpr const char* kDataCopyParams = "datacopy-params";
constexpr const char* kPadUnsupported = "datacopypad-unsupported";
constexpr const char* kPadLimits = "datacopypad-limits";
constexpr const char* kUbCapacity = "ub-capacity";
constexpr const char* kUbAlign = "ub-align";
constexpr const char* kUbBounds = "ub-bounds";
constexpr const char* kQueueDepth = "queue-depth";
constexpr const char* kQueueBuffers = "queue-buffers";
constexpr const char* kQueueState = "queue-state";
constexpr const char* kUseAfterFree = "use-after-free";
constexpr const char* kUnordered = "unordered-ub-access";
constexpr const char* kUninitialised = "uninitialised-ub-read";
constexpr const char* kEvent = "event";
constexpr const char* kGmBounds = "gm-bounds";
constexpr const char* kGmReadOnly = "gm-read-only";
constexpr const char* kGmGuard = "gm-guard";
constexpr const char* kCrossCoreWrite = "cross-core-write";
constexpr const char* kGmTensorBounds = "gm-tensor-bounds";
constexpr const char* kGmHazard = "gm-hazard";
constexpr const char* kCrossCoreRead = "cross-core-read";
constexpr const char* kPipe = "tpipe";
constexpr const char* kLaunch = "launch";
}  // namespace rule

class Violation : public std::runtime_error {
 public:
  Violation(std::string rule_id, const std::string& what)
      : std::runtime_error(what), rule_(std::move(rule_id)) {}
  const std::string& rule() const { return rule_; }

 private:
  std::string rule_;
};

// Caller location, captured by default arguments of every emulated API.
struct Site {
  const char* file;
  int line;
};
// Source-location builtins bind to the caller only when they are the default argument itself.
#define EMU_SITE const char* emu_file = __builtin_FILE(), int emu_line = __builtin_LINE()
#define EMU_BIND_SITE const ::emu::Site site{emu_file, emu_line}

// ----------------------------------------------------------------------------- pipes

// Compact pipe indices used by the ordering model.
enum Pipe : int { kS = 0, kV = 1, kMte2 = 2, kMte3 = 3, kNumPipes = 4 };

inline const char* PipeName(int p) {
  static const char* names[] = {"S", "V", "MTE2", "MTE3"};
  return names[p];
}

using Clock = std::array<uint64_t, kNumPipes>;

struct UbBlockShadow {
  int8_t writer = -1;      // pipe of the last write, -1: never written since allocation
  uint64_t writer_seq = 0;
  int8_t freed_writer = -1;  // the last writer before the buffer was freed: a new write must still be ordered after it
  uint64_t freed_writer_seq = 0;
  Clock reader_seq{};      // latest read per pipe since the last write
};

// One GM write of this core still relevant to later accesses of the same bytes: [begin, end) by `pipe` op `seq`.
struct GmShadow {
  uintptr_t end;
  int pipe;
  uint64_t seq;
  Site site;
};

struct GmWrite {
  uintptr_t begin, end;
  int core;
  const char* file;
  int line;
};

struct GmRegion {
  uintptr_t begin, end;
  bool writable;
  std::string name;
};

struct CoreStats {
  uint64_t mte2_ops = 0, mte3_ops = 0, mte2_bytes = 0, mte3_bytes = 0;
  uint64_t scalar_gm_reads = 0, scalar_gm_writes = 0, vector_ops = 0;
  uint32_t ub_high_water = 0;
};

class TPipeState;

struct EventSlot {
  bool set = false;
  Clock token{};
  Site site{"", 0};  // where SetFlag was issued
};

// Everything one simulated core owns during a launch.
struct CoreCtx {
  int idx = 0;
  int num = 1;
  const TargetSpec* spec = nullptr;
  uint32_t ub_bytes = 0;
  std::vector<uint8_t> ub;
  std::vector<UbBlockShadow> shadow;  // one per 32 B UB block
  Clock issued{};                      // last sequence number issued per pipe
  std::array<Clock, kNumPipes> known{};  // known[d][s]: seq of pipe s ordered before d's next op
  // Event slots [HardEvent][id]: a set flag carries the clock of its source pipe.
  std::vector<std::vector<EventSlot>> events;
  std::vector<std::vector<bool>> event_reserved;  // ids held by queues
  TPipeState* pipe = nullptr;
  bool atomic_add = false;  // MTE3 writes add to GM instead of overwriting it (the mode outlives a kernel)
  bool v_auto_sync = true;  // the compiler inserts PipeBarrier<PIPE_V> between dependent vector ops
  std::map<uintptr_t, GmShadow> gm_writes;  // by begin, non-overlapping: this core's GM writes
  std::string pending_end_error;  // found while the TPipe ended; raised at kernel end
  std::string pending_end_rule;
  CoreStats stats;
};

struct LaunchState {
  std::string kernel;
  const TargetSpec* spec = nullptr;
  std::vector<GmRegion> regions;
  std::vector<GmWrite> writes;
  std::vector<GmWrite> reads;  // every core's DMA and scalar GM reads: none may see another core's write
  size_t last_region = 0;
};

inline thread_local CoreCtx* g_core = nullptr;
inline thread_local LaunchState* g_launch = nullptr;

[[noreturn]] inline void Fail(const char* rule_id, const char* api, const Site& site, const std::string& msg) {
  char head[256];
  if (g_core != nullptr && g_launch != nullptr) {
    std::snprintf(head, sizeof(head), "[EMU][core %d/%d][%s][%s] %s at %s:%d: ", g_core->idx, g_core->num,
                  g_launch->spec->name, g_launch->kernel.c_str(), api, site.file, site.line);
  } else {
    std::snprintf(head, sizeof(head), "[EMU] %s at %s:%d: ", api, site.file, site.line);
  }
  throw Violation(rule_id, std::string(head) + msg + " (rule: " + rule_id + ")");
}

inline CoreCtx& Core(const char* api, const Site& site) {
  if (g_core == nullptr) Fail(rule::kLaunch, api, site, "called outside emu::Launch");
  return *g_core;
}

// ----------------------------------------------------------------------------- GM

// Buffers allocated with guard bytes on both sides; the guards must be intact after a launch.
struct GuardedAlloc {
  uint8_t* raw;
  size_t bytes;
  std::string name;
};
constexpr size_t kGuardBytes = 64;
constexpr uint8_t kGuardByte = 0xCD;

inline std::vector<GuardedAlloc>& GuardedAllocs() {
  static std::vector<GuardedAlloc> allocs;
  return allocs;
}

// Allocates `bytes` of GM surrounded by guard bytes; registered for every later launch.
inline uint8_t* GmAlloc(size_t bytes, const std::string& name) {
  uint8_t* raw = static_cast<uint8_t*>(std::malloc(bytes + 2 * kGuardBytes));
  if (raw == nullptr) throw std::bad_alloc();
  std::memset(raw, kGuardByte, kGuardBytes);
  std::memset(raw + kGuardBytes + bytes, kGuardByte, kGuardBytes);
  std::memset(raw + kGuardBytes, 0, bytes);
  GuardedAllocs().push_back({raw, bytes, name});
  return raw + kGuardBytes;
}

inline void GmFree(uint8_t* user) {
  auto& allocs = GuardedAllocs();
  for (size_t i = 0; i < allocs.size(); ++i) {
    if (allocs[i].raw + kGuardBytes == user) {
      std::free(allocs[i].raw);
      allocs.erase(allocs.begin() + static_cast<long>(i));
      return;
    }
  }
}

inline const GmRegion* FindRegion(uintptr_t begin, uintptr_t end, bool need_write) {
  LaunchState& L = *g_launch;
  const GmRegion* readable = nullptr;
  auto fits = [&](const GmRegion& r) { return begin >= r.begin && end <= r.end; };
  if (L.last_region < L.regions.size()) {
    const GmRegion& r = L.regions[L.last_region];
    if (fits(r) && (!need_write || r.writable)) return &r;
  }
  for (size_t i = 0; i < L.regions.size(); ++i) {
    const GmRegion& r = L.regions[i];
    if (!fits(r)) continue;
    if (!need_write || r.writable) {
      L.last_region = i;
      return &r;
    }
    readable = &r;
  }
  return readable;
}

inline std::string Hex(uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

// Every GM byte range a DMA or scalar access touches must lie inside one registered buffer.
inline void GmOrder(int pipe, uintptr_t begin, uintptr_t end, bool is_write, const char* api, const Site& site);

// `pipe` >= 0: a real access by that pipe (ordered against this core's earlier GM writes, and recorded for the
// cross-core checks); -1: only a bounds check (binding a GlobalTensor).
inline void CheckGm(const void* ptr, uint64_t bytes, bool is_write, const char* api, const Site& site, int pipe = -1) {
  if (bytes == 0) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t end = begin + bytes;
  const GmRegion* r = FindRegion(begin, end, is_write);
  if (r == nullptr) {
    Fail(rule::kGmBounds, api, site,
         std::string(is_write ? "writes" : "reads") + " GM [" + Hex(begin) + ", " + Hex(end) + ") (" +
             std::to_string(bytes) + " B), which is not inside any registered buffer");
  }
  if (is_write && !r->writable) {
    Fail(rule::kGmReadOnly, api, site,
         "writes GM [" + Hex(begin) + ", " + Hex(end) + ") inside read-only buffer '" + r->name + "'");
  }
  if (pipe >= 0) GmOrder(pipe, begin, end, is_write, api, site);
  if (is_write) {
    g_launch->writes.push_back({begin, end, g_core->idx, site.file, site.line});
  } else if (pipe >= 0) {
    g_launch->reads.push_back({begin, end, g_core->idx, site.file, site.line});
  }
}

// ----------------------------------------------------------------------------- ordering model

inline const char* SyncHint(int writer, int reader) {
  if (writer == kMte2 && reader == kMte3) return "missing EnQue/DeQue or SetFlag/WaitFlag<MTE2_MTE3>";
  if (writer == kMte3 && reader == kMte2) return "missing FreeTensor/AllocTensor or SetFlag/WaitFlag<MTE3_MTE2>";
  if (writer == kS && reader == kMte3) return "missing SetFlag/WaitFlag<S_MTE3>";
  if (writer == kV && reader == kMte3) return "missing SetFlag/WaitFlag<V_MTE3>";
  if (writer == kMte2 && reader == kS) return "missing SetFlag/WaitFlag<MTE2_S>";
  if (writer == kMte2 && reader == kV) return "missing EnQue/DeQue or SetFlag/WaitFlag<MTE2_V>";
  if (writer == kMte3 && reader == kV) return "missing SetFlag/WaitFlag<MTE3_V>";
  if (writer == kV && reader == kMte2) return "missing SetFlag/WaitFlag<V_MTE2>";
  if (writer == kMte3 && reader == kS) return "missing SetFlag/WaitFlag<MTE3_S>";
  if (writer == reader) return "missing PipeBarrier on that pipe";
  return "missing SetFlag/WaitFlag between these pipes";
}

inline bool Ordered(const CoreCtx& c, int pipe, int other, uint64_t seq) {
  if (pipe == other && pipe == kS) return true;  // the scalar unit is in order
  if (pipe == other && pipe == kV && c.v_auto_sync) return true;  // the compiler's PipeBarrier<PIPE_V>
  return c.known[pipe][other] >= seq;
}

// Issues one operation on `pipe` that reads UB [rd, rd+rd_len) and/or writes UB [wr, wr+wr_len).
inline void UbAccess(int pipe, uint32_t rd, uint32_t rd_len, uint32_t wr, uint32_t wr_len, const char* api,
                     const Site& site) {
  CoreCtx& c = *g_core;
  const uint64_t seq = ++c.issued[pipe];
  if (pipe == kS || (pipe == kV && c.v_auto_sync)) c.known[pipe][pipe] = seq - 1;  // in-order issue
  if (rd_len > 0) {
    for (uint32_t b = rd / 32; b <= (rd + rd_len - 1) / 32; ++b) {
      UbBlockShadow& s = c.shadow[b];
      if (s.writer < 0) {
        Fail(rule::kUninitialised, api, site,
             std::string(PipeName(pipe)) + " reads UB byte " + std::to_string(b * 32) +
                 " that nothing wrote since its buffer was allocated");
      }
      if (!Ordered(c, pipe, s.writer, s.writer_seq)) {
        Fail(rule::kUnordered, api, site,
             std::string(PipeName(pipe)) + " reads UB [" + std::to_string(b * 32) + ", " +
                 std::to_string(b * 32 + 32) + ") written by " + PipeName(s.writer) + " op #" +
                 std::to_string(s.writer_seq) + " without ordering (" + SyncHint(s.writer, pipe) + ")");
      }
      s.reader_seq[pipe] = seq;
    }
  }
  if (wr_len > 0) {
    for (uint32_t b = wr / 32; b <= (wr + wr_len - 1) / 32; ++b) {
      UbBlockShadow& s = c.shadow[b];
      for (int r = 0; r < kNumPipes; ++r) {
        if (r == pipe || s.reader_seq[r] == 0) continue;
        if (!Ordered(c, pipe, r, s.reader_seq[r])) {
          Fail(rule::kUnordered, api, site,
               std::string(PipeName(pipe)) + " overwrites UB [" + std::to_string(b * 32) + ", " +
                   std::to_string(b * 32 + 32) + ") still being read by " + PipeName(r) + " op #" +
                   std::to_string(s.reader_seq[r]) + " (" + SyncHint(r, pipe) + ")");
        }
      }
      if (s.writer < 0 && s.freed_writer >= 0 && !Ordered(c, pipe, s.freed_writer, s.freed_writer_seq)) {
        Fail(rule::kUnordered, api, site,
             std::string(PipeName(pipe)) + " overwrites UB [" + std::to_string(b * 32) + ", " +
                 std::to_string(b * 32 + 32) + ") that " + PipeName(s.freed_writer) + " op #" +
                 std::to_string(s.freed_writer_seq) + " wrote before its buffer was freed and allocated again (" +
                 SyncHint(s.freed_writer, pipe) + ")");
      }
      if (s.writer >= 0 && !Ordered(c, pipe, s.writer, s.writer_seq)) {
        Fail(rule::kUnordered, api, site,
             std::string(PipeName(pipe)) + " overwrites UB [" + std::to_string(b * 32) + ", " +
                 std::to_string(b * 32 + 32) + ") written by " + PipeName(s.writer) + " op #" +
                 std::to_string(s.writer_seq) + " without ordering (" + SyncHint(s.writer, pipe) + ")");
      }
      s.writer = static_cast<int8_t>(pipe);
      s.writer_seq = seq;
      s.freed_writer = -1;
      s.reader_seq = Clock{};
    }
  }
}

// Allocation makes contents undefined: poison the bytes and forget the writer.
inline void UbPoison(uint32_t offset, uint32_t len) {
  CoreCtx& c = *g_core;
  std::memset(c.ub.data() + offset, 0xA5, len);
  for (uint32_t b = offset / 32; b < (offset + len + 31) / 32; ++b) {
    UbBlockShadow& s = c.shadow[b];
    if (s.writer >= 0) {
      s.freed_writer = s.writer;
      s.freed_writer_seq = s.writer_seq;
    }
    s.writer = -1;
    s.writer_seq = 0;
  }
}

// GM hazards inside one core: a read or write of bytes this core wrote must be ordered after that write (MTE3 then
// MTE3: PipeBarrier<PIPE_MTE3>; MTE3 then MTE2: SetFlag/WaitFlag<MTE3_MTE2>; MTE3 then a scalar read: MTE3_S).
inline void GmOrder(int pipe, uintptr_t begin, uintptr_t end, bool is_write, const char* api, const Site& site) {
  CoreCtx& c = *g_core;
  uint64_t seq = c.issued[pipe] + 1;  // DMA pipes: the op about to be issued (UbAccess numbers it)
  if (pipe == kS) {
    seq = ++c.issued[kS];
    c.known[kS][kS] = seq - 1;
  }
  auto it = c.gm_writes.upper_bound(begin);
  if (it != c.gm_writes.begin()) --it;
  while (it != c.gm_writes.end() && it->first < end) {
    const GmShadow& w = it->second;
    if (w.end <= begin) {
      ++it;
      continue;
    }
    if (!Ordered(c, pipe, w.pipe, w.seq)) {
      Fail(rule::kGmHazard, api, site,
           std::string(PipeName(pipe)) + (is_write ? " writes" : " reads") + " GM [" + Hex(std::max(begin, it->first)) +
               ", " + Hex(std::min(end, w.end)) + ") that " + PipeName(w.pipe) + " wrote at " + w.site.file + ":" +
               std::to_string(w.site.line) + " without ordering (" + SyncHint(w.pipe, pipe) + ")");
    }
    it = is_write ? c.gm_writes.erase(it) : std::next(it);
  }
  if (is_write) c.gm_writes[begin] = {end, pipe, seq, site};
}

inline void CheckEventId(const CoreCtx& c, int id, const char* api, const Site& site) {
  if (id < 0 || static_cast<uint32_t>(id) >= c.spec->num_event_ids) {
    Fail(rule::kEvent, api, site, "event id " + std::to_string(id) + " outside [0, " +
                                      std::to_string(c.spec->num_event_ids) + ")");
  }
}

inline void SetEvent(int event, int src, int id, const char* api, const Site& site) {
  CoreCtx& c = *g_core;
  CheckEventId(c, id, api, site);
  auto& slot = c.events[static_cast<size_t>(event)][static_cast<size_t>(id)];
  if (slot.set) {
    Fail(rule::kEvent, api, site,
         "SetFlag on event id " + std::to_string(id) + " that is already set at " + slot.site.file + ":" +
             std::to_string(slot.site.line) + " (undefined on NPU; a later barrier hangs)");
  }
  Clock token = c.known[src];
  token[src] = c.issued[src];  // SetFlag runs after every earlier op of its source pipe
  slot = {true, token, site};
}

inline void WaitEvent(int event, int dst, int id, const char* api, const Site& site) {
  CoreCtx& c = *g_core;
  CheckEventId(c, id, api, site);
  auto& slot = c.events[static_cast<size_t>(event)][static_cast<size_t>(id)];
  if (!slot.set) {
    Fail(rule::kEvent, api, site, "WaitFlag on event id " + std::to_string(id) + " that nobody set: the core would hang");
  }
  for (int p = 0; p < kNumPipes; ++p) c.known[dst][p] = std::max(c.known[dst][p], slot.token[p]);
  slot.set = false;
}

inline void Barrier(int pipe) {
  CoreCtx& c = *g_core;
  if (pipe < 0) {
    for (auto& row : c.known) row = c.issued;
  } else {
    c.known[pipe][pipe] = c.issued[pipe];
  }
}

// ----------------------------------------------------------------------------- launch

enum class CoreOrder { kSequential, kReverse, kShuffled };

struct LaunchConfig {
  Target target = Target::A2;
  uint32_t ub_bytes = 0;  // 0: the target's UB
  uint32_t block_dim = 1;
  CoreOrder order = CoreOrder::kSequential;
  uint64_t seed = 0;
  std::string kernel = "kernel";
  bool atomic_add_on_entry = false;  // a previous kernel on the stream left atomic add on (SetAtomicNone clears it)
  bool v_auto_sync = true;  // false: dependent vector ops need an explicit PipeBarrier<PIPE_V> (-O0, manual sync)
};

struct LaunchReport {
  std::vector<CoreStats> cores;
  std::vector<int> order;
};

constexpr int kNumHardEvents = 64;

inline void CheckKernelEnd(CoreCtx& c);  // defined after the AscendC classes

inline void CheckCrossCoreWrites(LaunchState& L) {
  auto& w = L.writes;
  std::sort(w.begin(), w.end(), [](const GmWrite& a, const GmWrite& b) { return a.begin < b.begin; });
  // Sweep: keep the write reaching furthest; any overlap with another core is a conflict.
  size_t reach = 0;
  for (size_t i = 1; i < w.size(); ++i) {
    if (w[i].begin < w[reach].end && w[i].core != w[reach].core) {
      const uintptr_t lo = w[i].begin, hi = std::min(w[i].end, w[reach].end);
      char msg[512];
      std::snprintf(msg, sizeof(msg),
                    "[EMU][%s][%s] cores %d (%s:%d) and %d (%s:%d) both write GM [%s, %s) in one launch: "
                    "the result depends on core timing (rule: %s)",
                    L.spec->name, L.kernel.c_str(), w[reach].core, w[reach].file, w[reach].line, w[i].core,
                    w[i].file, w[i].line, Hex(lo).c_str(), Hex(hi).c_str(), rule::kCrossCoreWrite);
      throw Violation(rule::kCrossCoreWrite, msg);
    }
    if (w[i].end > w[reach].end) reach = i;
  }
}

// Cores of one launch are not synchronised: a read of bytes another core wrote sees them or not by timing.
inline void CheckCrossCoreReads(LaunchState& L) {
  const auto& w = L.writes;  // sorted by begin (CheckCrossCoreWrites)
  std::vector<uintptr_t> reach(w.size());
  for (size_t i = 0; i < w.size(); ++i) reach[i] = std::max(w[i].end, i ? reach[i - 1] : uintptr_t{0});
  for (const GmWrite& r : L.reads) {
    size_t j = static_cast<size_t>(std::lower_bound(w.begin(), w.end(), r.end, [](const GmWrite& a, uintptr_t e) {
                                     return a.begin < e;
                                   }) - w.begin());
    while (j-- > 0 && reach[j] > r.begin) {
      if (w[j].end > r.begin && w[j].core != r.core) {
        char msg[512];
        std::snprintf(msg, sizeof(msg),
                      "[EMU][%s][%s] core %d reads GM [%s, %s) at %s:%d that core %d writes at %s:%d in the same "
                      "launch: what it sees depends on core timing (rule: %s)",
                      L.spec->name, L.kernel.c_str(), r.core, Hex(std::max(r.begin, w[j].begin)).c_str(),
                      Hex(std::min(r.end, w[j].end)).c_str(), r.file, r.line, w[j].core, w[j].file, w[j].line,
                      rule::kCrossCoreRead);
        throw Violation(rule::kCrossCoreRead, msg);
      }
    }
  }
}

inline void CheckGuards(const LaunchState& L) {
  for (const GuardedAlloc& a : GuardedAllocs()) {
    for (size_t k = 0; k < kGuardBytes; ++k) {
      const bool before = a.raw[k] != kGuardByte;
      const bool after = a.raw[kGuardBytes + a.bytes + k] != kGuardByte;
      if (before || after) {
        throw Violation(rule::kGmGuard, "[EMU][" + std::string(L.spec->name) + "][" + L.kernel +
                                            "] guard bytes " + (before ? "before" : "after") + " GM buffer '" +
                                            a.name + "' were overwritten (rule: " + rule::kGmGuard + ")");
      }
    }
  }
}

// Runs `body` once per core (it calls the kernel entry). Regions are the GM buffers the
// kernel may touch in addition to those from GmAlloc.
template <class Body>
LaunchReport Launch(const LaunchConfig& cfg, std::vector<GmRegion> regions, Body&& body) {
  const TargetSpec& spec = Spec(cfg.target);
  const Site site{__FILE__, __LINE__};
  LaunchState L;
  L.kernel = cfg.kernel;
  L.spec = &spec;
  for (const GuardedAlloc& a : GuardedAllocs()) {
    const uintptr_t b = reinterpret_cast<uintptr_t>(a.raw + kGuardBytes);
    regions.push_back({b, b + a.bytes, true, a.name});
  }
  L.regions = std::move(regions);
  g_launch = &L;
  struct Reset {
    ~Reset() {
      g_launch = nullptr;
      g_core = nullptr;
    }
  } reset;
  if (cfg.block_dim < 1 || cfg.block_dim > 65535) {
    Fail(rule::kLaunch, "Launch", site, "blockDim " + std::to_string(cfg.block_dim) + " outside [1, 65535]");
  }
  const uint32_t ub = cfg.ub_bytes == 0 ? spec.ub_bytes : cfg.ub_bytes;
  if (ub % 32 != 0 || ub > spec.ub_bytes) {
    Fail(rule::kLaunch, "Launch", site,
         "UB capacity " + std::to_string(ub) + " B must be a multiple of 32 and at most the " + spec.name +
             "'s " + std::to_string(spec.ub_bytes) + " B");
  }
  LaunchReport report;
  report.cores.resize(cfg.block_dim);
  report.order.resize(cfg.block_dim);
  std::iota(report.order.begin(), report.order.end(), 0);
  if (cfg.order == CoreOrder::kReverse) std::reverse(report.order.begin(), report.order.end());
  if (cfg.order == CoreOrder::kShuffled) {
    std::mt19937_64 rng(cfg.seed);
    std::shuffle(report.order.begin(), report.order.end(), rng);
  }
  for (int idx : report.order) {
    CoreCtx c;
    c.idx = idx;
    c.num = static_cast<int>(cfg.block_dim);
    c.spec = &spec;
    c.ub_bytes = ub;
    c.ub.assign(ub, 0xA5);
    c.shadow.assign(ub / 32, UbBlockShadow{});
    c.events.assign(kNumHardEvents, std::vector<EventSlot>(spec.num_event_ids));
    c.event_reserved.assign(kNumHardEvents, std::vector<bool>(spec.num_event_ids, false));
    c.atomic_add = cfg.atomic_add_on_entry;
    c.v_auto_sync = cfg.v_auto_sync;
    g_core = &c;
    body();
    CheckKernelEnd(c);
    report.cores[static_cast<size_t>(idx)] = c.stats;
    g_core = nullptr;
  }
  CheckCrossCoreWrites(L);
  CheckCrossCoreReads(L);
  CheckGuards(L);
  return report;
}

}  // namespace emu

#endif  // LMCACHE_NPU_EMU_RUNTIME_H_
