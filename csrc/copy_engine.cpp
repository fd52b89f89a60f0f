// Copy engine: offload / prefetch / fetch / release of one tensor through a pool block.
// CUDA tensors use the engine's own streams and events; everything else copies synchronously.
#include "copy_engine.h"

#include <chrono>
#include <cstdio>
#include <map>

#ifdef CKPT_OFFLOAD_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace ckpt_offload {

namespace {

std::atomic<bool> g_profiling{false};

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

#ifdef CKPT_OFFLOAD_WITH_CUDA
cudaStream_t as_cuda(void* s) { return static_cast<cudaStream_t>(s); }

// A graph replay cannot follow the host-side bookkeeping (pool blocks, polled sources), and
// pinned allocation is illegal while capturing: refuse clearly instead of recording garbage.
void check_not_capturing(cudaStream_t stream, const char* what) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CKPT_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  TORCH_CHECK(status == cudaStreamCaptureStatusNone, "ckpt_offload: ", what,
              " during CUDA graph capture is not supported; run the captured region without offload");
}
#endif

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
  }
  return "unknown";
}

// ---------------------------------------------------------------------------------------------
// OffloadHandle

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
  std::lock_guard<std::mutex> lock(engine_->mu_);
  if (!block_) return at::Tensor();
  auto block = block_;
  return at::from_blob(
      block->data(), {static_cast<int64_t>(nbytes_)}, [block](void*) {}, at::TensorOptions().dtype(at::kByte));
}

// ---------------------------------------------------------------------------------------------
// CopyEngine: construction and registry

CopyEngine::CopyEngine(c10::Device device, std::shared_ptr<HostPool> pool)
    : device_(device), pool_(std::move(pool)),
#ifdef CKPT_OFFLOAD_WITH_CUDA
      cuda_(device.is_cuda() && cuda_runtime_usable())
#else
      cuda_(false)
#endif
{
  TORCH_CHECK_VALUE(pool_ != nullptr, "CopyEngine: pool must not be None");
  TORCH_CHECK_VALUE(device_.is_cpu() || device_.is_cuda(), "CopyEngine: device must be cpu or cuda, got ", device_);
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (cuda_) {
    TORCH_CHECK_VALUE(device_.has_index(), "CopyEngine: a CUDA device needs an index, got ", device_);
    c10::cuda::CUDAGuard guard(device_.index());  // streams belong to this engine's device
    cudaStream_t d2h = nullptr, h2d = nullptr;
    CKPT_CUDA_CHECK(cudaStreamCreateWithFlags(&d2h, cudaStreamNonBlocking));
    CKPT_CUDA_CHECK(cudaStreamCreateWithFlags(&h2d, cudaStreamNonBlocking));
    d2h_stream_ = d2h;
    h2d_stream_ = h2d;
    if (!pool_->pinned()) {
      TORCH_WARN("CopyEngine(", device_, "): the pool is not pinned, so every copy to it is synchronous ",
                 "and cannot overlap compute; use HostPool() (pinned when CUDA is usable)");
    }
  }
#endif
}

CopyEngine::~CopyEngine() {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (cuda_) {
    int previous = -1;
    CKPT_CUDA_CHECK_WARN(cudaGetDevice(&previous));
    CKPT_CUDA_CHECK_WARN(cudaSetDevice(device_.index()));
    CKPT_CUDA_CHECK_WARN(cudaStreamSynchronize(as_cuda(d2h_stream_)));
    CKPT_CUDA_CHECK_WARN(cudaStreamSynchronize(as_cuda(h2d_stream_)));
    CKPT_CUDA_CHECK_WARN(cudaStreamDestroy(as_cuda(d2h_stream_)));
    CKPT_CUDA_CHECK_WARN(cudaStreamDestroy(as_cuda(h2d_stream_)));
    if (previous >= 0) CKPT_CUDA_CHECK_WARN(cudaSetDevice(previous));
  }
#endif
}

std::shared_ptr<CopyEngine> CopyEngine::create(c10::Device device, std::shared_ptr<HostPool> pool) {
  return std::shared_ptr<CopyEngine>(new CopyEngine(with_index(device), std::move(pool)));
}

