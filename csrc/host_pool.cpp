// Host buffer pool: size classes, reuse ordered by copy events, a soft capacity cap, statistics.
#include "host_pool.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace ckpt_offload {

namespace {
constexpr size_t kSmallLimit = 8192;
constexpr size_t kSmallStep = 512;
constexpr size_t kHostAlignment = 4096;

size_t round_up(size_t n, size_t step) { return (n + step - 1) / step * step; }
}  // namespace

// ---------------------------------------------------------------------------------------------
// HostBlock

HostBlock::HostBlock(std::shared_ptr<HostPool> pool, void* ptr, size_t capacity, size_t requested,
                     EventPtr pending)
    : pool_(std::move(pool)), ptr_(ptr), capacity_(capacity), requested_(requested),
      pending_(std::move(pending)) {}

HostBlock::~HostBlock() {
  // The last use is whichever copy touched the block last: a pending reader handed over by the
  // pool stays the last use if nobody recorded a newer one.
  try {
    pool_->give_back(ptr_, capacity_, requested_, last_use_ ? std::move(last_use_) : std::move(pending_));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt_offload warning: returning a host block failed: %s\n", e.what());
  }
}

void HostBlock::wait_pending() {
  if (pending_) {
    pending_->synchronize();
    pending_.reset();
  }
}

// ---------------------------------------------------------------------------------------------
// HostPool

std::shared_ptr<HostPool> HostPool::create(bool pinned) {
  if (pinned && !cuda_runtime_usable()) {
    throw std::invalid_argument(
        "ckpt_offload: HostPool(pinned=True) needs a CUDA build and a usable CUDA driver; "
        "use pinned=False for plain host memory");
  }
  return std::shared_ptr<HostPool>(new HostPool(pinned));
}

HostPool::HostPool(bool pinned) : pinned_(pinned) { st_.pinned = pinned; }

HostPool::~HostPool() {
  // Blocks in use hold a reference to the pool, so only free blocks remain here.
  for (auto& kv : free_) {
    if (kv.second.last_use) {
      try {
        kv.second.last_use->synchronize();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ckpt_offload warning: %s\n", e.what());
      }
    }
    system_free(kv.second.ptr);
  }
}

size_t HostPool::round_size(size_t nbytes) {
  if (nbytes <= kSmallLimit) return std::max(kSmallStep, round_up(nbytes, kSmallStep));
  int log2 = 63 - __builtin_clzll(static_cast<unsigned long long>(nbytes));
  return round_up(nbytes, size_t{1} << (log2 - 4));
}

size_t HostPool::max_fitting_capacity(size_t nbytes) {
  return std::max(round_size(nbytes), static_cast<size_t>(kSlack * static_cast<double>(nbytes)));
}

void* HostPool::system_alloc(size_t bytes) {
  uint64_t pending = inject_failures_.load();
  while (pending > 0) {
    if (inject_failures_.compare_exchange_weak(pending, pending - 1)) return nullptr;
  }
  void* ptr = nullptr;
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (pinned_) {
    // Portable: any device may copy from or to the block, so one pool serves every GPU.
    cudaError_t err = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    CKPT_CUDA_CHECK(err);
    return ptr;
  }
#endif
  if (posix_memalign(&ptr, kHostAlignment, std::max<size_t>(bytes, 1)) != 0) return nullptr;
  return ptr;
}

void HostPool::system_free(void* ptr) {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (pinned_) {
    CKPT_CUDA_CHECK_WARN(cudaFreeHost(ptr));
    return;
  }
#endif
  std::free(ptr);
}

void HostPool::evict_until(size_t extra, size_t limit) {
  // Completed blocks first, largest first: the fewest frees that make room. A block whose last
  // copy is still running is waited for before it goes back to the system.
  for (int pass = 0; pass < 2 && st_.reserved_bytes + extra > limit; ++pass) {
    for (auto it = free_.end(); it != free_.begin() && st_.reserved_bytes + extra > limit;) {
      --it;
      FreeBlock& fb = it->second;
      if (pass == 0 && !event_done(fb.last_use)) continue;
      if (fb.last_use) fb.last_use->synchronize();
      system_free(fb.ptr);
      st_.reserved_bytes -= fb.capacity;
      st_.blocks_reserved -= 1;
      st_.free_calls += 1;
      it = free_.erase(it);
    }
  }
}

