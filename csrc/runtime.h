// The streams, events and copies the copy engine orders its work with, behind one interface with
// three implementations: CUDA (runtime_cuda.cpp), synchronous host copies, and a simulated
// asynchronous runtime for tests without a GPU (runtime_sim.cpp). The engine's protocol is written once.
#pragma once

#include <ATen/core/ATen_fwd.h>  // at::Tensor, by reference only: no operator headers here
#include <c10/core/Stream.h>

#include <cstdint>
#include <memory>
#include <string>

#include "cuda_util.h"
#include "spill.h"

namespace ckpt_offload {

// Test-only protocol breaks (CKPT_OFFLOAD_TEST_BREAK): each disables one rule of the engine, so the
// simulated runtime can show that the rule is load-bearing. Honoured only by the simulated runtime.
enum class Break {
  kNone,
  kD2HWait,     // d2h_wait: the offload copy does not wait for the compute stream
  kReloadWait,  // reload_wait: the reload does not wait for its offload
  kLastUse,     // last_use: an offload copy does not wait for the last copy of a reused block
  kSourceWait,  // source_wait: a source is handed back without ordering its producer after its copy
  kFetchWait,   // fetch_wait: fetch does not make the compute stream wait for the reload
  kCopyError,   // copy_error: the simulated copy streams fail their third copy (error reporting)
  // The disk tier (spill.h; honoured by tiers made under the simulated runtime):
  kSpillWrite,  // spill_write: a written block goes back to the pool when its write is queued
  kSpillRead,   // spill_read: the reload of a spilled tensor does not wait for its read
  kSpillD2H,    // spill_d2h: a write does not wait for the offload copy that fills its block
};

// "off", "sync" or "async-sim": which runtime an engine of the CPU device gets, from the environment
// (CKPT_OFFLOAD_TEST_CPU, CKPT_OFFLOAD_TEST_ASYNC); read when an engine is created.
const char* test_path_from_env();
// CKPT_OFFLOAD_TEST_BREAK, parsed; raises ValueError on an unknown value.
Break break_from_env();

class CopyRuntime {
 public:
  virtual ~CopyRuntime() = default;
  virtual const char* name() const = 0;  // "cuda", "sync" or "async-sim"

  // The engine's own copy streams.
  const c10::Stream& d2h_stream() const { return d2h_; }
  const c10::Stream& h2d_stream() const { return h2d_; }
  // The compute stream of the caller: the current stream of the engine's device, looked up now.
  virtual c10::Stream current_stream() = 0;
  // Refuses work that cannot be ordered by events (CUDA graph capture); `what` names the operation.
  virtual void check_usable(const c10::Stream& compute, const char* what) { (void)compute, (void)what; }

  // An event at the present end of `stream`'s queue; a null one when it is complete at once and
  // `timing` is false. Timing events can be measured with elapsed_ms().
  virtual EventPtr record(const c10::Stream& stream, bool timing = false) = 0;
  // Makes `stream` wait for `event` without holding up the host where the runtime can (CUDA, the
  // simulated copy streams); the host thread itself waits where the stream is the host's.
  virtual void wait(const c10::Stream& stream, const EventPtr& event) = 0;
  // Queues a copy of nbytes on one of the copy streams; `handle` names the copy's handle in errors.
  virtual void copy(const c10::Stream& stream, void* dst, const void* src, size_t nbytes, uint64_t handle) = 0;
  virtual double elapsed_ms(const EventPtr& start, const EventPtr& end) = 0;
  // Timeline (timeline.h): when a completed timing event's point was reached, in nanoseconds of the
  // host's steady clock; -1 when that cannot be told (not complete, not a timing event, no anchor).
  virtual int64_t event_time_ns(const EventPtr& event) = 0;
  // Ties the device's event times to the host clock from now on (CUDA: a reference event after a
  // device synchronisation). The host and simulated runtimes stamp events with the host clock itself.
  virtual void anchor_clock() {}
  // Waits for everything queued on both copy streams (host synchronisation).
  virtual void synchronize() = 0;

  // Whether a source whose copy may still run can be handed back once its producer stream waits
  // for the copy: the memory then goes back to the allocator in that stream's order.
  virtual bool frees_in_stream_order(const at::Tensor& src) { return (void)src, true; }
  // Tells the allocator that `stream` used the source (a side-stream source's producer).
  virtual void record_use(const at::Tensor& src, const c10::Stream& stream) { (void)src, (void)stream; }

  // Hazard checks: only the simulated runtime knows what its queued copies read and write.
  // The engine is about to drop its reference to a source (whose copy must not be queued).
  virtual void check_source_release(const at::Tensor& src, uint64_t handle) { (void)src, (void)handle; }
  // Fetch is about to return memory a reload wrote.
  virtual void check_fetched(const void* ptr, size_t nbytes, uint64_t handle) { (void)ptr, (void)nbytes, (void)handle; }

 protected:
  c10::Stream d2h_ = c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU));
  c10::Stream h2d_ = c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU));
};

// The runtime of an engine on `device`: CUDA when the device is a usable CUDA device, the simulated
// one for the CPU under CKPT_OFFLOAD_TEST_CPU=1 and CKPT_OFFLOAD_TEST_ASYNC=1, else synchronous.
std::unique_ptr<CopyRuntime> make_runtime(const c10::Device& device, Break broken);
std::unique_ptr<CopyRuntime> make_sync_runtime(const c10::Device& device);
std::unique_ptr<CopyRuntime> make_sim_runtime(const c10::Device& device, Break broken);
// The simulated runtime's view of a disk tier's I/O: hazards for copies that touch pool memory a
// queued write or read uses, and for a write that starts before the copy filling its block ended.
std::shared_ptr<DiskObserver> make_sim_disk_observer();
// The random delay, in microseconds, of each simulated disk I/O: CKPT_OFFLOAD_TEST_DISK_MAX_US, else
// CKPT_OFFLOAD_TEST_ASYNC_MAX_US (default 200).
int64_t sim_disk_max_us();
uint64_t sim_seed();
#ifdef CKPT_OFFLOAD_WITH_CUDA
std::unique_ptr<CopyRuntime> make_cuda_runtime(const c10::Device& device);
#endif

}  // namespace ckpt_offload
