// Copy engine: offload / prefetch / fetch / release of one tensor through a pool block, ordered by
// the streams and events of its runtime (runtime.h); the same protocol on CUDA, on the host, and
// on the simulated asynchronous runtime.
#include "copy_engine.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/strides.h>

#include <cerrno>
#include <algorithm>
#include <cstdio>
#include <map>

namespace ckpt_offload {

namespace {

std::atomic<bool> g_profiling{false};
std::atomic<uint64_t> g_next_handle{1};

std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}

// Leaked on purpose: engines own CUDA streams, and destroying them after the CUDA runtime has
// shut down at process exit only produces errors.
std::map<std::string, std::shared_ptr<CopyEngine>>& registry() {
  static auto* engines = new std::map<std::string, std::shared_ptr<CopyEngine>>();
  return *engines;
}

// Element range [storage_offset, storage_offset + span) covered by a strided tensor. Strides are
// never negative in torch, so the first element sits at the storage offset.
int64_t span_elems(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return last + 1;
}

void check_offloadable(const at::Tensor& t, const c10::Device& engine_device) {
  TORCH_CHECK_VALUE(t.defined(), "offload: tensor is undefined");
  TORCH_CHECK_VALUE(!t.is_nested(), "offload: nested tensors are not supported");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "offload: only strided tensors can be offloaded, got layout ",
                    t.layout());
  TORCH_CHECK_VALUE(!t.is_meta(), "offload: meta tensors have no data to offload");
  TORCH_CHECK_VALUE(!t.is_quantized(), "offload: quantized tensors are not supported");
  // The copy moves raw bytes: a lazy conjugate or negation would come back as plain values.
  TORCH_CHECK_VALUE(!t.is_conj() && !t.is_neg(),
                    "offload: tensor has a conjugate or negative bit; resolve it first (resolve_conj / resolve_neg)");
  TORCH_CHECK_VALUE(t.is_cpu() || t.is_cuda(), "offload: tensor must be on a CUDA device or the CPU, got ",
                    t.device());
  TORCH_CHECK_VALUE(t.device().type() == engine_device.type() &&
                        (!t.is_cuda() || t.device().index() == engine_device.index()),
                    "offload: tensor on ", t.device(), " given to the engine of ", engine_device);
  TORCH_CHECK_VALUE(t.numel() == 0 || t.has_storage(), "offload: tensor has no storage (a tensor subclass?)");
}

// Timeline: the host allocations one acquire made (pinning inside a step stalls it; PITFALLS #7).
void note_allocations(const PoolStats& before, const PoolStats& after, int64_t start_ns, uint64_t handle,
                      const c10::Device& device) {
  if (after.alloc_calls <= before.alloc_calls) return;
  TimelineRecord r;
  r.kind = TimelineKind::kAlloc;
  r.id = handle;
  r.bytes = after.allocated_bytes > before.allocated_bytes ? after.allocated_bytes - before.allocated_bytes : 0;
  r.flags = static_cast<uint32_t>(after.alloc_calls - before.alloc_calls);
  r.queued_ns = r.start_ns = start_ns;
  r.end_ns = timeline::now_ns();
  r.device = device;
  timeline::add(std::move(r));
}

// An event the disk tier's workers wait on, made current on the engine's device first: a CUDA call
// from a thread with no current device would make device 0's primary context current there, or
// create it (hundreds of MiB on GPU 0 in every rank).
class OnDeviceEvent : public Event {
 public:
  OnDeviceEvent(EventPtr event, c10::Device device) : event_(std::move(event)), device_(device) {}
  bool query() const override {
    c10::OptionalDeviceGuard guard(device_);
    return event_->query();
  }
  void synchronize() const override {
    c10::OptionalDeviceGuard guard(device_);
    event_->synchronize();
  }

 private:
  const EventPtr event_;
  const c10::Device device_;
};

}  // namespace

