// The simulated asynchronous runtime (CKPT_OFFLOAD_TEST_CPU=1 with CKPT_OFFLOAD_TEST_ASYNC=1): each
// copy stream is a worker thread that runs its queue in order, each copy after a seeded random
// delay; events follow CUDA's semantics; the compute stream is the calling thread. It knows which
// queued copy reads and writes which bytes, and raises on every copy the protocol leaves unordered.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <list>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "runtime.h"

namespace ckpt_offload {

namespace {

// What a stream is known to have waited for: stream key -> the last position of that stream
// (copies numbered from 1 per stream) that is ordered before it.
using Clock = std::map<uint64_t, uint64_t>;

void merge(Clock& into, const Clock& from) {
  for (const auto& kv : from) into[kv.first] = std::max(into[kv.first], kv.second);
}

uint64_t known(const Clock& c, uint64_t key) {
  auto it = c.find(key);
  return it == c.end() ? 0 : it->second;
}

struct SimCopy {
  uint64_t stream_key;
  uint64_t pos;
  bool d2h;
  char* dst;
  const char* src;
  size_t nbytes;
  uint64_t handle;
};

bool overlap(const void* a, size_t an, const void* b, size_t bn) {
  auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return an > 0 && bn > 0 && pa < pb + bn && pb < pa + an;
}

// A disk tier's queued write (the disk reads the block) or read (the disk writes it).
struct SimDiskIO {
  uint64_t io;
  const char* ptr;
  size_t nbytes;
  bool write;
  uint64_t handle;
};

// One lock for every simulated runtime: events and pool blocks cross engines (two engines share
// the process-wide pool), so the copies in flight are known process-wide.
struct SimState {
  std::mutex mu;
  std::condition_variable done_cv;  // an event completed or a copy finished
  std::list<std::shared_ptr<SimCopy>> in_flight;
  std::list<SimDiskIO> disk;         // queued or running disk I/O
  std::exception_ptr disk_hazard;    // found on a disk worker; raised by the next engine call
  uint64_t next_key = 1;
  uint64_t next_runtime = 0;
};

SimState& state() {
  static auto* s = new SimState();  // leaked: workers of process-wide engines outlive static destructors
  return *s;
}

class SimEvent : public Event {
 public:
  bool query() const override { return done_.load(std::memory_order_acquire); }
  void synchronize() const override {
    if (query()) return;
    std::unique_lock<std::mutex> lock(state().mu);
    state().done_cv.wait(lock, [this] { return query(); });
  }
  void complete() {  // caller holds state().mu
    when = std::chrono::steady_clock::now();
    done_.store(true, std::memory_order_release);
  }
  Clock clock;  // what a wait on this event orders the waiting stream after (under state().mu)
  std::chrono::steady_clock::time_point when;

 private:
  std::atomic<bool> done_{false};
};

// The calling thread as a compute stream: its position advances each time an engine operation
// looks it up (SimRuntime::current_stream).
struct ComputeThread {
  uint64_t key;
  uint64_t pos = 0;
};

ComputeThread& compute_thread() {  // caller holds state().mu
  thread_local ComputeThread t{state().next_key++};
  return t;
}

std::string handle_name(uint64_t id) { return "handle #" + std::to_string(id); }

[[noreturn]] void hazard(const std::string& what, uint64_t handle, const std::string& detail) {
  TORCH_CHECK(false, "ckpt_offload hazard (async-sim): ", what, ": ", handle_name(handle), "; ", detail);
}

class SimRuntime : public CopyRuntime {
 public:
  SimRuntime(const c10::Device& device, Break broken) : device_(device), broken_(broken) {
    const char* max_us = std::getenv("CKPT_OFFLOAD_TEST_ASYNC_MAX_US");
    const char* seed = std::getenv("CKPT_OFFLOAD_TEST_SEED");
    max_us_ = parse(max_us, "CKPT_OFFLOAD_TEST_ASYNC_MAX_US", 200);
    const int64_t seed_value = parse(seed, "CKPT_OFFLOAD_TEST_SEED", 0);
    uint64_t serial = 0;
    {
      std::lock_guard<std::mutex> lock(state().mu);
      serial = state().next_runtime++;
      for (Stream* s : {&streams_[0], &streams_[1]}) s->key = state().next_key++;
    }
    streams_[0].d2h = true;
    streams_[0].name = "D2H";
    streams_[1].name = "H2D";
    for (int i = 0; i < 2; ++i) {
      // Seeded per engine (in creation order) and stream: a run's delays repeat with its seed.
      streams_[i].rng.seed(static_cast<uint64_t>(seed_value) * 1000003ULL + serial * 2 + i);
    }
    d2h_ = c10::Stream(c10::Stream::UNSAFE, device, static_cast<c10::StreamId>(streams_[0].key));
    h2d_ = c10::Stream(c10::Stream::UNSAFE, device, static_cast<c10::StreamId>(streams_[1].key));
    for (Stream& s : streams_) s.worker = std::thread([this, &s] { run(s); });
  }