std::shared_ptr<HostBlock> HostPool::acquire(size_t nbytes, bool wait_host) {
  const size_t cls = round_size(nbytes);
  std::shared_ptr<HostBlock> block;
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Smallest fitting free block: the exact class first, else a larger one of at most kSlack
    // times the request (shapes that differ a little from step to step share blocks instead of
    // allocating every step). Bounding a block by the request it serves, not by its class, keeps
    // every block in use within kSlack of its request, so the eviction below can always bring
    // reserved bytes back within kSlack of the high-water mark.
    // Preference: exact class and idle, exact class with a copy still reading it, larger and
    // idle, larger and busy; the first that exists wins.
    const size_t largest = max_fitting_capacity(nbytes);
    auto pick = free_.end();
    int best = 4;
    for (auto it = free_.lower_bound(cls); it != free_.end() && it->first <= largest && best > 0; ++it) {
      const int rank = (it->first == cls ? 0 : 2) + (event_done(it->second.last_use) ? 0 : 1);
      if (rank < best) {
        best = rank;
        pick = it;
      }
    }

    if (pick != free_.end()) {
      FreeBlock fb = pick->second;
      free_.erase(pick);
      st_.hits += 1;
      note_in_use(nbytes);
      EventPtr pending = event_done(fb.last_use) ? nullptr : fb.last_use;
      block = std::make_shared<HostBlock>(shared_from_this(), fb.ptr, fb.capacity, nbytes, std::move(pending));
    } else {
      // Keep reserved bytes within kSlack of the largest working set seen (or what reserve()
      // asked for): free blocks of sizes no longer used go back before a new one is pinned.
      const uint64_t high_after = std::max(high_water_, st_.in_use_bytes + nbytes);
      evict_until(cls, reserve_floor_ + static_cast<size_t>(kSlack * static_cast<double>(high_after)));
      if (st_.capacity_bytes > 0 && st_.reserved_bytes + cls > st_.capacity_bytes) {
        evict_until(cls, st_.capacity_bytes);
        if (st_.reserved_bytes + cls > st_.capacity_bytes) {
          st_.cap_refusals += 1;
          return nullptr;
        }
      }
      st_.misses += 1;
      void* ptr = allocate_unlocked(lock, cls);
      if (ptr == nullptr) {
        // Give the system back what is free, then try once more.
        const size_t before = st_.reserved_bytes;
        evict_until(1, 0);
        if (st_.reserved_bytes == before) return nullptr;
        ptr = allocate_unlocked(lock, cls);
        if (ptr == nullptr) return nullptr;
      }
      st_.alloc_calls += 1;
      st_.allocated_bytes += cls;
      note_in_use(nbytes);
      block = std::make_shared<HostBlock>(shared_from_this(), ptr, cls, nbytes, nullptr);
    }
  }
  if (wait_host) block->wait_pending();
  return block;
}

void* HostPool::allocate_unlocked(std::unique_lock<std::mutex>& lock, size_t cls) {
  // Accounted before allocating so concurrent acquires respect the cap, then allocated without
  // the lock: pinning takes about half a second per GiB.
  st_.reserved_bytes += cls;
  st_.blocks_reserved += 1;
  lock.unlock();
  void* ptr = nullptr;
  try {
    ptr = system_alloc(cls);
  } catch (...) {
    lock.lock();
    st_.reserved_bytes -= cls;  // undo, and let the CUDA error through
    st_.blocks_reserved -= 1;
    throw;
  }
  lock.lock();
  if (ptr == nullptr) {
    st_.reserved_bytes -= cls;
    st_.blocks_reserved -= 1;
    st_.alloc_failures += 1;
  }
  return ptr;
}

void HostPool::note_in_use(size_t nbytes) {
  st_.in_use_bytes += nbytes;
  st_.blocks_in_use += 1;
  st_.peak_in_use_bytes = std::max(st_.peak_in_use_bytes, st_.in_use_bytes);
  high_water_ = std::max(high_water_, st_.in_use_bytes);
}

void HostPool::reserve(size_t nbytes, size_t count) {
  const size_t cls = round_size(nbytes);
  for (size_t i = 0; i < count; ++i) {
    std::unique_lock<std::mutex> lock(mu_);
    if (st_.capacity_bytes > 0 && st_.reserved_bytes + cls > st_.capacity_bytes) {
      throw std::runtime_error("ckpt_offload: reserve(" + std::to_string(nbytes) + ") would exceed the pool's capacity of " +
                               std::to_string(st_.capacity_bytes) + " bytes (" +
                               std::to_string(st_.reserved_bytes) + " reserved)");
    }
    void* ptr = allocate_unlocked(lock, cls);
    if (ptr == nullptr) {
      throw std::runtime_error("ckpt_offload: the system refused a host allocation of " + std::to_string(cls) +
                               " bytes" + (pinned_ ? " (pinned)" : ""));
    }
    st_.alloc_calls += 1;
    st_.allocated_bytes += cls;
    reserve_floor_ += cls;
    free_.emplace(cls, FreeBlock{ptr, cls, nullptr});
  }
}

size_t HostPool::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  reserve_floor_ = 0;
  high_water_ = st_.in_use_bytes;
  size_t freed = 0;
  for (auto it = free_.begin(); it != free_.end();) {
    if (!event_done(it->second.last_use)) {
      ++it;
      continue;
    }
    system_free(it->second.ptr);
    freed += it->second.capacity;
    st_.reserved_bytes -= it->second.capacity;
    st_.blocks_reserved -= 1;
    st_.free_calls += 1;
    it = free_.erase(it);
  }
  return freed;
}

void HostPool::set_capacity(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  st_.capacity_bytes = bytes;
  if (bytes > 0 && st_.reserved_bytes > bytes) evict_until(0, bytes);
}

PoolStats HostPool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  PoolStats out = st_;
  out.high_water_bytes = high_water_;
  return out;
}

void HostPool::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  st_.alloc_calls = st_.allocated_bytes = st_.free_calls = 0;
  st_.hits = st_.misses = st_.cap_refusals = st_.alloc_failures = 0;
  st_.peak_in_use_bytes = st_.in_use_bytes;
}

void HostPool::give_back(void* ptr, size_t capacity, size_t requested, EventPtr last_use) {
  std::lock_guard<std::mutex> lock(mu_);
  st_.in_use_bytes -= requested;
  st_.blocks_in_use -= 1;
  free_.emplace(capacity, FreeBlock{ptr, capacity, std::move(last_use)});
}

}  // namespace ckpt_offload
