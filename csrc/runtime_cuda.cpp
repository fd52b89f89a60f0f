// The CUDA runtime: the engine's two copy streams, CUDA events, cudaMemcpyAsync, and the caching
// allocator's stream bookkeeping. The only place the copy engine's CUDA calls live.
#ifdef CKPT_OFFLOAD_WITH_CUDA

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <mutex>

#include "runtime.h"

namespace ckpt_offload {

namespace {

cudaStream_t raw(const c10::Stream& s) { return c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, s).stream(); }

// Swallows warnings for the current thread while alive.
class QuietWarnings : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

class CudaRuntime : public CopyRuntime {
 public:
  explicit CudaRuntime(const c10::Device& device) : index_(device.index()) {
    TORCH_CHECK_VALUE(device.has_index(), "CopyEngine: a CUDA device needs an index, got ", device);
    c10::cuda::CUDAGuard guard(index_);  // streams belong to this engine's device
    cudaStream_t d2h = nullptr, h2d = nullptr;
    CKPT_CUDA_CHECK(cudaStreamCreateWithFlags(&d2h, cudaStreamNonBlocking));
    CKPT_CUDA_CHECK(cudaStreamCreateWithFlags(&h2d, cudaStreamNonBlocking));
    d2h_ = c10::cuda::getStreamFromExternal(d2h, index_).unwrap();
    h2d_ = c10::cuda::getStreamFromExternal(h2d, index_).unwrap();
  }

  ~CudaRuntime() override {
    int previous = -1;
    CKPT_CUDA_CHECK_WARN(cudaGetDevice(&previous));
    CKPT_CUDA_CHECK_WARN(cudaSetDevice(index_));
    for (const c10::Stream* s : {&d2h_, &h2d_}) {
      CKPT_CUDA_CHECK_WARN(cudaStreamSynchronize(raw(*s)));
      CKPT_CUDA_CHECK_WARN(cudaStreamDestroy(raw(*s)));
    }
    if (previous >= 0) CKPT_CUDA_CHECK_WARN(cudaSetDevice(previous));
  }

  const char* name() const override { return "cuda"; }

  c10::Stream current_stream() override { return c10::cuda::getCurrentCUDAStream(index_).unwrap(); }

  // A graph replay cannot follow the host-side bookkeeping (pool blocks, polled sources), and
  // pinned allocation is illegal while capturing: refuse clearly instead of recording garbage.
  void check_usable(const c10::Stream& compute, const char* what) override {
    c10::cuda::CUDAGuard guard(index_);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    CKPT_CUDA_CHECK(cudaStreamIsCapturing(raw(compute), &status));
    TORCH_CHECK(status == cudaStreamCaptureStatusNone, "ckpt_offload: ", what,
                " during CUDA graph capture is not supported; run the captured region without offload");
  }

  EventPtr record(const c10::Stream& stream, bool timing) override {
    c10::cuda::CUDAGuard guard(index_);
    auto e = std::make_shared<CudaEvent>(timing);
    e->record(raw(stream));
    return e;
  }

  void wait(const c10::Stream& stream, const EventPtr& event) override {
    if (!event) return;
    if (auto* e = dynamic_cast<const CudaEvent*>(event.get())) {
      c10::cuda::CUDAGuard guard(index_);
      e->block(raw(stream));
    } else {
      event->synchronize();  // a host event (a block last used by a host-path engine): complete
    }
  }

  void copy(const c10::Stream& stream, void* dst, const void* src, size_t nbytes, uint64_t) override {
    c10::cuda::CUDAGuard guard(index_);
    const cudaMemcpyKind kind = stream == d2h_ ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
    CKPT_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, kind, raw(stream)));
  }

  double elapsed_ms(const EventPtr& start, const EventPtr& end) override {
    auto* a = dynamic_cast<const CudaEvent*>(start.get());
    auto* b = dynamic_cast<const CudaEvent*>(end.get());
    if (a == nullptr || b == nullptr) return 0.0;
    return b->elapsed_ms_since(*a);
  }

  // Device time is read relative to an anchor event recorded on an idle device, whose host time is
  // known; re-anchored at each timeline start (float milliseconds lose precision over hours).
  void anchor_clock() override {
    c10::cuda::CUDAGuard guard(index_);
    auto e = std::make_shared<CudaEvent>(/*timing=*/true);
    CKPT_CUDA_CHECK(cudaDeviceSynchronize());
    e->record(raw(current_stream()));
    e->synchronize();
    std::lock_guard<std::mutex> lock(anchor_mu_);
    anchor_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(
                     std::chrono::steady_clock::now().time_since_epoch()).count();
    anchor_ = std::move(e);
  }

  int64_t event_time_ns(const EventPtr& event) override {
    auto* e = dynamic_cast<const CudaEvent*>(event.get());
    std::lock_guard<std::mutex> lock(anchor_mu_);
    if (e == nullptr || !anchor_ || !e->query()) return -1;
    return anchor_ns_ + static_cast<int64_t>(static_cast<double>(e->elapsed_ms_since(*anchor_)) * 1e6);
  }

  void synchronize() override {
    c10::cuda::CUDAGuard guard(index_);
    CKPT_CUDA_CHECK(cudaStreamSynchronize(raw(d2h_)));
    CKPT_CUDA_CHECK(cudaStreamSynchronize(raw(h2d_)));
  }

  // Both allocator backends free in stream order once every stream that used the memory is known:
  // the native one hands a freed block out again on its allocating stream only, after the events
  // of recorded streams; cudaMallocAsync calls cudaFreeAsync on the allocating stream, or, with
  // recorded streams, on a stream joined with each of them at the time of the free. A producer that
  // waited for the copy before the reference is dropped therefore orders any reuse after the copy.
  // Memory the allocator did not hand out (from_blob, DLPack) has no such order: it is held until
  // the host sees its copy complete.
  bool frees_in_stream_order(const at::Tensor& src) override {
    if (!src.has_storage()) return true;
    const c10::DataPtr& ptr = src.storage().data_ptr();
    return ptr.get() == nullptr || ptr.get_deleter() == c10::cuda::CUDACachingAllocator::get()->raw_deleter();
  }

  // For a source allocated on another stream (a side-stream input), the producer becomes a user
  // the allocator waits for. cudaMallocAsync warns when the stream is the allocating one, which
  // cannot be told from here: that warning is muted (recording it is a no-op there).
  void record_use(const at::Tensor& src, const c10::Stream& stream) override {
    if (!src.has_storage() || src.storage().data_ptr().get() == nullptr) return;
    QuietWarnings quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(),
                                                  c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream));
  }

 private:
  const c10::DeviceIndex index_;
  std::mutex anchor_mu_;
  std::shared_ptr<CudaEvent> anchor_;  // timeline: the reference event, and its host time
  int64_t anchor_ns_ = 0;
};

}  // namespace

std::unique_ptr<CopyRuntime> make_cuda_runtime(const c10::Device& device) {
  return std::make_unique<CudaRuntime>(device);
}

}  // namespace ckpt_offload

#endif  // CKPT_OFFLOAD_WITH_CUDA
