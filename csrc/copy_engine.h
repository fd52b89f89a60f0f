// The copy engine: moves a tensor into a pool block on its own device-to-host stream and back on
// its own host-to-device stream, ordered against the compute stream with events only. The streams
// and events come from a CopyRuntime (runtime.h): CUDA, host-synchronous, or simulated.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "host_pool.h"
#include "runtime.h"
#include "spill.h"
#include "timeline.h"

namespace ckpt_offload {

// kOnDisk: the pool block was written to a file of the pool's disk tier (or is being written).
enum class HandleState { kOffloading, kOnHost, kPrefetching, kFetched, kReleased, kOnDisk };
const char* state_name(HandleState s);

struct EngineStats {
  uint64_t tensors_offloaded = 0;
  uint64_t bytes_offloaded = 0;   // device (or test-path) to host
  uint64_t tensors_prefetched = 0;
  uint64_t bytes_prefetched = 0;  // host to device
  uint64_t tensors_fetched = 0;
  uint64_t reloads_on_demand = 0;  // fetches whose reload had not been started ahead (no prefetch)
  uint64_t tensors_released = 0;  // handles given up without a fetch
  uint64_t offloads_refused = 0;  // the pool refused a block (cap or system): caller keeps the tensor
  uint64_t compacted = 0;         // non-contiguous inputs with gaps copied densely first
  uint64_t pending_sources = 0;   // sources still referenced because their copy may not have finished
  double reload_wait_ms = 0.0;    // compute-stream time spent waiting for reloads (profiling only)
  uint64_t reload_waits_measured = 0;
  // Profiling only: time the copies themselves took on their copy streams (events around each
  // copy, after its waits), and the bytes of the copies measured; bytes / time is the throughput.
  double d2h_copy_ms = 0.0;
  uint64_t d2h_bytes_timed = 0;
  uint64_t d2h_copies_timed = 0;
  double h2d_copy_ms = 0.0;
  uint64_t h2d_bytes_timed = 0;
  uint64_t h2d_copies_timed = 0;
};

class CopyEngine;

class OffloadHandle {
 public:
  ~OffloadHandle();
  OffloadHandle(const OffloadHandle&) = delete;
  OffloadHandle& operator=(const OffloadHandle&) = delete;

  HandleState state();
  size_t nbytes() const { return nbytes_; }
  const std::vector<int64_t>& sizes() const { return sizes_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  at::ScalarType dtype() const { return dtype_; }
  c10::Device device() const { return device_; }
  // True when the input had gaps (a strided slice) and came back contiguous with the same values.
  bool compacted() const { return compacted_; }
  // A process-wide serial number: what errors (the simulated runtime's hazards) name.
  uint64_t id() const { return id_; }
  // The offloaded tensor's version counter, read now (0 where it has none): saved-tensor hooks
  // switch autograd's in-place check off, and the session redoes it with this.
  uint32_t source_version() const { return version_.enabled() ? version_.current_version() : 0; }
  // The address of the copied tensor's storage (0 without one): no other storage takes it while
  // the handle lives, for the handle holds it weakly.
  intptr_t storage_key() const {
    return storage_ ? reinterpret_cast<intptr_t>(storage_->_unsafe_get_target()) : 0;
  }
  // The host copy as a uint8 CPU tensor (None-like undefined tensor when not on host), once the
  // copy to the host has completed (a host wait). Testing aid.
  at::Tensor host_bytes();

 private:
  friend class CopyEngine;
  explicit OffloadHandle(std::shared_ptr<CopyEngine> engine);

  std::shared_ptr<CopyEngine> engine_;
  const uint64_t id_;
  c10::VariableVersion version_;  // the offloaded tensor's (shared with its views)
  // Its storage, weakly: while the handle lives, no other storage can take that storage's address,
  // the key (storage_key) the session finds copies of the same storage by.
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage_;
  at::ScalarType dtype_ = at::kByte;
  c10::Device device_ = c10::Device(c10::kCPU);
  std::vector<int64_t> sizes_, strides_;
  int64_t span_elems_ = 0;
  size_t nbytes_ = 0;
  bool compacted_ = false;
  bool dense_ = false;  // contiguous over its span: a reload is allocated in its shape, no view over a span
  bool fetched_ = false;  // fetched at least once (with keep_host): its release is no "release unfetched"
  HandleState state_ = HandleState::kOnHost;
  std::shared_ptr<HostBlock> block_;
  EventPtr d2h_done_;
  EventPtr h2d_done_;
  at::Tensor dest_;                    // device span while prefetching
  c10::Stream dest_stream_ = c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU));
  // On disk: the file, the write or read on it (queued, running or done), and the tier doing it.
  std::shared_ptr<SpillFile> file_;
  SpillJobPtr disk_job_;
  std::shared_ptr<SpillTier> tier_;
};

