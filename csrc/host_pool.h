// The host buffer pool: pinned (or, host-only, plain aligned) memory in reusable blocks, served best
// fit so that steps of shorter shapes reuse the blocks of the longest. No torch dependency.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_util.h"

namespace ckpt_offload {

class HostPool;
class SpillTier;  // spill.h: the disk tier under the pool

struct PoolStats {
  uint64_t reserved_bytes = 0;     // host memory currently held by the pool (free + in use)
  uint64_t in_use_bytes = 0;       // bytes requested by the blocks handed out now
  uint64_t peak_in_use_bytes = 0;  // the largest in_use_bytes since creation or reset_stats()
  uint64_t high_water_bytes = 0;   // the largest in_use_bytes since creation or empty_cache()
  uint64_t in_use_block_bytes = 0; // capacity of the blocks handed out now (>= in_use_bytes)
  uint64_t working_set_bytes = 0;  // the largest in_use_block_bytes since creation or empty_cache()
  uint64_t blocks_reserved = 0;
  uint64_t blocks_in_use = 0;
  uint64_t alloc_calls = 0;        // cudaHostAlloc / aligned_alloc calls that succeeded
  uint64_t allocated_bytes = 0;    // bytes those calls returned, cumulative
  uint64_t free_calls = 0;         // blocks given back to the system
  uint64_t hits = 0;               // acquires served from a free block
  uint64_t misses = 0;             // acquires that needed a new allocation
  uint64_t cap_refusals = 0;       // acquires refused because of the capacity cap
  uint64_t alloc_failures = 0;     // allocations the system refused (or injected failures)
  uint64_t node_refusals = 0;      // acquires refused because the node had too little memory left
  uint64_t capacity_bytes = 0;     // 0 = no cap
  uint64_t failed_alloc_bytes = 0; // the size of the last allocation the system refused (0: none)
  int64_t numa_node = -1;          // the node set_numa_cpus() places growth on; -1: not placed
  uint64_t numa_placed_allocs = 0; // allocations made with the thread bound to that node's CPUs
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

// The pool's rule, exactly. H = high_water_bytes (the most bytes requested in use at once), W =
// working_set_bytes (the most block capacity in use at once), both since creation or empty_cache().
//
// 1. Fit: a request takes the smallest free block whose capacity is at least its size class
//    (round_size), however much larger; among blocks of that capacity, one whose last copy has
//    completed first. So once the blocks of the largest step are in the pool, a step whose requests
//    can be paired one to one with those of that step, each no larger ("a shorter or equal step":
//    the same model at a shorter sequence length), is served entirely from free blocks: no
//    allocation, no free. (Smallest-fit never fails where such a pairing exists: a request that
//    takes a block another request needed leaves it a block at least as large.)
// 2. Growth: only a request that no free block fits allocates, one block of its own class.
// 3. Return to the system: only (a) empty_cache(), (b) reserve() and set_capacity(), explicit calls,
//    (c) the capacity cap, and (d) the reserve bound below, which acts as a cap: an acquire that
//    allocates first returns free blocks (all smaller than its request, by rule 1; idle and
//    smallest first) until reserved + the new block <= max(kReserveBound x H, W). An acquire served
//    from a free block never frees, so a step of shorter or equal shapes never does.
// Bound: reserved_bytes <= max(kReserveBound x H, W) at all times (after reserve(), H and W count
// its sizes as held at once): the limit in (d) is never below what is in use plus the new block,
// so evicting can always meet it. Every block is within 1/16 of the request it was allocated for
// (above 8 KiB; below, within 511 bytes), so W <= 1.0625 x H, hence reserved <= 1.15 x H, in the
// two cases training produces, where a step holds all its requests at once: (i) the longest step
// came first (or was reserved): later steps allocate nothing, so reserved stays the longest
// step's classes; (ii) every step makes k requests of one size (a model's checkpointed inputs,
// batch x length x hidden): no block exceeds the class of the largest request m, at most k are in
// use, and H >= k x m. For arbitrary sequences W can exceed H, and no rule can promise 1.15 x H
// without freeing on the offload path: after one request of S, a step of two requests of 0.6 S
// must either free the S block or hold 1.6 S for 1.2 S requested; here the first takes the S
// block (rule 1) and the pool holds 1.6 S = W.
// Growing sizes: a new largest step allocates at most one block per request whose class grew (a
// growing sequence costs about one allocation per layer per new size class) and frees the smaller
// blocks the bound no longer allows.
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
  // over_cap: serve past the capacity cap (a read back from the disk tier that cannot wait).
  std::shared_ptr<HostBlock> acquire(size_t nbytes, bool wait_host, bool over_cap = false);
  // Whether acquire(nbytes) would be served within the cap now (from a free block or by growing).
  bool fits(size_t nbytes);
  // The disk tier that takes what the cap refuses (set_spill_dir), or null. Set to null to stop.
  std::shared_ptr<SpillTier> spill();
  void set_spill(std::shared_ptr<SpillTier> tier);
  // One call, one step shape: makes sure that requests of these sizes, held at once, are served
  // from free blocks: pairs them
  // (largest first, best fit) with the free blocks and allocates only what is left, so a second
  // call with the same sizes allocates nothing. H and W then count these requests as held at once
  // beside what is in use now; free blocks outside the pairing go back to the system if the bound
  // needs it. Raises (std::runtime_error) when the cap or the system refuses; what was allocated
  // before stays as free blocks.
  void reserve(const std::vector<size_t>& sizes);
  void reserve(size_t nbytes, size_t count = 1) { reserve(std::vector<size_t>(count, nbytes)); }
  // Returns every free block whose last copy has completed to the system; returns bytes freed.
  // H and W restart from what is in use now.
  size_t empty_cache();
  // 0 removes the cap. Lowering it below what is reserved frees free blocks first.
  void set_capacity(size_t bytes);
  // Before the pool grows (acquire, reserve), what the node has available must stay at or above
  // `reserve` bytes after the allocation, else acquire refuses (node_refusals) and reserve throws:
  // MemAvailable from `meminfo`, and for each cgroup of `cgroups` its limit less its usage (the
  // inactive file pages not counted), the least of them. Read at each growth, never cached; a figure that cannot be read does
  // not refuse. An empty meminfo and no cgroup turn the guard off. Reads back past the cap
  // (over_cap) are not refused: backward needs them.
  // Each cgroup: (limit, usage file, memory.stat file, the stat's key of inactive file pages, which
  // count as usage but are page cache the kernel drops first).
  using CgroupFiles = std::tuple<uint64_t, std::string, std::string, std::string>;
  void set_node_guard(std::string meminfo, std::vector<CgroupFiles> cgroups, uint64_t reserve);
  // What the guard reads as available now (the least of its figures), or -1 when it is off or reads nothing.
  int64_t node_available();
  PoolStats stats();
  void reset_stats();  // counters to zero, peak to the bytes in use now
  bool pinned() const { return pinned_; }
  // Testing aid: the next n system allocations fail as if the host were out of pinned memory.
  void inject_alloc_failures(uint64_t n) { inject_failures_.store(n); }
  // Testing aid: called by each system allocation, with the pool lock released, before it allocates.
  void set_alloc_hook(void (*hook)(size_t bytes)) { alloc_hook_.store(hook); }
  // Testing aid: pinning limited apart from RAM. A system allocation larger than per_alloc bytes
  // fails (WSL2 refuses pinned allocations over about 500 MB), and so does one that would bring
  // what the pool holds from the system past total bytes (a memlock limit). 0: no limit.
  void set_alloc_limit(uint64_t per_alloc, uint64_t total) {
    limit_per_alloc_.store(per_alloc);
    limit_total_.store(total);
  }
  // NUMA placement: from now on each system allocation runs with the calling thread bound to these
  // CPUs (the node's), so the pages are placed on `node` as they are first touched (cudaHostAlloc
  // touches them as it pins; plain host memory is touched here); the thread's own affinity is put
  // back afterwards. An empty list stops it. The caller decides whether to place at all (engine.py).
  void set_numa_cpus(int64_t node, const std::vector<int>& cpus);
  // Testing aid: the CPUs the allocating thread was bound to during the last system allocation, as
  // the kernel read them back then; empty when it was not bound.
  std::vector<int> last_alloc_cpus();