const char* state_name(HandleState s) {
  switch (s) {
    case HandleState::kOffloading:
      return "offloading";
    case HandleState::kOnHost:
      return "on_host";
    case HandleState::kPrefetching:
      return "prefetching";
    case HandleState::kFetched:
      return "fetched";
    case HandleState::kReleased:
      return "released";
    case HandleState::kOnDisk:
      return "on_disk";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------------------------
// OffloadHandle

OffloadHandle::OffloadHandle(std::shared_ptr<CopyEngine> engine)
    : engine_(std::move(engine)), id_(g_next_handle.fetch_add(1)) {}

OffloadHandle::~OffloadHandle() {
  try {
    std::vector<at::Tensor> garbage;
    {
      std::lock_guard<std::mutex> lock(engine_->mu_);
      engine_->release_locked(*this, garbage);
    }
  } catch (const std::exception& e) {
    // A CUDA error (often a sticky one from an earlier kernel) must not terminate the process
    // from a destructor; the original error surfaces at the next checked call.
    std::fprintf(stderr, "ckpt_offload warning: releasing a handle failed: %s\n", e.what());
  }
}

HandleState OffloadHandle::state() {
  std::lock_guard<std::mutex> lock(engine_->mu_);
  engine_->refresh_state_locked(*this);
  return state_;
}

at::Tensor OffloadHandle::host_bytes() {
  // A testing aid, so it may wait on the host: the bytes are only there once the copy has run.
  if (d2h_done_) d2h_done_->synchronize();
  std::lock_guard<std::mutex> lock(engine_->mu_);
  if (!block_) return at::Tensor();
  auto block = block_;
  return at::from_blob(
      block->data(), {static_cast<int64_t>(nbytes_)}, [block](void*) {}, at::TensorOptions().dtype(at::kByte));
}

// ---------------------------------------------------------------------------------------------
// CopyEngine: construction and registry

namespace {
std::unique_ptr<CopyRuntime> checked_runtime(const c10::Device& device, const std::shared_ptr<HostPool>& pool,
                                             Break broken) {
  TORCH_CHECK_VALUE(pool != nullptr, "CopyEngine: pool must not be None");
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(), "CopyEngine: device must be cpu or cuda, got ", device);
  return make_runtime(device, broken);
}
}  // namespace

CopyEngine::CopyEngine(c10::Device device, std::shared_ptr<HostPool> pool)
    : device_(device), pool_(std::move(pool)), broken_(break_from_env()),
      rt_(checked_runtime(device_, pool_, broken_)), cuda_(std::string(rt_->name()) == "cuda") {
  if (cuda_ && !pool_->pinned()) {
    TORCH_WARN("CopyEngine(", device_, "): the pool is not pinned, so every copy to it is synchronous ",
               "and cannot overlap compute; use HostPool() (pinned when CUDA is usable)");
  }
  if (timeline::recording()) rt_->anchor_clock();  // created while a timeline records (its start anchored the rest)
}

CopyEngine::~CopyEngine() {
  // Copies still queued read sources and write blocks this engine holds: finish them first.
  try {
    rt_->synchronize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt_offload warning: finishing the copies of an engine failed: %s\n", e.what());
  }
}

std::shared_ptr<CopyEngine> CopyEngine::create(c10::Device device, std::shared_ptr<HostPool> pool) {
  return std::shared_ptr<CopyEngine>(new CopyEngine(with_index(device), std::move(pool)));
}

c10::Device CopyEngine::with_index(c10::Device device) {
  // "cuda" means the current device, as it does for tensors.
  if (device.is_cuda() && !device.has_index()) {
    device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(current_cuda_device()));
  }
  return device;
}

std::shared_ptr<HostPool> CopyEngine::global_pool() {
  static auto* pool = new std::shared_ptr<HostPool>(HostPool::create(cuda_runtime_usable()));
  return *pool;
}

std::shared_ptr<CopyEngine> CopyEngine::for_device(c10::Device device) {
  device = with_index(device);
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& slot = registry()[device.str()];
  if (!slot) slot = create(device, global_pool());
  return slot;
}

std::vector<std::shared_ptr<CopyEngine>> CopyEngine::all_engines() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::shared_ptr<CopyEngine>> out;
  for (auto& kv : registry()) out.push_back(kv.second);
  return out;
}

void CopyEngine::set_profiling(bool on) { g_profiling.store(on); }
bool CopyEngine::profiling() { return g_profiling.load(); }

// ---------------------------------------------------------------------------------------------
// offload