using HandlePtr = std::shared_ptr<OffloadHandle>;

class CopyEngine : public std::enable_shared_from_this<CopyEngine> {
 public:
  static std::shared_ptr<CopyEngine> create(c10::Device device, std::shared_ptr<HostPool> pool);
  // The process-wide engine of a device, sharing the process-wide pool.
  static std::shared_ptr<CopyEngine> for_device(c10::Device device);
  static std::vector<std::shared_ptr<CopyEngine>> all_engines();
  static std::shared_ptr<HostPool> global_pool();
  static void set_profiling(bool on);
  static bool profiling();
  static c10::Device with_index(c10::Device device);
  ~CopyEngine();

  // Starts the copy to host and returns at once; nullptr when the pool refused a block.
  HandlePtr offload(const at::Tensor& tensor);
  // Starts the copy back to the device on the H2D stream. Idempotent.
  void prefetch(const HandlePtr& h);
  // Makes the current stream wait for the copy back and returns the tensor (same dtype, shape
  // and strides; contiguous strides when compacted()). keep_host: the handle keeps its host copy
  // and goes back to on_host, to be reloaded again (a graph kept for another backward); else the
  // block goes back to the pool.
  at::Tensor fetch(const HandlePtr& h, bool keep_host = false);
  // Gives everything back without fetching. Idempotent.
  void release(const HandlePtr& h);
  // A spilled handle: starts reading its file back into a pool block if the pool has one within its
  // cap (the disk stage, started layers ahead of prefetch). Does nothing for other handles. False
  // when it could not start for want of a block within the cap (ask again later).
  bool read_ahead(const HandlePtr& h);
  // Drops sources whose device-to-host copy has completed; returns how many are still pending.
  size_t poll();
  // Hands sources back to the allocator, all but those with fewer than `keep_bytes` of later copies
  // queued after them: finished ones at once, unfinished ones after making the stream that
  // produced them wait for their copy (no host wait). The allocator may then reuse that memory at
  // once, in that stream's order, after the copy. Returns how many are still held.
  size_t release_sources(size_t keep_bytes = 0);
  // offload() hands back by itself every source with at least this many bytes of copies queued
  // after it: the compute stream has produced those bytes since, so the wait it is given for the
  // source's copy seldom stalls it (64 MiB is about 2.5 ms of copying at 25 GB/s), and the device
  // memory held this way stays within this bound plus the newest source. It matters where one
  // context covers a whole forward (offload_activations, ~17 saved tensors a Llama layer); the
  // session hands back the rest when a layer's forward ends (OffloadSession.hooks()).
  static constexpr size_t kHandBackBytes = size_t{64} << 20;
  // Waits for every copy this engine queued (host synchronisation: not for the step's hot path).
  void synchronize();

  EngineStats stats();
  void reset_stats();
  c10::Device device() const { return device_; }
  const std::shared_ptr<HostPool>& pool() const { return pool_; }
  bool uses_cuda() const { return cuda_; }
  // "cuda", "sync" or "async-sim"
  const char* runtime_name() const { return rt_->name(); }
  // Timeline: a point on the caller's current stream (a layer's start or end), recorded while a
  // timeline records; ties this device's event times to the host clock (at each timeline start).
  void timeline_mark(uint32_t phase, uint64_t key);
  void anchor_timeline() { rt_->anchor_clock(); }

