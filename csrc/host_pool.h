// The host buffer pool: pinned (or, host-only, plain aligned) memory carved into reusable blocks.
// No torch dependency, so the C++ unit tests build against it alone.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "cuda_util.h"

namespace ckpt_offload {

class HostPool;

struct PoolStats {
  uint64_t reserved_bytes = 0;     // host memory currently held by the pool (free + in use)
  uint64_t in_use_bytes = 0;       // bytes requested by the blocks handed out now
  uint64_t peak_in_use_bytes = 0;  // the largest in_use_bytes since creation or reset_stats()
  uint64_t high_water_bytes = 0;   // the largest in_use_bytes since creation or empty_cache()
  uint64_t blocks_reserved = 0;
  uint64_t blocks_in_use = 0;
  uint64_t alloc_calls = 0;        // cudaHostAlloc / aligned_alloc calls that succeeded
  uint64_t allocated_bytes = 0;    // bytes those calls returned, cumulative
  uint64_t free_calls = 0;         // blocks given back to the system
  uint64_t hits = 0;               // acquires served from a free block
  uint64_t misses = 0;             // acquires that needed a new allocation
  uint64_t cap_refusals = 0;       // acquires refused because of the capacity cap
  uint64_t alloc_failures = 0;     // allocations the system refused (or injected failures)
  uint64_t capacity_bytes = 0;     // 0 = no cap
  bool pinned = false;
};

// A block handed out by the pool. Destroying it returns the memory to the pool; whoever holds it
// (a handle, or a tensor viewing it) therefore keeps the memory alive.
class HostBlock {
 public:
  HostBlock(std::shared_ptr<HostPool> pool, void* ptr, size_t capacity, size_t requested, EventPtr pending);
  ~HostBlock();
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;

  void* data() const { return ptr_; }
  size_t size() const { return requested_; }
  size_t capacity() const { return capacity_; }
  // The event of a copy that last read this memory and may still be running. A writer must order
  // itself after it: the engine makes its copy stream wait on it; host writers call wait_pending().
  const EventPtr& pending() const { return pending_; }
  void wait_pending();
  // Records the copy that touched the block last; the pool hands the block out again only
  // after this event has completed (or to a writer that orders itself after it).
  void set_last_use(EventPtr ev) { last_use_ = std::move(ev); }

 private:
  std::shared_ptr<HostPool> pool_;
  void* ptr_;
  size_t capacity_;
  size_t requested_;
  EventPtr pending_;
  EventPtr last_use_;
};

class HostPool : public std::enable_shared_from_this<HostPool> {
 public:
  // pinned: use cudaHostAlloc (only possible when CUDA is usable); otherwise aligned host memory.
  static std::shared_ptr<HostPool> create(bool pinned);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // Returns nullptr when the cap or the system refuses: the caller keeps its data where it is.
  // wait_host: block until a reused block's pending copy finished (host writers). Otherwise the
  // block may come with a pending() event that the caller orders its own copy after.
  std::shared_ptr<HostBlock> acquire(size_t nbytes, bool wait_host);
  // Pre-allocates free blocks for a request of nbytes (count times). Raises if refused.
  void reserve(size_t nbytes, size_t count = 1);
  // Returns every free block whose last copy has completed to the system; returns bytes freed.
  size_t empty_cache();
  // 0 removes the cap. Lowering it below what is reserved frees free blocks first.
  void set_capacity(size_t bytes);
  PoolStats stats();
  void reset_stats();  // counters to zero, peak to the bytes in use now
  bool pinned() const { return pinned_; }
  // Testing aid: the next n system allocations fail as if the host were out of pinned memory.
  void inject_alloc_failures(uint64_t n) { inject_failures_.store(n); }

  // The size a request is rounded to: 16 classes per power of two above 8 KiB (waste < 6.25%),
  // multiples of 512 bytes below. Exposed for tests.
  static size_t round_size(size_t nbytes);
  // Reserved bytes may reach this multiple of the high-water bytes in use (plus what reserve()
  // asked for) before free blocks are evicted to make room for a new one.
  static constexpr double kSlack = 1.1;
  // The largest free block a request of nbytes may take: its own size class, or up to kSlack
  // times the request when that is larger. Exposed for tests.
  static size_t max_fitting_capacity(size_t nbytes);

 private:
  explicit HostPool(bool pinned);
  friend class HostBlock;
  struct FreeBlock {
    void* ptr;
    size_t capacity;
    EventPtr last_use;
  };
  void give_back(void* ptr, size_t capacity, size_t requested, EventPtr last_use);
  void* system_alloc(size_t bytes);  // nullptr when refused
  void system_free(void* ptr);
  // Frees free blocks (completed ones first) until `reserved_ + extra <= limit`; caller holds mu_.
  void evict_until(size_t extra, size_t limit);
  void note_in_use(size_t nbytes);  // caller holds mu_
  // Allocates a class-sized block with mu_ released meanwhile; nullptr when refused.
  void* allocate_unlocked(std::unique_lock<std::mutex>& lock, size_t cls);

  const bool pinned_;
  std::mutex mu_;
  std::multimap<size_t, FreeBlock> free_;  // capacity -> block
  PoolStats st_;
  uint64_t high_water_ = 0;    // not reset by reset_stats(): the eviction policy's reference
  size_t reserve_floor_ = 0;   // bytes pre-allocated by reserve(), kept until empty_cache()
  std::atomic<uint64_t> inject_failures_{0};
};

}  // namespace ckpt_offload