HandlePtr CopyEngine::offload(const at::Tensor& tensor) {
  check_offloadable(tensor, device_);
  // Built and filled before the engine lock is taken: if anything below throws, the handle dies
  // as "released" after the lock is gone (its destructor takes the lock).
  HandlePtr h(new OffloadHandle(shared_from_this()));
  h->state_ = HandleState::kReleased;
  h->dtype_ = tensor.scalar_type();
  h->device_ = tensor.device();
  h->sizes_ = tensor.sizes().vec();
  h->strides_ = tensor.strides().vec();
  h->version_ = tensor.unsafeGetTensorImpl()->version_counter();
  if (tensor.has_storage()) h->storage_.emplace(tensor.storage().getWeakStorageImpl());

  at::Tensor src = tensor;
  int64_t span = span_elems(tensor);
  const bool compact = span > tensor.numel();
  if (compact) {
    // Gaps between elements (a strided slice): copying the span would move bytes nobody needs,
    // so copy densely. Overlapping views (expand, stride 0) keep their smaller span instead.
    src = tensor.contiguous();
    h->strides_ = src.strides().vec();
    h->compacted_ = true;
    span = src.numel();
  }
  h->span_elems_ = span;
  // Dense: the strides at::empty gives its shape (a size-1 dimension's stride included), over its span.
  h->dense_ = span == src.numel() && c10::IntArrayRef(h->strides_) == c10::IntArrayRef(c10::contiguous_strides(h->sizes_));
  h->nbytes_ = static_cast<size_t>(span) * tensor.element_size();

  timeline::DeferEvictions evicted;  // overwritten timeline records: destroyed after every lock here
  std::vector<at::Tensor> garbage;  // destroyed after the lock below is released
  std::vector<HandlePtr> keep;      // likewise
  if (h->nbytes_ == 0) {
    h->state_ = HandleState::kOnHost;
    std::lock_guard<std::mutex> lock(mu_);
    st_.tensors_offloaded += 1;
    return h;
  }

  c10::OptionalDeviceGuard guard;  // events, copies and pinning on this engine's device
  if (cuda_) guard.reset_device(device_);
  // The current stream, looked up now: it is the one that produced the tensor for this call.
  const c10::Stream compute = rt_->current_stream();
  rt_->check_usable(compute, "offload");
  const bool rec = timeline::recording();  // the hot path's one check of the timeline
  const int64_t queued = rec ? timeline::now_ns() : 0;
  const PoolStats pool_before = rec ? pool_->stats() : PoolStats();
  std::shared_ptr<HostBlock> block = pool_->acquire(h->nbytes_, /*wait_host=*/false);
  if (!block) block = acquire_spilling(h->nbytes_);  // the cap refused: a block of an earlier layer, spilled
  const bool spilling = block && pool_->spill() != nullptr;
  if (rec) note_allocations(pool_before, pool_->stats(), queued, h->id_, device_);
  CopySample copy_sample{nullptr, nullptr, 0, true};  // profiling: the copy's two events
  if (block) {
    const c10::Stream& d2h = rt_->d2h_stream();
    // The copy reads what the compute stream produced up to now.
    if (!broken(Break::kD2HWait)) rt_->wait(d2h, rt_->record(compute));
    // A copy may still read this block (a reload by another stream): write after it. This is
    // the block's last-use gating; the pool hands busy blocks to writers that order themselves.
    if (block->pending() && !broken(Break::kLastUse)) rt_->wait(d2h, block->pending());
    // Profiling: an event after the waits marks when the copy itself starts on its stream.
    const bool profile = g_profiling.load();
    const bool timed = profile || rec;
    EventPtr start = timed ? rt_->record(d2h, /*timing=*/true) : nullptr;
    rt_->copy(d2h, block->data(), src.data_ptr(), h->nbytes_, h->id_);
    EventPtr done = rt_->record(d2h, /*timing=*/timed);
    if (profile) copy_sample = CopySample{start, done, h->nbytes_, true};
    if (rec) note_timeline(TimelineKind::kD2H, h->id_, h->nbytes_, 0, queued, start, done, d2h == compute);
    h->d2h_done_ = done;
    block->set_last_use(done);
    h->state_ = event_done(done) ? HandleState::kOnHost : HandleState::kOffloading;
  }

  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!block) {
      st_.offloads_refused += 1;
      return nullptr;
    }
    if (copy_sample.start) {
      copy_samples_.push_back(std::move(copy_sample));
      if (copy_samples_.size() > 4096) fold_samples_locked();  // stats() never called
    }
    queued_bytes_ += h->nbytes_;
    if (h->state_ == HandleState::kOffloading) {
      // The source must outlive its copy: held until the copy's event completes (poll), or handed
      // back in stream order once enough later copies were queued behind it, or when its layer's
      // forward ends (release_sources_locked).
      pending_.push_back({h->d2h_done_, src, compute, h->id_, queued_bytes_});
    }
    release_sources_locked(kHandBackBytes, garbage);
    h->block_ = std::move(block);
    st_.compacted += compact ? 1 : 0;
    st_.tensors_offloaded += 1;
    st_.bytes_offloaded += h->nbytes_;
    if (spilling) note_resident_locked(h, keep);  // a candidate for the disk, oldest first
  }
  keep.clear();
  if (spilling) spill_ahead(h->nbytes_);
  return h;
}

// ---------------------------------------------------------------------------------------------
// prefetch / fetch / release

void CopyEngine::refresh_state_locked(OffloadHandle& h) {
  if (h.state_ == HandleState::kOffloading && event_done(h.d2h_done_)) h.state_ = HandleState::kOnHost;
}

at::Tensor CopyEngine::allocate_dest(const OffloadHandle& h) {
  // On the current stream of the handle's device: the memory belongs to the stream that uses it.
  c10::OptionalDeviceGuard guard;
  if (cuda_) guard.reset_device(device_);
  const auto options = at::TensorOptions().dtype(h.dtype_).device(h.device_);
  return h.dense_ ? at::empty(h.sizes_, options) : at::empty({h.span_elems_}, options);
}