 private:
  CopyEngine(c10::Device device, std::shared_ptr<HostPool> pool);
  friend class OffloadHandle;
  // Releases under the lock and hands back what must be destroyed after unlocking: dropping a
  // tensor can take the GIL, which another thread may hold while waiting for this lock.
  void release_locked(OffloadHandle& h, std::vector<at::Tensor>& garbage);
  void prefetch_locked(OffloadHandle& h, at::Tensor fresh);
  at::Tensor allocate_dest(const OffloadHandle& h);
  at::Tensor lock_with_dest(const OffloadHandle& h, std::unique_lock<std::mutex>& lock);
  void poll_locked(std::vector<at::Tensor>& garbage);
  void release_sources_locked(size_t keep_bytes, std::vector<at::Tensor>& garbage);
  bool broken(Break b) const { return broken_ == b; }
  void refresh_state_locked(OffloadHandle& h);
  void fold_samples_locked();
  // The disk tier (spill.h). When the pool's cap refuses a block, the oldest handles still holding
  // one (the earliest layers: backward needs them last) are written to files and their blocks reused.
  std::shared_ptr<HostBlock> acquire_spilling(size_t nbytes);
  void spill_ahead(size_t nbytes);  // starts writes before the cap refuses (SpillTier::spill_ahead)
  void prune_writes_locked();       // drops finished writes, warning of a failed one
  // Handles looked at are appended to keep, which the caller destroys after unlocking.
  SpillJobPtr evict_locked(const std::shared_ptr<SpillTier>& tier, size_t nbytes, std::vector<HandlePtr>& keep);
  void settle_write_locked(OffloadHandle& h);  // a finished write: on disk, or back on host if it failed
  bool start_read(const HandlePtr& h, bool must);
  void bring_back(const HandlePtr& h);  // on disk -> on host, waiting on the host for the read

  const c10::Device device_;
  const std::shared_ptr<HostPool> pool_;
  const Break broken_;  // CKPT_OFFLOAD_TEST_BREAK (simulated runtime only)
  const std::unique_ptr<CopyRuntime> rt_;
  const bool cuda_;
  // Never held while waiting for the GIL, so a thread that holds the GIL may wait for it
  // (~OffloadHandle, run when Python drops a handle): under it nothing allocates (lock_with_dest)
  // and no tensor is destroyed (garbage vectors, emptied after unlocking); it covers only state,
  // events, copy launches and counters, none of which reach Python.
  std::mutex mu_;
  struct PendingSource {
    EventPtr done;
    at::Tensor tensor;
    c10::Stream stream;  // the stream current at offload: the one that produced it
    uint64_t handle;
    uint64_t queued_end;  // queued_bytes_ once its copy was queued
  };
  std::deque<PendingSource> pending_;
  std::deque<std::weak_ptr<OffloadHandle>> resident_;  // offload order, while the pool has a disk tier
  size_t resident_compact_at_ = 1024;
  void note_resident_locked(const HandlePtr& h, std::vector<HandlePtr>& keep);
  // This engine's writes, oldest first, and reads whose handle was released while they ran.
  std::deque<SpillJobPtr> writes_;
  uint64_t queued_bytes_ = 0;  // bytes of every D2H copy queued so far
  struct WaitSample {
    EventPtr start, end;
  };
  std::vector<WaitSample> wait_samples_;
  struct CopySample {
    EventPtr start, end;
    size_t bytes;
    bool d2h;
  };
  std::vector<CopySample> copy_samples_;
  void note_copy_locked(bool d2h, size_t bytes, double ms);
  void note_timeline(TimelineKind kind, uint64_t id, size_t bytes, uint32_t flags, int64_t queued_ns,
                     EventPtr start, EventPtr end, bool same_stream = false);
  EngineStats st_;
};

}  // namespace ckpt_offload