  ~SimRuntime() override {
    for (Stream& s : streams_) {
      {
        std::lock_guard<std::mutex> lock(state().mu);
        s.stop = true;  // the worker drains its queue first
      }
      s.cv.notify_all();
    }
    for (Stream& s : streams_) s.worker.join();
    if (error_) {
      try {
        std::rethrow_exception(error_);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ckpt_offload warning: an unreported simulated copy error: %s\n", e.what());
      }
    }
  }

  const char* name() const override { return "async-sim"; }

  // Every engine operation looks the compute stream up first: in the simulation that is the moment
  // its position advances, as whatever the thread did since its last call is compute work that a
  // copy touching device memory must be ordered after.
  // Errors of the workers are raised here too: at the start of an operation, before it queues anything.
  c10::Stream current_stream() override {
    rethrow_worker_error();
    std::lock_guard<std::mutex> lock(state().mu);
    compute_thread().pos += 1;
    return c10::Stream(c10::Stream::DEFAULT, device_);
  }

  EventPtr record(const c10::Stream& stream, bool) override {
    auto e = std::make_shared<SimEvent>();
    std::lock_guard<std::mutex> lock(state().mu);
    if (is_compute(stream)) {
      // The calling thread has done everything it queued: complete at once.
      const ComputeThread& t = compute_thread();
      e->clock[t.key] = t.pos;
      e->complete();
      return e;
    }
    Stream& s = of(stream);
    e->clock = s.clock;
    e->clock[s.key] = s.pos;
    s.queue.push_back(Op{Op::kRecord, e, nullptr});
    s.cv.notify_one();
    return e;
  }

  void wait(const c10::Stream& stream, const EventPtr& event) override {
    if (!event) return;
    if (is_compute(stream)) {
      event->synchronize();  // the compute stream is this thread: it waits itself
      rethrow_worker_error();
      return;
    }
    std::lock_guard<std::mutex> lock(state().mu);
    Stream& s = of(stream);
    if (auto* e = dynamic_cast<const SimEvent*>(event.get())) merge(s.clock, e->clock);
    s.queue.push_back(Op{Op::kWait, event, nullptr});
    s.cv.notify_one();
  }

  void copy(const c10::Stream& stream, void* dst, const void* src, size_t nbytes, uint64_t handle) override {
    std::lock_guard<std::mutex> lock(state().mu);
    Stream& s = of(stream);
    auto c = std::make_shared<SimCopy>(
        SimCopy{s.key, 0, s.d2h, static_cast<char*>(dst), static_cast<const char*>(src), nbytes, handle});
    // Device memory (a D2H copy's source, a reload's destination) belongs to the compute stream: the
    // copy must be ordered after everything the caller queued there so far.
    const ComputeThread& t = compute_thread();
    if (known(s.clock, t.key) < t.pos) {
      hazard(s.d2h ? "offload copy queued without waiting for the compute stream (its source may not be written yet)"
                   : "reload queued without waiting for the compute stream (its destination may still be in use)",
             handle, describe(*c));
    }
    for (const auto& y : state().in_flight) {
      if (y->stream_key == s.key || known(s.clock, y->stream_key) >= y->pos) continue;  // ordered before
      const bool writes_read = overlap(c->dst, nbytes, y->src, y->nbytes);
      const bool writes_written = overlap(c->dst, nbytes, y->dst, y->nbytes);
      const bool reads_written = overlap(c->src, nbytes, y->dst, y->nbytes);
      if (!writes_read && !writes_written && !reads_written) continue;
      const char* what = "copy queued while an unordered queued copy still uses its memory";
      if (c->d2h && writes_read) {
        what = "pool block handed to a writer while a queued copy still reads it";
      } else if (c->d2h && writes_written) {
        what = "pool block handed to a writer while a queued copy still writes it";
      } else if (!c->d2h && reads_written && y->d2h) {
        what = "reload queued before its offload's event";
      }
      hazard(what, handle, describe(*c) + " conflicts with the queued " + describe(*y));
    }
    for (const auto& io : state().disk) {
      const bool writes_block = overlap(c->dst, nbytes, io.ptr, io.nbytes);
      const bool reads_block = overlap(c->src, nbytes, io.ptr, io.nbytes);
      if (!writes_block && !reads_block) continue;
      const std::string detail = describe(*c) + " conflicts with the queued disk " + (io.write ? "write" : "read") +
                                 " of " + std::to_string(io.nbytes) + " bytes of " + handle_name(io.handle);
      if (c->d2h && writes_block && io.write) hazard("pool block handed to a writer while its disk write is queued",
                                                      handle, detail);
      if (!c->d2h && reads_block && !io.write) hazard("reload queued before its disk read completed", handle, detail);
      if (writes_block || !io.write) hazard("copy queued while a disk I/O still uses its memory", handle, detail);
    }
    c->pos = ++s.pos;
    state().in_flight.push_back(c);
    s.queue.push_back(Op{Op::kCopy, nullptr, c});
    s.cv.notify_one();
  }