at::Tensor CopyEngine::lock_with_dest(const OffloadHandle& h, std::unique_lock<std::mutex>& lock) {
  // Allocation can reach Python (a dispatch mode, an out-of-memory observer), which takes the GIL;
  // a thread holding the GIL may be waiting for this lock (~OffloadHandle, any binding that does
  // not release the GIL). So nothing is allocated under the lock: when the state changed between
  // the check and the lock (a handle fetched with keep_host goes back to on_host), let go and
  // allocate again. Returns holding the lock, with a span whenever the state needs a reload.
  at::Tensor fresh;
  for (;;) {
    lock.lock();
    const bool needs = h.state_ == HandleState::kOffloading || h.state_ == HandleState::kOnHost;
    if (!needs || fresh.defined()) return fresh;
    lock.unlock();
    fresh = allocate_dest(h);
  }
}

void CopyEngine::prefetch_locked(OffloadHandle& h, at::Tensor fresh) {
  switch (h.state_) {
    case HandleState::kPrefetching:
    case HandleState::kFetched:
      return;  // idempotent
    case HandleState::kReleased:
      TORCH_CHECK(false, "prefetch: the handle was released; expected state offloading or on_host");
    default:
      break;
  }
  // Allocated by the caller before taking the lock (see lock_with_dest), never here.
  TORCH_INTERNAL_ASSERT(fresh.defined(), "prefetch: no device span allocated for a reload");
  h.dest_ = std::move(fresh);
  if (h.nbytes_ == 0) {
    h.state_ = HandleState::kPrefetching;
    return;
  }
  c10::OptionalDeviceGuard guard;
  if (cuda_) guard.reset_device(device_);
  const c10::Stream compute = rt_->current_stream();
  rt_->check_usable(compute, "reload");
  h.dest_stream_ = compute;
  const bool rec = timeline::recording();
  const int64_t queued = rec ? timeline::now_ns() : 0;
  const c10::Stream& h2d = rt_->h2d_stream();
  // The copy waits for the allocation point (earlier users of that memory on the compute
  // stream) and for this tensor's own offload, which may still be running.
  rt_->wait(h2d, rt_->record(compute));
  if (!broken(Break::kReloadWait)) rt_->wait(h2d, h.d2h_done_);
  const bool profile = g_profiling.load();
  const bool timed = profile || rec;
  EventPtr start = timed ? rt_->record(h2d, /*timing=*/true) : nullptr;
  rt_->copy(h2d, h.dest_.data_ptr(), h.block_->data(), h.nbytes_, h.id_);
  EventPtr done = rt_->record(h2d, /*timing=*/timed);
  h.h2d_done_ = done;
  h.block_->set_last_use(done);  // a later writer of the block orders itself after this read
  if (rec) note_timeline(TimelineKind::kH2D, h.id_, h.nbytes_, 0, queued, start, done, h2d == compute);
  if (profile) {
    copy_samples_.push_back({start, done, h.nbytes_, false});
    if (copy_samples_.size() > 4096) fold_samples_locked();
  }
  h.state_ = HandleState::kPrefetching;
  st_.tensors_prefetched += 1;
  st_.bytes_prefetched += h.nbytes_;
}

void CopyEngine::prefetch(const HandlePtr& h) {
  TORCH_CHECK_VALUE(h != nullptr, "prefetch: handle is None");
  TORCH_CHECK_VALUE(h->engine_.get() == this, "prefetch: the handle belongs to another engine");
  bring_back(h);
  timeline::DeferEvictions evicted;  // as in fetch
  std::vector<at::Tensor> garbage;  // destroyed after the lock is released
  std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
  at::Tensor fresh = lock_with_dest(*h, lock);
  if (h->state_ == HandleState::kPrefetching || h->state_ == HandleState::kFetched) {
    garbage.push_back(std::move(fresh));  // another thread started it meanwhile
    return;
  }
  prefetch_locked(*h, std::move(fresh));
}

