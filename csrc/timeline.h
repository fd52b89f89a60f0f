// The timeline recorder behind ckpt_offload.timeline(): while it records, the copy engine appends one
// record per copy, reload wait and pinned allocation, and the Python layer one per layer mark, to a ring
// buffer. Times come from the runtime's own events (CUDA events, the simulated streams, the host clock).
#pragma once

#include <c10/core/Device.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime.h"

namespace ckpt_offload {

enum class TimelineKind : uint8_t { kD2H, kH2D, kWait, kAlloc, kMark };
const char* timeline_kind_name(TimelineKind k);

// A reload wait whose copy was queued by the fetch itself (nothing prefetched it).
constexpr uint32_t kTimelineOnDemand = 1;
// Not a reload wait: the stream that produced a source waits for its offload copy before the source
// goes back to the allocator (CopyEngine::release_sources).
constexpr uint32_t kTimelineSourceWait = 2;

struct TimelineRecord {
  TimelineKind kind = TimelineKind::kMark;
  uint64_t id = 0;     // the handle of a copy, wait or allocation; the caller's key for a mark
  uint64_t bytes = 0;  // copied, or allocated
  uint32_t flags = 0;  // waits: kTimelineOnDemand or kTimelineSourceWait; marks: the caller's phase
  int64_t queued_ns = 0;                // host clock: when the host queued the work
  int64_t start_ns = -1, end_ns = -1;   // host-stamped records; the others are resolved from the events
  EventPtr start, end;                  // timing events of `rt` (end is null for a mark)
  std::shared_ptr<const void> owner;    // keeps `rt` alive until the record is resolved
  CopyRuntime* rt = nullptr;
  c10::Device device = c10::Device(c10::kCPU);
  bool same_stream = false;  // a copy that ran on the compute stream itself (the synchronous runtime)
};

// A record with its times resolved, in nanoseconds of the host's steady clock.
struct TimelineEntry {
  std::string kind, device;
  uint64_t id, bytes;
  uint32_t flags;
  int64_t queued_ns, start_ns, end_ns;  // -1 where the event had not completed
  bool same_stream;
};

namespace timeline {

extern std::atomic<bool> g_recording;
// The one check the hot path makes: an atomic load.
inline bool recording() { return g_recording.load(std::memory_order_relaxed); }
// The host clock every record is stamped in (std::chrono::steady_clock).
int64_t now_ns();
// Starts recording into a fresh ring of `capacity` records (the oldest are overwritten beyond it).
void start(size_t capacity);
// Appends a record while recording; dropped otherwise.
void add(TimelineRecord r);

// While one lives on this thread, the records the ring overwrites are destroyed when it goes, not in
// add(). An old record may hold the last reference to another engine, whose destruction can take the
// GIL: a caller that holds an engine's lock (GIL released) declares one before taking it, so that
// the records die after the lock is released (no GIL-against-mutex deadlock).
class DeferEvictions {
 public:
  DeferEvictions();
  ~DeferEvictions();
  DeferEvictions(const DeferEvictions&) = delete;
  DeferEvictions& operator=(const DeferEvictions&) = delete;

 private:
  friend void add(TimelineRecord r);
  DeferEvictions* outer_;
  std::vector<TimelineRecord> records_;
};
// A mark stamped with the host clock (no device stream to record it on).
void mark_host(uint32_t phase, uint64_t key);
// Stops recording and resolves every record, oldest first; `dropped` counts records overwritten.
// The caller waits for the streams first, so that the events have completed.
std::vector<TimelineEntry> stop(uint64_t& dropped);

}  // namespace timeline
}  // namespace ckpt_offload