  double elapsed_ms(const EventPtr& start, const EventPtr& end) override {
    auto* a = dynamic_cast<const SimEvent*>(start.get());
    auto* b = dynamic_cast<const SimEvent*>(end.get());
    if (a == nullptr || b == nullptr || !a->query() || !b->query()) return 0.0;
    return std::chrono::duration<double, std::milli>(b->when - a->when).count();
  }

  // Compute-stream events complete when recorded; copy-stream events when their worker reaches them:
  // the simulated streams stamp the timeline themselves.
  int64_t event_time_ns(const EventPtr& event) override {
    auto* e = dynamic_cast<const SimEvent*>(event.get());
    if (e == nullptr || !e->query()) return -1;
    return std::chrono::duration_cast<std::chrono::nanoseconds>(e->when.time_since_epoch()).count();
  }

  void synchronize() override {
    EventPtr d = record(d2h_, false), h = record(h2d_, false);
    d->synchronize();
    h->synchronize();
    rethrow_worker_error();
  }

  // Whether the engine's reference is the last one cannot be told reliably (Python may keep the
  // tensor alive, or a dead Python object may still hold it): dropping it while the copy is queued
  // is a hazard either way, as the engine cannot know that someone else keeps the memory. Only this
  // handle's own copies count: another handle's queued copy of the same memory holds a reference
  // of its own (on a GPU the copy engine's), checked when that one is released.
  void check_source_release(const at::Tensor& src, uint64_t handle) override {
    if (!src.has_storage()) return;
    const c10::Storage& storage = src.storage();
    std::lock_guard<std::mutex> lock(state().mu);
    for (const auto& y : state().in_flight) {
      if (y->handle == handle && overlap(storage.data(), storage.nbytes(), y->src, y->nbytes)) {
        hazard("source memory released while its copy is queued", handle, "the queued " + describe(*y));
      }
    }
  }

  void check_fetched(const void* ptr, size_t nbytes, uint64_t handle) override {
    std::lock_guard<std::mutex> lock(state().mu);
    for (const auto& y : state().in_flight) {
      if (overlap(ptr, nbytes, y->dst, y->nbytes)) {
        hazard("tensor returned by fetch before its reload completed", handle, "the queued " + describe(*y));
      }
    }
  }

 private:
  struct Op {
    enum Kind { kWait, kRecord, kCopy } kind;
    EventPtr event;
    std::shared_ptr<SimCopy> copy;
  };
  struct Stream {
    uint64_t key = 0;
    bool d2h = false;
    const char* name = "";
    // Enqueue side, under state().mu: copies queued so far, and what the queue waited for.
    uint64_t pos = 0;
    Clock clock;
    std::deque<Op> queue;
    bool stop = false;
    std::condition_variable cv;
    std::mt19937_64 rng;  // only the worker draws from it
    std::thread worker;
  };

  static int64_t parse(const char* v, const char* name, int64_t fallback) {
    if (v == nullptr || *v == '\0') return fallback;
    char* end = nullptr;
    const long long x = std::strtoll(v, &end, 10);
    TORCH_CHECK_VALUE(*end == '\0' && x >= 0, name, " must be a non-negative integer, got '", v, "'");
    return x;
  }