at::Tensor CopyEngine::fetch(const HandlePtr& h, bool keep_host) {
  TORCH_CHECK_VALUE(h != nullptr, "fetch: handle is None");
  TORCH_CHECK_VALUE(h->engine_.get() == this, "fetch: the handle belongs to another engine");
  bring_back(h);
  timeline::DeferEvictions evicted;  // a wait noted under the lock may overwrite a record: dies after it
  std::vector<at::Tensor> garbage;
  std::shared_ptr<HostBlock> block;
  at::Tensor dest;
  bool other_stream = false;
  c10::Stream current_stream(c10::Stream::DEFAULT, device_);
  {
    std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
    at::Tensor fresh = lock_with_dest(*h, lock);
    garbage.push_back(fresh);  // dropped after unlocking if prefetch_locked does not take it
    TORCH_CHECK(h->state_ != HandleState::kFetched,
                "fetch: the handle was already fetched; expected state offloading, on_host or prefetching");
    TORCH_CHECK(h->state_ != HandleState::kReleased,
                "fetch: the handle was released; expected state offloading, on_host or prefetching");
    const bool on_demand = h->state_ != HandleState::kPrefetching && h->nbytes_ > 0;
    if (on_demand) st_.reloads_on_demand += 1;
    prefetch_locked(*h, std::move(fresh));
    if (h->h2d_done_) {
      c10::OptionalDeviceGuard guard;
      if (cuda_) guard.reset_device(device_);
      const c10::Stream current = rt_->current_stream();
      const bool profile = g_profiling.load();
      const bool rec = timeline::recording();
      const int64_t queued = rec ? timeline::now_ns() : 0;
      EventPtr start = profile || rec ? rt_->record(current, /*timing=*/true) : nullptr;
      if (!broken(Break::kFetchWait)) rt_->wait(current, h->h2d_done_);
      EventPtr end = start ? rt_->record(current, /*timing=*/true) : nullptr;
      if (profile) {
        wait_samples_.push_back({start, end});
        if (wait_samples_.size() > 4096) fold_samples_locked();  // stats() never called
      }
      if (rec) note_timeline(TimelineKind::kWait, h->id_, h->nbytes_, on_demand ? kTimelineOnDemand : 0, queued,
                             start, end);
      other_stream = current != h->dest_stream_;
      current_stream = current;
    }
    if (h->dest_.defined()) rt_->check_fetched(h->dest_.data_ptr(), h->nbytes_, h->id_);
    dest = std::move(h->dest_);
    h->dest_ = at::Tensor();
    if (keep_host) {
      // The block stays, tagged with this reload's event: a later reload reads it again, and
      // whoever writes it after the handle dies orders itself after that read.
      h->h2d_done_ = nullptr;
      h->fetched_ = true;
      h->state_ = HandleState::kOnHost;
    } else {
      block = std::move(h->block_);  // back to the pool, tagged with the reload's event
      h->state_ = HandleState::kFetched;
    }
    st_.tensors_fetched += 1;
    // Backward has begun: no source needs to stay held past this point.
    release_sources_locked(0, garbage);
  }
  // Outside the lock: these reach the dispatcher (and possibly Python dispatch modes).
  // Fetched on another stream than the one that allocated it: tell the allocator, or the memory
  // could be reused while this stream still reads it.
  if (other_stream) dest.record_stream(current_stream);
  if (h->dense_) return dest;  // allocated in its own shape
  return dest.as_strided(h->sizes_, h->strides_, dest.storage_offset());
}

void CopyEngine::release_locked(OffloadHandle& h, std::vector<at::Tensor>& garbage) {
  if (h.state_ == HandleState::kReleased) return;
  // Unfetched: a handle fetched before with keep_host and back on the host was used, not dropped.
  if (h.state_ != HandleState::kFetched && !(h.fetched_ && h.state_ == HandleState::kOnHost)) {
    st_.tensors_released += 1;
  }
  if (h.state_ == HandleState::kPrefetching && h.h2d_done_) {
    // The reload may still be writing dest: its stream must not reuse the memory before that.
    c10::OptionalDeviceGuard guard;
    if (cuda_) guard.reset_device(device_);
    rt_->wait(h.dest_stream_, h.h2d_done_);
  }
  if (h.dest_.defined()) garbage.push_back(std::move(h.dest_));
  h.dest_ = at::Tensor();
  h.block_.reset();  // the block carries the event of the last copy that touched it
  // A queued write or read is skipped; the file goes once no I/O uses it. A read that may be running
  // is kept where synchronize() waits for it, as writes are.
  if (h.disk_job_) {
    h.disk_job_->cancel();
    if (!h.disk_job_->write() && !h.disk_job_->done()) writes_.push_back(h.disk_job_);
  }
  h.disk_job_.reset();
  h.file_.reset();
  h.tier_.reset();
  h.state_ = HandleState::kReleased;
}

void CopyEngine::release(const HandlePtr& h) {
  TORCH_CHECK_VALUE(h != nullptr, "release: handle is None");
  TORCH_CHECK_VALUE(h->engine_.get() == this, "release: the handle belongs to another engine");
  std::vector<at::Tensor> garbage;
  std::lock_guard<std::mutex> lock(mu_);
  release_locked(*h, garbage);
  poll_locked(garbage);
}

// ---------------------------------------------------------------------------------------------
// the disk tier