c10::Device CopyEngine::with_index(c10::Device device) {
  // "cuda" means the current device, as it does for tensors.
  if (device.is_cuda() && !device.has_index()) {
    int current = 0;
#ifdef CKPT_OFFLOAD_WITH_CUDA
    if (cuda_runtime_usable()) CKPT_CUDA_CHECK(cudaGetDevice(&current));
#endif
    device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(current));
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
  h->nbytes_ = static_cast<size_t>(span) * tensor.element_size();

  std::vector<at::Tensor> garbage;  // destroyed after the lock below is released
  if (h->nbytes_ == 0) {
    h->state_ = HandleState::kOnHost;
    std::lock_guard<std::mutex> lock(mu_);
    st_.tensors_offloaded += 1;
    return h;
  }

  std::shared_ptr<HostBlock> block;
  CopySample copy_sample{nullptr, nullptr, 0, true};  // profiling, CUDA: the copy's two events
  c10::Stream producer_stream(c10::Stream::DEFAULT, device_);  // CUDA: the stream current at this call
  double host_copy_ms = -1.0;                          // profiling, host path: the copy's duration
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (cuda_) {
    c10::cuda::CUDAGuard guard(device_.index());  // events, copies and pinning on this device
    // The current stream, looked up now: it is the one that produced the tensor for this call.
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device_.index());
    cudaStream_t compute = current.stream();
    check_not_capturing(compute, "offload");
    producer_stream = current.unwrap();
    block = pool_->acquire(h->nbytes_, /*wait_host=*/false);
    if (block) {
      cudaStream_t d2h = as_cuda(d2h_stream_);
      auto ready = std::make_shared<CudaEvent>();
      ready->record(compute);
      ready->block(d2h);
      if (block->pending()) block->pending()->block(d2h);  // a reload may still read this block
      // Profiling: an event after the waits marks when the copy itself starts on its stream.
      const bool timed = g_profiling.load();
      EventPtr start = timed ? std::make_shared<CudaEvent>(/*timing=*/true) : nullptr;
      if (start) start->record(d2h);
      CKPT_CUDA_CHECK(cudaMemcpyAsync(block->data(), src.data_ptr(), h->nbytes_, cudaMemcpyDeviceToHost, d2h));
      auto done = std::make_shared<CudaEvent>(/*timing=*/timed);
      done->record(d2h);
      if (start) copy_sample = CopySample{start, done, h->nbytes_, true};
      h->d2h_done_ = done;
      block->set_last_use(done);
      h->state_ = HandleState::kOffloading;
    }
  } else
#endif
  {
    block = pool_->acquire(h->nbytes_, /*wait_host=*/true);
    if (block) {
      auto host = at::from_blob(block->data(), {span}, at::TensorOptions().dtype(src.scalar_type()));
      const auto t0 = std::chrono::steady_clock::now();
      host.copy_(src.as_strided({span}, {1}, src.storage_offset()));
      host_copy_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      h->state_ = HandleState::kOnHost;
    }
  }

  std::lock_guard<std::mutex> lock(mu_);
  if (!block) {
    st_.offloads_refused += 1;
    return nullptr;
  }
  if (copy_sample.start) {
    copy_samples_.push_back(std::move(copy_sample));
    if (copy_samples_.size() > 4096) fold_samples_locked();  // stats() never called
  } else if (host_copy_ms >= 0.0 && g_profiling.load()) {
    note_copy_locked(/*d2h=*/true, h->nbytes_, host_copy_ms);
  }
  if (h->state_ == HandleState::kOffloading) {
    // The source must outlive its copy: held until the copy's event completes (poll), or handed
    // back in stream order once newer offloads have followed it (release_sources_locked).
    pending_.push_back({h->d2h_done_, src, producer_stream});
  }
  release_sources_locked(kKeepPending, garbage);
  h->block_ = std::move(block);
  st_.compacted += compact ? 1 : 0;
  st_.tensors_offloaded += 1;
  st_.bytes_offloaded += h->nbytes_;
  return h;
}

// ---------------------------------------------------------------------------------------------
// prefetch / fetch / release

void CopyEngine::refresh_state_locked(OffloadHandle& h) {
  if (h.state_ == HandleState::kOffloading && event_done(h.d2h_done_)) h.state_ = HandleState::kOnHost;
}

at::Tensor CopyEngine::allocate_dest(const OffloadHandle& h) {
  const at::TensorOptions opts = at::TensorOptions().dtype(h.dtype_).device(h.device_);
#ifdef CKPT_OFFLOAD_WITH_CUDA
  // On the current stream of the handle's device: the memory belongs to the stream that uses it.
  if (cuda_) {
    c10::cuda::CUDAGuard guard(device_.index());
    return at::empty({h.span_elems_}, opts);
  }
#endif
  return at::empty({h.span_elems_}, opts);
}

