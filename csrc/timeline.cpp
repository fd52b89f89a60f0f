// The timeline recorder: a ring buffer of records under one lock, touched only while a timeline records;
// times are resolved through each record's runtime when recording stops.
#include "timeline.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <utility>

namespace ckpt_offload {

const char* timeline_kind_name(TimelineKind k) {
  switch (k) {
    case TimelineKind::kD2H:
      return "d2h";
    case TimelineKind::kH2D:
      return "h2d";
    case TimelineKind::kWait:
      return "wait";
    case TimelineKind::kAlloc:
      return "alloc";
    case TimelineKind::kMark:
      return "mark";
  }
  return "unknown";
}

namespace timeline {

std::atomic<bool> g_recording{false};

namespace {

struct Ring {
  std::mutex mu;
  std::vector<TimelineRecord> records;
  size_t capacity = 0;
  size_t next = 0;  // where the next record goes once the ring is full
  uint64_t dropped = 0;
};

Ring& ring() {
  static auto* r = new Ring();  // leaked: records may arrive from engine threads during exit
  return *r;
}

}  // namespace

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void start(size_t capacity) {
  TORCH_CHECK_VALUE(capacity > 0, "timeline: capacity must be >= 1, got ", capacity);
  std::vector<TimelineRecord> old;
  Ring& r = ring();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    TORCH_CHECK(!g_recording.load(), "timeline: a timeline is already recording; stop it first");
    old.swap(r.records);
    r.records.reserve(std::min<size_t>(capacity, 4096));
    r.capacity = capacity;
    r.next = 0;
    r.dropped = 0;
    g_recording.store(true);
  }
}

namespace {
thread_local DeferEvictions* t_defer = nullptr;
}  // namespace

DeferEvictions::DeferEvictions() : outer_(t_defer) { t_defer = this; }

DeferEvictions::~DeferEvictions() {
  t_defer = outer_;
  records_.clear();  // here, after the caller's locks (declared after this) were released
}

void add(TimelineRecord rec) {
  Ring& r = ring();
  TimelineRecord old;  // an overwritten record dies after the lock is released (it may hold an engine)
  std::lock_guard<std::mutex> lock(r.mu);
  if (!g_recording.load()) return;  // stopped between the caller's check and now
  if (r.records.size() < r.capacity) {
    r.records.push_back(std::move(rec));
    return;
  }
  if (t_defer != nullptr) {
    t_defer->records_.push_back(std::move(r.records[r.next]));  // dies with the caller's DeferEvictions
  } else {
    old = std::move(r.records[r.next]);
  }
  r.records[r.next] = std::move(rec);
  r.next = (r.next + 1) % r.capacity;
  r.dropped += 1;
}

void mark_host(uint32_t phase, uint64_t key) {
  if (!recording()) return;
  TimelineRecord rec;
  rec.kind = TimelineKind::kMark;
  rec.id = key;
  rec.flags = phase;
  rec.queued_ns = rec.start_ns = rec.end_ns = now_ns();
  add(std::move(rec));
}

std::vector<TimelineEntry> stop(uint64_t& dropped) {
  std::vector<TimelineRecord> records;
  Ring& r = ring();
  size_t next = 0;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    g_recording.store(false);
    records.swap(r.records);
    next = r.next;  // the oldest record once the ring has wrapped, else 0
    dropped = r.dropped;
  }
  std::vector<TimelineEntry> out;
  out.reserve(records.size());
  for (size_t i = 0; i < records.size(); ++i) {
    const TimelineRecord& rec = records[(next + i) % records.size()];  // oldest first
    TimelineEntry e{timeline_kind_name(rec.kind), rec.device.str(), rec.id, rec.bytes, rec.flags,
                    rec.queued_ns, rec.start_ns, rec.end_ns, rec.same_stream};
    if (rec.rt != nullptr && rec.start) {
      e.start_ns = rec.rt->event_time_ns(rec.start);
      e.end_ns = rec.end ? rec.rt->event_time_ns(rec.end) : e.start_ns;
    }
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace timeline
}  // namespace ckpt_offload