void CopyEngine::note_resident_locked(const HandlePtr& h, std::vector<HandlePtr>& keep) {
  // Handles fetched or dead since are dropped from the front (a step's come back before the next
  // step's offloads), and all through now and then (a graph kept alive can hold the front).
  auto stale = [&keep](const std::weak_ptr<OffloadHandle>& w) {
    HandlePtr v = w.lock();
    const bool gone = !v || !v->block_ ||
                      (v->state_ != HandleState::kOnHost && v->state_ != HandleState::kOffloading);
    if (v) keep.push_back(std::move(v));  // a last reference must not die here, under the lock
    return gone;
  };
  while (!resident_.empty() && stale(resident_.front())) resident_.pop_front();
  if (resident_.size() >= resident_compact_at_) {
    resident_.erase(std::remove_if(resident_.begin(), resident_.end(), stale), resident_.end());
    resident_compact_at_ = std::max<size_t>(1024, 2 * resident_.size());
  }
  resident_.push_back(h);
}

SpillJobPtr CopyEngine::evict_locked(const std::shared_ptr<SpillTier>& tier, size_t nbytes,
                                     std::vector<HandlePtr>& keep) {
  // Victims in offload order: the earliest layers, which backward reaches last.
  const size_t cls = HostPool::round_size(nbytes);
  for (auto it = resident_.begin(); it != resident_.end();) {
    HandlePtr v = it->lock();
    if (v) keep.push_back(v);  // a last reference must not die here, under the lock
    if (!v || !v->block_ || (v->state_ != HandleState::kOnHost && v->state_ != HandleState::kOffloading)) {
      it = resident_.erase(it);  // fetched, reloading, released: never a victim again
      continue;
    }
    if (v->block_->capacity() < cls) {
      ++it;  // its block would not serve the request
      continue;
    }
    std::shared_ptr<SpillFile> file = tier->new_file(v->nbytes_, *v->block_);
    if (!file) return nullptr;  // over the disk budget, or the directory cannot be made
    resident_.erase(it);
    // The write reads the block after the offload copy that fills it (its event, on the worker).
    EventPtr after = v->d2h_done_;
    if (after && cuda_) after = std::make_shared<OnDeviceEvent>(std::move(after), device_);
    v->disk_job_ = tier->write(file, std::move(v->block_), std::move(after), v->id_);
    v->file_ = std::move(file);
    v->tier_ = tier;
    v->state_ = HandleState::kOnDisk;
    writes_.push_back(v->disk_job_);
    return v->disk_job_;
  }
  return nullptr;
}

void CopyEngine::prune_writes_locked() {
  while (!writes_.empty() && writes_.front()->done()) {
    const SpillJobPtr& job = writes_.front();
    if (job->write() && job->failed() && job->error_number() != ECANCELED) {
      TORCH_WARN(job->message(), "; the disk tier stops: tensors past the host pool's cap stay on the device ",
                 "until set_spill_dir() is called again");
    } else {
      // Written, or read for a released handle: the block goes back to the pool now (a failed
      // write's stays with its handle, which takes it back).
      job->take_block();
    }
    writes_.pop_front();
  }
}

std::shared_ptr<HostBlock> CopyEngine::acquire_spilling(size_t nbytes) {
  std::shared_ptr<SpillTier> tier = pool_->spill();
  if (!tier) return nullptr;
  for (;;) {
    // The oldest write still running frees a block once it completes; with none running, one
    // that completed meanwhile may have freed one already; else a new write starts.
    SpillJobPtr job;
    {
      std::lock_guard<std::mutex> lock(mu_);
      prune_writes_locked();
      if (!writes_.empty()) job = writes_.front();
    }
    std::vector<HandlePtr> keep;  // destroyed after the lock is released
    if (!job) {
      std::shared_ptr<HostBlock> block = pool_->acquire(nbytes, /*wait_host=*/false);
      if (block) return block;
      std::lock_guard<std::mutex> lock(mu_);
      if (tier->usable()) job = evict_locked(tier, nbytes, keep);
    }
    if (!job) return nullptr;  // nothing to spill: the tensor stays where it is
    if (!job->done()) {
      tier->note_write_wait();
      job->wait();
    }
    std::shared_ptr<HostBlock> block = pool_->acquire(nbytes, /*wait_host=*/false);
    if (block) return block;
  }
}

void CopyEngine::spill_ahead(size_t nbytes) {
  // Once the next request of this size would be refused, the oldest block starts on its way to the
  // disk now, so that the write runs beside the next layer's forward instead of before its copy.
  std::shared_ptr<SpillTier> tier = pool_->spill();
  if (!tier || tier->spill_ahead() == 0 || !tier->usable()) return;
  std::vector<HandlePtr> keep;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lock(mu_);
  prune_writes_locked();
  if (pool_->fits(nbytes)) return;
  size_t running = 0;
  for (const auto& j : writes_) running += j->done() ? 0 : 1;
  if (running < static_cast<size_t>(tier->spill_ahead())) evict_locked(tier, nbytes, keep);
}

