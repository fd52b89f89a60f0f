// Checked CUDA calls and the RAII CUDA event used by the pool and the copy engine.
#include "cuda_util.h"

#include <cstdio>

namespace ckpt_offload {

#ifdef CKPT_OFFLOAD_WITH_CUDA

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  // Clear the sticky-free error state so the next call does not report this one again.
  (void)cudaGetLastError();
  throw std::runtime_error(std::string("ckpt_offload: CUDA error ") + std::to_string(static_cast<int>(err)) +
                           " (" + cudaGetErrorName(err) + ": " + cudaGetErrorString(err) + ") in " + call +
                           " at " + file + ":" + std::to_string(line));
}

void warn_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  (void)cudaGetLastError();
  std::fprintf(stderr, "ckpt_offload warning: CUDA error %d (%s) in %s at %s:%d\n", static_cast<int>(err),
               cudaGetErrorString(err), call, file, line);
}

bool cuda_runtime_usable() {
  static const bool usable = [] {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return count > 0;
  }();
  return usable;
}

int current_cuda_device() {
  int current = 0;
  if (cuda_runtime_usable()) CKPT_CUDA_CHECK(cudaGetDevice(&current));
  return current;
}

CudaEvent::CudaEvent(bool timing) {
  CKPT_CUDA_CHECK(cudaGetDevice(&device_));
  CKPT_CUDA_CHECK(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
}

namespace {

// The event's device made current for one call, and the caller's restored after. The disk tier's
// worker threads wait for and drop events with no device of their own: the runtime would otherwise
// bind device 0's context to them (a context on GPU 0 for every rank of a node).
class OnDevice {
 public:
  explicit OnDevice(int device) {
    if (device < 0 || cudaGetDevice(&prev_) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    if (prev_ != device && cudaSetDevice(device) == cudaSuccess) {
      changed_ = true;
    } else {
      (void)cudaGetLastError();
    }
  }
  ~OnDevice() {
    if (changed_) CKPT_CUDA_CHECK_WARN(cudaSetDevice(prev_));
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  int prev_ = -1;
  bool changed_ = false;
};

}  // namespace

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) {
    OnDevice on(device_);
    CKPT_CUDA_CHECK_WARN(cudaEventDestroy(event_));
  }
}

void CudaEvent::record(cudaStream_t stream) { CKPT_CUDA_CHECK(cudaEventRecord(event_, stream)); }

bool CudaEvent::query() const {
  cudaError_t err = cudaEventQuery(event_);
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  throw_cuda_error(err, "cudaEventQuery", __FILE__, __LINE__);
}

void CudaEvent::synchronize() const {
  OnDevice on(device_);  // may run on a disk-tier worker thread
  CKPT_CUDA_CHECK(cudaEventSynchronize(event_));
}

void CudaEvent::block(cudaStream_t stream) const { CKPT_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0)); }

float CudaEvent::elapsed_ms_since(const CudaEvent& start) const {
  float ms = 0.f;
  CKPT_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, event_));
  return ms;
}

#endif

}  // namespace ckpt_offload