bool CopyEngine::needs_reload(const HandlePtr& h) {
  std::lock_guard<std::mutex> lock(mu_);
  return h->state_ == HandleState::kOffloading || h->state_ == HandleState::kOnHost;
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
  // Normally allocated by the caller before taking the lock (allocation can reach Python
  // dispatch modes, which take the GIL); allocated here only if the state changed meanwhile.
  h.dest_ = fresh.defined() ? std::move(fresh) : allocate_dest(h);
  if (h.nbytes_ == 0) {
    h.state_ = HandleState::kPrefetching;
    return;
  }
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (cuda_) {
    c10::cuda::CUDAGuard guard(device_.index());
    auto compute = c10::cuda::getCurrentCUDAStream(device_.index());
    check_not_capturing(compute.stream(), "reload");
    h.dest_stream_ = compute.unwrap();
    cudaStream_t h2d = as_cuda(h2d_stream_);
    // The copy waits for the allocation point (earlier users of that memory on the compute
    // stream) and for this tensor's own offload, which may still be running.
    auto allocated = std::make_shared<CudaEvent>();
    allocated->record(compute.stream());
    allocated->block(h2d);
    if (h.d2h_done_) h.d2h_done_->block(h2d);
    const bool timed = g_profiling.load();
    EventPtr start = timed ? std::make_shared<CudaEvent>(/*timing=*/true) : nullptr;
    if (start) start->record(h2d);
    CKPT_CUDA_CHECK(cudaMemcpyAsync(h.dest_.data_ptr(), h.block_->data(), h.nbytes_, cudaMemcpyHostToDevice, h2d));
    auto done = std::make_shared<CudaEvent>(/*timing=*/timed);
    done->record(h2d);
    h.h2d_done_ = done;
    h.block_->set_last_use(done);
    if (start) {
      copy_samples_.push_back({start, done, h.nbytes_, false});
      if (copy_samples_.size() > 4096) fold_samples_locked();
    }
  } else
#endif
  {
    const auto t0 = std::chrono::steady_clock::now();
    h.dest_.copy_(at::from_blob(h.block_->data(), {h.span_elems_}, at::TensorOptions().dtype(h.dtype_)));
    if (g_profiling.load()) {
      note_copy_locked(/*d2h=*/false, h.nbytes_,
                       std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  h.state_ = HandleState::kPrefetching;
  st_.tensors_prefetched += 1;
  st_.bytes_prefetched += h.nbytes_;
}

void CopyEngine::prefetch(const HandlePtr& h) {
  TORCH_CHECK_VALUE(h != nullptr, "prefetch: handle is None");
  TORCH_CHECK_VALUE(h->engine_.get() == this, "prefetch: the handle belongs to another engine");
  at::Tensor fresh = needs_reload(h) ? allocate_dest(*h) : at::Tensor();
  std::vector<at::Tensor> garbage;
  std::lock_guard<std::mutex> lock(mu_);
  if (h->state_ == HandleState::kPrefetching || h->state_ == HandleState::kFetched) {
    garbage.push_back(std::move(fresh));  // another thread started it meanwhile
    return;
  }
  prefetch_locked(*h, std::move(fresh));
}

at::Tensor CopyEngine::fetch(const HandlePtr& h) {
  TORCH_CHECK_VALUE(h != nullptr, "fetch: handle is None");
  TORCH_CHECK_VALUE(h->engine_.get() == this, "fetch: the handle belongs to another engine");
  at::Tensor fresh = needs_reload(h) ? allocate_dest(*h) : at::Tensor();
  std::vector<at::Tensor> garbage;
  std::shared_ptr<HostBlock> block;
  at::Tensor dest;
  bool other_stream = false;
  c10::Stream current_stream(c10::Stream::DEFAULT, device_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    garbage.push_back(fresh);  // dropped after unlocking if prefetch_locked does not take it
    TORCH_CHECK(h->state_ != HandleState::kFetched,
                "fetch: the handle was already fetched; expected state offloading, on_host or prefetching");
    TORCH_CHECK(h->state_ != HandleState::kReleased,
                "fetch: the handle was released; expected state offloading, on_host or prefetching");
    if (h->state_ != HandleState::kPrefetching && h->nbytes_ > 0) st_.reloads_on_demand += 1;
    prefetch_locked(*h, std::move(fresh));
#ifdef CKPT_OFFLOAD_WITH_CUDA
    if (cuda_ && h->h2d_done_) {
      c10::cuda::CUDAGuard guard(device_.index());
      auto current = c10::cuda::getCurrentCUDAStream(device_.index());
      const bool profile = g_profiling.load();
      EventPtr start, end;
      if (profile) {
        start = std::make_shared<CudaEvent>(/*timing=*/true);
        start->record(current.stream());
      }
      h->h2d_done_->block(current.stream());
      if (profile) {
        end = std::make_shared<CudaEvent>(/*timing=*/true);
        end->record(current.stream());
        wait_samples_.push_back({start, end});
        if (wait_samples_.size() > 4096) fold_samples_locked();  // stats() never called
      }
      other_stream = current.unwrap() != h->dest_stream_;
      current_stream = current.unwrap();
    }
#endif
    dest = std::move(h->dest_);
    h->dest_ = at::Tensor();
    block = std::move(h->block_);  // back to the pool, tagged with the reload's event
    h->state_ = HandleState::kFetched;
    st_.tensors_fetched += 1;
    // Backward has begun: no source needs to stay held past this point.
    release_sources_locked(0, garbage);
  }
  // Outside the lock: these reach the dispatcher (and possibly Python dispatch modes).
  // Fetched on another stream than the one that allocated it: tell the allocator, or the memory
  // could be reused while this stream still reads it.
  if (other_stream) dest.record_stream(current_stream);
  return dest.as_strided(h->sizes_, h->strides_, dest.storage_offset());
}

void CopyEngine::release_locked(OffloadHandle& h, std::vector<at::Tensor>& garbage) {
  if (h.state_ == HandleState::kReleased) return;
  if (h.state_ != HandleState::kFetched) st_.tensors_released += 1;
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (cuda_ && h.state_ == HandleState::kPrefetching && h.h2d_done_) {
    // The reload may still be writing dest: its stream must not reuse the memory before that.
    c10::cuda::CUDAGuard guard(device_.index());
    h.h2d_done_->block(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, h.dest_stream_).stream());
  }
#endif
  if (h.dest_.defined()) garbage.push_back(std::move(h.dest_));
  h.dest_ = at::Tensor();
  h.block_.reset();  // the block carries the event of the last copy that touched it
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
// polling, synchronisation, statistics

void CopyEngine::poll_locked(std::vector<at::Tensor>& garbage) {
  // One D2H stream: copies complete in the order they were queued.
  while (!pending_.empty() && event_done(pending_.front().done)) {
    garbage.push_back(std::move(pending_.front().tensor));
    pending_.pop_front();
  }
}

#ifdef CKPT_OFFLOAD_WITH_CUDA
// The stream-ordered hand-back below relies on the native caching allocator: a freed block goes
// back to its allocating stream, and recordStream on that stream is a no-op. Other backends
// (cudaMallocAsync) keep the sources until the host sees their copies complete.
static bool native_cuda_allocator() {
  static const bool native = c10::cuda::CUDACachingAllocator::get()->name() == "native";
  return native;
}
#endif

void CopyEngine::release_sources_locked(size_t keep, std::vector<at::Tensor>& garbage) {
  poll_locked(garbage);
  while (pending_.size() > keep) {
    PendingSource& p = pending_.front();
#ifdef CKPT_OFFLOAD_WITH_CUDA
    if (!event_done(p.done)) {
      if (!native_cuda_allocator()) break;  // held until poll sees the copy complete
      // The producing stream waits for the copy. The caching allocator hands freed memory out
      // again on the stream that allocated it: normally this same stream, so whatever reuses the
      // memory runs after the copy read it. A tensor allocated on another stream (a side-stream
      // input) gets this stream recorded as a user, so the allocator keeps the memory until this
      // point has run; for the allocating stream itself, and for memory the allocator did not
      // hand out, the record is a no-op.
      c10::cuda::CUDAGuard guard(device_.index());
      const c10::cuda::CUDAStream producer(c10::cuda::CUDAStream::UNCHECKED, p.stream);
      p.done->block(producer.stream());
      at::Tensor tensor = std::move(p.tensor);
      pending_.pop_front();
      if (tensor.has_storage()) {
        c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), producer);
      }
      garbage.push_back(std::move(tensor));
      continue;
    }
#endif
    garbage.push_back(std::move(p.tensor));
    pending_.pop_front();
  }
}

size_t CopyEngine::release_sources(size_t keep) {
  std::vector<at::Tensor> garbage;
  std::lock_guard<std::mutex> lock(mu_);
  release_sources_locked(keep, garbage);
  return pending_.size();
}

size_t CopyEngine::poll() {
  std::vector<at::Tensor> garbage;
  std::lock_guard<std::mutex> lock(mu_);
  poll_locked(garbage);
  return pending_.size();
}

void CopyEngine::synchronize() {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (cuda_) {
    c10::cuda::CUDAGuard guard(device_.index());
    CKPT_CUDA_CHECK(cudaStreamSynchronize(as_cuda(d2h_stream_)));
    CKPT_CUDA_CHECK(cudaStreamSynchronize(as_cuda(h2d_stream_)));
  }
#endif
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

void CopyEngine::fold_samples_locked() {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  // Fold finished measurements into the totals; unfinished ones stay for the next call.
  std::vector<WaitSample> open;
  for (auto& s : wait_samples_) {
    if (s.end->query()) {
      st_.reload_wait_ms += s.end->elapsed_ms_since(*s.start);
      st_.reload_waits_measured += 1;
    } else {
      open.push_back(s);
    }
  }
  wait_samples_.swap(open);
  std::vector<CopySample> open_copies;
  for (auto& s : copy_samples_) {
    if (s.end->query()) {
      note_copy_locked(s.d2h, s.bytes, s.end->elapsed_ms_since(*s.start));
    } else {
      open_copies.push_back(s);
    }
  }
  copy_samples_.swap(open_copies);
#endif
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