void CopyEngine::settle_write_locked(OffloadHandle& h) {
  if (h.state_ != HandleState::kOnDisk || !h.disk_job_ || !h.disk_job_->write() || !h.disk_job_->done()) return;
  if (h.disk_job_->failed()) {
    // The block still holds the tensor: it is on the host again, and no file is left.
    h.block_ = h.disk_job_->take_block();
    h.file_.reset();
    h.tier_.reset();
    h.state_ = HandleState::kOnHost;
  }
  h.disk_job_.reset();
}

bool CopyEngine::start_read(const HandlePtr& h, bool must) {
  std::shared_ptr<SpillTier> tier;
  size_t nbytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    settle_write_locked(*h);
    if (h->state_ != HandleState::kOnDisk || h->disk_job_) return false;  // not on disk, or I/O under way
    tier = h->tier_;
    nbytes = h->nbytes_;
  }
  // Allocation may pin memory: outside the engine lock. Ahead of need, only within the cap; when
  // the reload needs it now, past the cap (a cap full of other layers' blocks cannot wait here).
  {
    std::lock_guard<std::mutex> lock(mu_);
    prune_writes_locked();  // blocks of finished writes back to the pool first
  }
  std::shared_ptr<HostBlock> block = pool_->acquire(nbytes, /*wait_host=*/false);
  if (!block && must) {
    block = pool_->acquire(nbytes, /*wait_host=*/false, /*over_cap=*/true);
    if (block) tier->note_read_over_cap();
  }
  TORCH_CHECK(block || !must, "ckpt_offload: no host memory to read back a spilled tensor of ", nbytes,
              " bytes (handle #", h->id_, ")");
  if (!block) return false;
  std::lock_guard<std::mutex> lock(mu_);
  if (h->state_ != HandleState::kOnDisk || h->disk_job_) return false;  // another thread started it
  EventPtr after = block->pending();  // a copy may still read the reused block: the read writes it after
  if (after && cuda_) after = std::make_shared<OnDeviceEvent>(std::move(after), device_);
  h->disk_job_ = tier->read(h->file_, std::move(block), std::move(after), h->id_);
  if (!must) tier->note_read_ahead();
  return true;
}

bool CopyEngine::read_ahead(const HandlePtr& h) {
  TORCH_CHECK_VALUE(h != nullptr, "read_ahead: handle is None");
  TORCH_CHECK_VALUE(h->engine_.get() == this, "read_ahead: the handle belongs to another engine");
  if (start_read(h, /*must=*/false)) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return h->state_ != HandleState::kOnDisk || h->disk_job_ != nullptr;  // else no block: ask again later
}

void CopyEngine::bring_back(const HandlePtr& h) {
  SpillJobPtr job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    settle_write_locked(*h);
    if (h->state_ != HandleState::kOnDisk) return;
    job = h->disk_job_;
  }
  if (job && job->write()) {
    job->wait();  // needed before its write finished: the file is complete after it
    std::lock_guard<std::mutex> lock(mu_);
    settle_write_locked(*h);
    if (h->state_ != HandleState::kOnDisk) return;
  }
  start_read(h, /*must=*/true);
  std::shared_ptr<SpillTier> tier;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (h->state_ != HandleState::kOnDisk) return;
    job = h->disk_job_;
    tier = h->tier_;
  }
  TORCH_CHECK(job && !job->write(), "ckpt_offload: internal error: a spilled handle without its read");
  if (!job->done() && !broken(Break::kSpillRead)) {
    tier->note_read_wait();  // the read was not started far enough ahead of the reload
    job->wait();
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (h->state_ != HandleState::kOnDisk || h->disk_job_ != job) return;
  if (job->done()) {
    TORCH_CHECK(!job->failed(), job->message(), " (handle #", h->id_, ")");
    h->block_ = job->take_block();
    h->file_.reset();  // the data is back in host memory: the file goes
    h->tier_.reset();
    h->disk_job_.reset();
  } else {
    h->block_ = job->peek_block();  // broken protocol (testing): the reload will not wait for the read
  }
  h->state_ = HandleState::kOnHost;
}

// ---------------------------------------------------------------------------------------------
// polling, synchronisation, statistics

void CopyEngine::poll_locked(std::vector<at::Tensor>& garbage) {
  // One D2H stream: copies complete in the order they were queued.
  while (!pending_.empty() && event_done(pending_.front().done)) {
    garbage.push_back(std::move(pending_.front().tensor));
    pending_.pop_front();
  }
}

