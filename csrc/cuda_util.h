// Small helpers shared by the pool and the copy engine: the event interface both order copies by,
// checked CUDA calls and the RAII CUDA event. Everything CUDA sits behind CKPT_OFFLOAD_WITH_CUDA so
// the same sources build host-only.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>

#ifdef CKPT_OFFLOAD_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ckpt_offload {

// A point in a stream's queue of work, as the copy runtimes (runtime.h) record it: complete once
// everything queued before it has run. Shared between the pool (a block's last use) and the engine
// (a handle's copy events), hence always held by shared_ptr. A null EventPtr counts as complete.
class Event {
 public:
  virtual ~Event() = default;
  // Non-blocking: true once all work before the recorded point has run.
  virtual bool query() const = 0;
  // Blocks the calling host thread until then; callers release the GIL first.
  virtual void synchronize() const = 0;
};

using EventPtr = std::shared_ptr<Event>;

inline bool event_done(const EventPtr& e) { return !e || e->query(); }

#ifdef CKPT_OFFLOAD_WITH_CUDA

// Throws std::runtime_error (a RuntimeError in Python) carrying CUDA's own message.
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);
// Prints a warning instead of throwing: for destructors.
void warn_cuda_error(cudaError_t err, const char* call, const char* file, int line);

#define CKPT_CUDA_CHECK(expr)                                                        \
  do {                                                                               \
    cudaError_t ckpt_err_ = (expr);                                                  \
    if (ckpt_err_ != cudaSuccess) {                                                  \
      ::ckpt_offload::throw_cuda_error(ckpt_err_, #expr, __FILE__, __LINE__);       \
    }                                                                                \
  } while (0)

#define CKPT_CUDA_CHECK_WARN(expr)                                                   \
  do {                                                                               \
    cudaError_t ckpt_err_ = (expr);                                                  \
    if (ckpt_err_ != cudaSuccess) {                                                  \
      ::ckpt_offload::warn_cuda_error(ckpt_err_, #expr, __FILE__, __LINE__);        \
    }                                                                                \
  } while (0)

// True when a CUDA driver and at least one device are usable. Without a driver CUDA answers
// "insufficient driver" (35) or "no device" (100): both mean "run the host-only path".
bool cuda_runtime_usable();
// The current CUDA device; 0 when CUDA is not usable.
int current_cuda_device();

// One CUDA event owned for its whole life.
class CudaEvent : public Event {
 public:
  explicit CudaEvent(bool timing = false);
  ~CudaEvent() override;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void record(cudaStream_t stream);
  bool query() const override;
  void synchronize() const override;
  // Makes `stream` wait on the device for this event (no host synchronisation).
  void block(cudaStream_t stream) const;
  float elapsed_ms_since(const CudaEvent& start) const;
  cudaEvent_t get() const { return event_; }
  int device() const { return device_; }

 private:
  cudaEvent_t event_ = nullptr;
  int device_ = -1;
};

#else  // host-only build

inline bool cuda_runtime_usable() { return false; }
inline int current_cuda_device() { return 0; }

#endif

}  // namespace ckpt_offload