  bool is_compute(const c10::Stream& s) const { return s.id() != d2h_.id() && s.id() != h2d_.id(); }

  Stream& of(const c10::Stream& s) { return s.id() == d2h_.id() ? streams_[0] : streams_[1]; }

  std::string describe(const SimCopy& c) const {
    std::ostringstream out;
    out << (c.d2h ? "offload" : "reload") << " copy of " << c.nbytes << " bytes of " << handle_name(c.handle);
    return out.str();
  }

  void rethrow_worker_error() {
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lock(state().mu);
      std::swap(e, error_);
      if (!e) std::swap(e, state().disk_hazard);
    }
    if (e) std::rethrow_exception(e);
  }

  void run(Stream& s) {
    std::uniform_int_distribution<int64_t> delay(0, max_us_);
    std::unique_lock<std::mutex> lock(state().mu);
    for (;;) {
      s.cv.wait(lock, [&s] { return s.stop || !s.queue.empty(); });
      if (s.queue.empty()) return;  // stopped and drained
      Op op = std::move(s.queue.front());
      s.queue.pop_front();
      if (op.kind == Op::kRecord) {
        static_cast<SimEvent&>(*op.event).complete();
        state().done_cv.notify_all();
        continue;
      }
      lock.unlock();
      if (op.kind == Op::kWait) {
        op.event->synchronize();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(delay(s.rng)));
        try {
          const bool inject = broken_ == Break::kCopyError && ++copies_ == 3;
          TORCH_CHECK(!inject, "ckpt_offload (async-sim): the simulated ", s.name, " stream failed its copy of ",
                      handle_name(op.copy->handle), " (CKPT_OFFLOAD_TEST_BREAK=copy_error)");
          std::memcpy(op.copy->dst, op.copy->src, op.copy->nbytes);
        } catch (...) {
          std::lock_guard<std::mutex> relock(state().mu);
          if (!error_) error_ = std::current_exception();  // raised on the next call of the engine's caller
        }
      }
      lock.lock();
      if (op.kind == Op::kCopy) {
        state().in_flight.remove(op.copy);
        state().done_cv.notify_all();
      }
    }
  }

  const c10::Device device_;
  const Break broken_;
  int64_t max_us_ = 200;
  std::atomic<int> copies_{0};
  std::exception_ptr error_;  // under state().mu
  Stream streams_[2];
};

// Records the disk tier's I/O in the process-wide state the copies are checked against.
class SimDiskObserver : public DiskObserver {
 public:
  void queued(uint64_t io, const void* ptr, size_t n, bool write, uint64_t handle) override {
    std::lock_guard<std::mutex> lock(state().mu);
    state().disk.push_back(SimDiskIO{io, static_cast<const char*>(ptr), n, write, handle});
  }
  void started(uint64_t io) override {
    std::lock_guard<std::mutex> lock(state().mu);
    for (const auto& d : state().disk) {
      if (d.io != io || !d.write) continue;
      for (const auto& y : state().in_flight) {
        if (!overlap(d.ptr, d.nbytes, y->dst, y->nbytes)) continue;
        try {
          hazard("disk write started before the offload copy into its block completed", d.handle,
                 "the queued offload copy of " + std::to_string(y->nbytes) + " bytes of " + handle_name(y->handle));
        } catch (...) {
          if (!state().disk_hazard) state().disk_hazard = std::current_exception();
          throw;  // the write fails too: it would have read a block still being filled
        }
      }
    }
  }
  void finished(uint64_t io) override {
    std::lock_guard<std::mutex> lock(state().mu);
    state().disk.remove_if([io](const SimDiskIO& d) { return d.io == io; });
  }
};

int64_t env_us(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && x >= 0, name, " must be a non-negative integer, got '", v, "'");
  return x;
}

}  // namespace

std::shared_ptr<DiskObserver> make_sim_disk_observer() { return std::make_shared<SimDiskObserver>(); }

int64_t sim_disk_max_us() {
  return env_us("CKPT_OFFLOAD_TEST_DISK_MAX_US", env_us("CKPT_OFFLOAD_TEST_ASYNC_MAX_US", 200));
}

uint64_t sim_seed() { return static_cast<uint64_t>(env_us("CKPT_OFFLOAD_TEST_SEED", 0)); }

std::unique_ptr<CopyRuntime> make_sim_runtime(const c10::Device& device, Break broken) {
  return std::make_unique<SimRuntime>(device, broken);
}

}  // namespace ckpt_offload