  // The size a request is rounded to: 16 classes per power of two above 8 KiB (waste < 6.25%),
  // multiples of 512 bytes below. Exposed for tests.
  static size_t round_size(size_t nbytes);
  // See the rule above: reserved <= max(kReserveBound x H, W).
  static constexpr double kReserveBound = 1.15;

 private:
  explicit HostPool(bool pinned);
  friend class HostBlock;
  struct FreeBlock {
    void* ptr;
    size_t capacity;
    EventPtr last_use;
  };
  using FreeMap = std::multimap<size_t, FreeBlock>;  // capacity -> block
  void give_back(void* ptr, size_t capacity, size_t requested, EventPtr last_use);
  void* system_alloc(size_t bytes);  // nullptr when refused
  void* bound_alloc(size_t bytes);   // system_alloc's allocation, on the NUMA node's CPUs when set
  void system_free(void* ptr, size_t bytes);
  // Rule 1: the smallest free block of capacity >= cls (idle preferred at that capacity), or end().
  FreeMap::iterator best_fit(size_t cls);
  // Frees free blocks (idle ones first, smallest first) until `reserved_ + extra <= limit`; caller
  // holds mu_.
  void evict_until(size_t extra, size_t limit);
  static size_t bound_limit(uint64_t high_water, uint64_t working_set);  // max(kReserveBound x H, W)
  void note_in_use(size_t nbytes, size_t capacity);  // caller holds mu_
  // Allocates a class-sized block with mu_ released meanwhile; nullptr when refused.
  void* allocate_unlocked(std::unique_lock<std::mutex>& lock, size_t cls);

  const bool pinned_;
  std::mutex mu_;
  std::string guard_meminfo_;                                  // under mu_, as the three below
  std::vector<CgroupFiles> guard_cgroups_;
  uint64_t guard_reserve_ = 0;
  bool guard_on_ = false;
  bool node_has_room(size_t bytes);  // caller holds mu_
  int64_t node_available_locked();
  FreeMap free_;
  PoolStats st_;
  uint64_t high_water_ = 0;   // H; not reset by reset_stats(): the bound's reference
  uint64_t working_set_ = 0;  // W; likewise
  std::atomic<uint64_t> inject_failures_{0};
  std::atomic<void (*)(size_t)> alloc_hook_{nullptr};
  std::atomic<uint64_t> limit_per_alloc_{0};
  std::atomic<uint64_t> limit_total_{0};
  std::atomic<uint64_t> system_bytes_{0};  // what the pool holds from the system now
  std::mutex numa_mu_;                     // guards the three below (taken with or without mu_)
  std::vector<int> numa_cpus_;
  std::vector<int> last_alloc_cpus_;
  uint64_t numa_placed_ = 0;
  // Bytes being allocated with mu_ released (allocate_unlocked): not yet in what the node guard
  // reads, so it counts them itself. Under mu_.
  uint64_t growing_bytes_ = 0;
  std::shared_ptr<SpillTier> spill_;  // under mu_
};

}  // namespace ckpt_offload
