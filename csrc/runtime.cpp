// The test switches that choose a runtime, the choice itself, and the synchronous runtime: the host
// path, where every copy is done before the call returns and every event is complete.
#include "runtime.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

namespace ckpt_offload {

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

bool env_flag(const char* name) {
  const std::string v = env(name);
  TORCH_CHECK_VALUE(v.empty() || v == "0" || v == "1", name, " must be 0 or 1, got '", v, "'");
  return v == "1";
}

// Complete from birth; carries the time it was recorded for profiling.
class HostEvent : public Event {
 public:
  bool query() const override { return true; }
  void synchronize() const override {}
  const std::chrono::steady_clock::time_point when = std::chrono::steady_clock::now();
};

class SyncRuntime : public CopyRuntime {
 public:
  explicit SyncRuntime(const c10::Device& device) : device_(device) {
    d2h_ = h2d_ = c10::Stream(c10::Stream::DEFAULT, device);
  }
  const char* name() const override { return "sync"; }
  c10::Stream current_stream() override { return c10::Stream(c10::Stream::DEFAULT, device_); }
  EventPtr record(const c10::Stream&, bool timing) override {
    return timing ? std::make_shared<HostEvent>() : nullptr;
  }
  void wait(const c10::Stream&, const EventPtr& event) override {
    // Only a block last touched by another engine (a CUDA one sharing the pool) brings an event
    // that may still be running: everything here runs on the host, so the host waits.
    if (event) event->synchronize();
  }
  void copy(const c10::Stream&, void* dst, const void* src, size_t nbytes, uint64_t) override {
    std::memcpy(dst, src, nbytes);
  }
  double elapsed_ms(const EventPtr& start, const EventPtr& end) override {
    auto* a = dynamic_cast<const HostEvent*>(start.get());
    auto* b = dynamic_cast<const HostEvent*>(end.get());
    if (a == nullptr || b == nullptr) return 0.0;
    return std::chrono::duration<double, std::milli>(b->when - a->when).count();
  }
  int64_t event_time_ns(const EventPtr& event) override {
    auto* e = dynamic_cast<const HostEvent*>(event.get());
    if (e == nullptr) return -1;
    return std::chrono::duration_cast<std::chrono::nanoseconds>(e->when.time_since_epoch()).count();
  }
  void synchronize() override {}

 private:
  const c10::Device device_;
};

}  // namespace

const char* test_path_from_env() {
  const bool async = env_flag("CKPT_OFFLOAD_TEST_ASYNC");
  if (env("CKPT_OFFLOAD_TEST_CPU") != "1") return "off";
  return async ? "async-sim" : "sync";
}

Break break_from_env() {
  const std::string v = env("CKPT_OFFLOAD_TEST_BREAK");
  if (v.empty()) return Break::kNone;
  if (v == "d2h_wait") return Break::kD2HWait;
  if (v == "reload_wait") return Break::kReloadWait;
  if (v == "last_use") return Break::kLastUse;
  if (v == "source_wait") return Break::kSourceWait;
  if (v == "fetch_wait") return Break::kFetchWait;
  if (v == "copy_error") return Break::kCopyError;
  if (v == "spill_write") return Break::kSpillWrite;
  if (v == "spill_read") return Break::kSpillRead;
  if (v == "spill_d2h") return Break::kSpillD2H;
  TORCH_CHECK_VALUE(false, "CKPT_OFFLOAD_TEST_BREAK must be one of d2h_wait, reload_wait, last_use, source_wait, ",
                    "fetch_wait, copy_error, spill_write, spill_read, spill_d2h (or unset), got '", v, "'");
}

std::unique_ptr<CopyRuntime> make_sync_runtime(const c10::Device& device) {
  return std::make_unique<SyncRuntime>(device);
}

std::unique_ptr<CopyRuntime> make_runtime(const c10::Device& device, Break broken) {
  std::unique_ptr<CopyRuntime> rt;
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (device.is_cuda() && cuda_runtime_usable()) rt = make_cuda_runtime(device);
#endif
  if (!rt && device.is_cpu() && std::strcmp(test_path_from_env(), "async-sim") == 0) {
    rt = make_sim_runtime(device, broken);
  }
  if (!rt) rt = make_sync_runtime(device);
  // A broken protocol on real streams would corrupt data instead of reporting it.
  TORCH_CHECK_VALUE(broken == Break::kNone || std::strcmp(rt->name(), "async-sim") == 0,
                    "CopyEngine(", device, "): CKPT_OFFLOAD_TEST_BREAK is a testing aid of the simulated runtime; ",
                    "set CKPT_OFFLOAD_TEST_CPU=1 and CKPT_OFFLOAD_TEST_ASYNC=1 with it, or unset it");
  return rt;
}

}  // namespace ckpt_offload