void CopyEngine::release_sources_locked(size_t keep_bytes, std::vector<at::Tensor>& garbage) {
  poll_locked(garbage);
  while (!pending_.empty() && queued_bytes_ - pending_.front().queued_end >= keep_bytes) {
    PendingSource& p = pending_.front();
    if (!event_done(p.done)) {
      if (!rt_->frees_in_stream_order(p.tensor)) break;  // held until poll sees the copy complete
      // The producing stream waits for the copy; whatever reuses the memory after the reference
      // is dropped is ordered after that wait (see CopyRuntime::frees_in_stream_order). A tensor
      // allocated on another stream (a side-stream input) gets the producer recorded as a user.
      c10::OptionalDeviceGuard guard;
      if (cuda_) guard.reset_device(device_);
      const bool rec = timeline::recording();  // the producer's wait for the copy: a stall if it is still running
      const int64_t queued = rec ? timeline::now_ns() : 0;
      EventPtr start = rec ? rt_->record(p.stream, /*timing=*/true) : nullptr;
      if (!broken(Break::kSourceWait)) rt_->wait(p.stream, p.done);
      if (rec) {
        note_timeline(TimelineKind::kWait, p.handle, 0, kTimelineSourceWait, queued, start,
                      rt_->record(p.stream, /*timing=*/true));
      }
      rt_->record_use(p.tensor, p.stream);
    }
    rt_->check_source_release(p.tensor, p.handle);
    garbage.push_back(std::move(p.tensor));
    pending_.pop_front();
  }
}

size_t CopyEngine::release_sources(size_t keep_bytes) {
  timeline::DeferEvictions evicted;  // as in fetch
  std::vector<at::Tensor> garbage;
  std::lock_guard<std::mutex> lock(mu_);
  release_sources_locked(keep_bytes, garbage);
  return pending_.size();
}

size_t CopyEngine::poll() {
  std::vector<at::Tensor> garbage;
  std::lock_guard<std::mutex> lock(mu_);
  poll_locked(garbage);
  return pending_.size();
}

void CopyEngine::synchronize() {
  rt_->synchronize();
  std::deque<SpillJobPtr> writes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    writes = writes_;
  }
  for (auto& job : writes) job->wait();  // the disk tier's writes hold pool blocks until they end
  {
    std::lock_guard<std::mutex> lock(mu_);
    prune_writes_locked();
  }
  poll();
}

void CopyEngine::note_copy_locked(bool d2h, size_t bytes, double ms) {
  if (d2h) {
    st_.d2h_copy_ms += ms;
    st_.d2h_bytes_timed += bytes;
    st_.d2h_copies_timed += 1;
  } else {
    st_.h2d_copy_ms += ms;
    st_.h2d_bytes_timed += bytes;
    st_.h2d_copies_timed += 1;
  }
}

void CopyEngine::note_timeline(TimelineKind kind, uint64_t id, size_t bytes, uint32_t flags, int64_t queued_ns,
                               EventPtr start, EventPtr end, bool same_stream) {
  TimelineRecord r;
  r.kind = kind;
  r.id = id;
  r.bytes = bytes;
  r.flags = flags;
  r.queued_ns = queued_ns;
  r.start = std::move(start);
  r.end = std::move(end);
  r.owner = shared_from_this();
  r.rt = rt_.get();
  r.device = device_;
  r.same_stream = same_stream;
  timeline::add(std::move(r));
}

void CopyEngine::timeline_mark(uint32_t phase, uint64_t key) {
  if (!timeline::recording()) return;
  c10::OptionalDeviceGuard guard;
  if (cuda_) guard.reset_device(device_);
  const int64_t now = timeline::now_ns();
  note_timeline(TimelineKind::kMark, key, 0, phase, now, rt_->record(rt_->current_stream(), /*timing=*/true), nullptr);
}

void CopyEngine::fold_samples_locked() {
  // Fold finished measurements into the totals; unfinished ones stay for the next call.
  std::vector<WaitSample> open;
  for (auto& s : wait_samples_) {
    if (event_done(s.end)) {
      st_.reload_wait_ms += rt_->elapsed_ms(s.start, s.end);
      st_.reload_waits_measured += 1;
    } else {
      open.push_back(s);
    }
  }
  wait_samples_.swap(open);
  std::vector<CopySample> open_copies;
  for (auto& s : copy_samples_) {
    if (event_done(s.end)) {
      note_copy_locked(s.d2h, s.bytes, rt_->elapsed_ms(s.start, s.end));
    } else {
      open_copies.push_back(s);
    }
  }
  copy_samples_.swap(open_copies);
}

EngineStats CopyEngine::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  fold_samples_locked();
  EngineStats out = st_;
  out.pending_sources = pending_.size();
  return out;
}

void CopyEngine::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  st_ = EngineStats();
  wait_samples_.clear();
  copy_samples_.clear();
}

}  // namespace ckpt_offload
