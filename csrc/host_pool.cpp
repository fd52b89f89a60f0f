// Host buffer pool: size classes, best-fit reuse ordered by copy events, the reserve bound, a soft
// capacity cap, statistics; pinned allocations made in a context that already exists.
#include "host_pool.h"

#include "spill.h"

#include <fcntl.h>
#include <unistd.h>
#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#ifdef CKPT_OFFLOAD_WITH_CUDA
#include <cuda.h>  // driver types only: the functions come from the runtime's driver entry points
#endif

namespace ckpt_offload {

namespace {
constexpr size_t kSmallLimit = 8192;
constexpr size_t kSmallStep = 512;
constexpr size_t kHostAlignment = 4096;

size_t round_up(size_t n, size_t step) { return (n + step - 1) / step * step; }

#ifdef CKPT_OFFLOAD_WITH_CUDA
// cudaHostAlloc and cudaFreeHost act in the calling thread's current context. With none current,
// the runtime makes the primary context of the thread's current device current, creating it if
// needed; a thread that never selected a device gets device 0, so pinning from such a thread (a
// pool filled before set_device, a block freed on a data-loading thread) would create a context,
// hundreds of MiB, on GPU 0 in every rank. Portable pinned memory serves every context, so any
// context that already exists will do: this guard makes one current for the call, the primary
// context of the thread's current device when it is active, else of the first device whose primary
// context is active, and touches nothing when a context is current already. Only when no context
// exists at all does the runtime create one, on the caller's current device. The driver functions
// come through the runtime's entry-point query, so nothing links against libcuda.
struct DriverCalls {
  using GetCurrent = CUresult (*)(CUcontext*);
  using SetCurrent = CUresult (*)(CUcontext);
  using GetState = CUresult (*)(CUdevice, unsigned int*, int*);
  using Retain = CUresult (*)(CUcontext*, CUdevice);
  using Release = CUresult (*)(CUdevice);
  using DeviceGet = CUresult (*)(CUdevice*, int);
  GetCurrent get_current = nullptr;
  SetCurrent set_current = nullptr;
  GetState get_state = nullptr;
  Retain retain = nullptr;
  Release release = nullptr;
  DeviceGet device_get = nullptr;
  bool ok = false;

  static const DriverCalls& get() {
    static const DriverCalls calls = [] {
      DriverCalls c;
      auto load = [](const char* name, auto& fn) {
        void* ptr = nullptr;
        cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
        const cudaError_t err = cudaGetDriverEntryPointByVersion(name, &ptr, 12000, cudaEnableDefault, &found);
#else  // CUDA 12.0-12.4: the unversioned query (removed in CUDA 13); setup.py refuses older toolkits
        const cudaError_t err = cudaGetDriverEntryPoint(name, &ptr, cudaEnableDefault, &found);
#endif
        if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
          (void)cudaGetLastError();
          return false;
        }
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(ptr);
        return true;
      };
      c.ok = load("cuCtxGetCurrent", c.get_current) && load("cuCtxSetCurrent", c.set_current) &&
             load("cuDevicePrimaryCtxGetState", c.get_state) && load("cuDevicePrimaryCtxRetain", c.retain) &&
             load("cuDevicePrimaryCtxRelease", c.release) && load("cuDeviceGet", c.device_get);
      return c;
    }();
    return calls;
  }
};

class ExistingContextGuard {
 public:
  ExistingContextGuard() {
    const DriverCalls& d = DriverCalls::get();
    CUcontext current = nullptr;
    if (!d.ok || d.get_current(&current) != CUDA_SUCCESS || current != nullptr) return;
    int preferred = 0, count = 0;
    if (cudaGetDevice(&preferred) != cudaSuccess || cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    for (int i = -1; i < count; ++i) {
      const int ordinal = i < 0 ? preferred : i;
      CUdevice dev = 0;
      unsigned int flags = 0;
      int active = 0;
      if (d.device_get(&dev, ordinal) != CUDA_SUCCESS || d.get_state(dev, &flags, &active) != CUDA_SUCCESS ||
          !active) {
        continue;
      }
      CUcontext ctx = nullptr;
      if (d.retain(&ctx, dev) != CUDA_SUCCESS) continue;  // active: retaining creates nothing
      if (d.set_current(ctx) != CUDA_SUCCESS) {
        d.release(dev);
        continue;
      }
      dev_ = dev;
      set_ = true;
      return;
    }
  }
  ~ExistingContextGuard() {
    if (!set_) return;
    const DriverCalls& d = DriverCalls::get();
    d.set_current(nullptr);  // the thread had no current context: leave it so
    d.release(dev_);
  }
  ExistingContextGuard(const ExistingContextGuard&) = delete;
  ExistingContextGuard& operator=(const ExistingContextGuard&) = delete;

 private:
  CUdevice dev_ = 0;
  bool set_ = false;
};
#endif
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
  if (spill_) spill_->stop();
  // Blocks in use hold a reference to the pool, so only free blocks remain here.
  for (auto& kv : free_) {
    if (kv.second.last_use) {
      try {
        kv.second.last_use->synchronize();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ckpt_offload warning: %s\n", e.what());
      }
    }
    system_free(kv.second.ptr, kv.second.capacity);
  }
}

size_t HostPool::round_size(size_t nbytes) {
  if (nbytes <= kSmallLimit) return std::max(kSmallStep, round_up(nbytes, kSmallStep));
  int log2 = 63 - __builtin_clzll(static_cast<unsigned long long>(nbytes));
  return round_up(nbytes, size_t{1} << (log2 - 4));
}

namespace {
#ifdef __linux__
// Binds the calling thread to a set of CPUs for its lifetime and puts its own affinity back after.
class ThreadBinding {
 public:
  explicit ThreadBinding(const std::vector<int>& cpus) {
    if (cpus.empty()) return;
    cpu_set_t want;
    CPU_ZERO(&want);
    for (int c : cpus) {
      if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &want);
    }
    if (CPU_COUNT(&want) == 0 || pthread_getaffinity_np(pthread_self(), sizeof saved_, &saved_) != 0) return;
    if (pthread_setaffinity_np(pthread_self(), sizeof want, &want) != 0) return;  // not bound: allocate as is
    bound_ = true;
    cpu_set_t now;
    if (pthread_getaffinity_np(pthread_self(), sizeof now, &now) == 0) {
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &now)) seen_.push_back(c);
      }
    }
  }
  ~ThreadBinding() {
    if (bound_) pthread_setaffinity_np(pthread_self(), sizeof saved_, &saved_);
  }
  ThreadBinding(const ThreadBinding&) = delete;
  ThreadBinding& operator=(const ThreadBinding&) = delete;
  bool bound() const { return bound_; }
  std::vector<int> seen() const { return seen_; }

 private:
  cpu_set_t saved_;
  bool bound_ = false;
  std::vector<int> seen_;
};
#else
class ThreadBinding {
 public:
  explicit ThreadBinding(const std::vector<int>&) {}
  bool bound() const { return false; }
  std::vector<int> seen() const { return {}; }
};
#endif
}  // namespace

void HostPool::set_numa_cpus(int64_t node, const std::vector<int>& cpus) {
  {
    std::lock_guard<std::mutex> lock(numa_mu_);
    numa_cpus_ = cpus;
  }
  std::lock_guard<std::mutex> lock(mu_);
  st_.numa_node = cpus.empty() ? -1 : node;
}

std::vector<int> HostPool::last_alloc_cpus() {
  std::lock_guard<std::mutex> lock(numa_mu_);
  return last_alloc_cpus_;
}

void* HostPool::system_alloc(size_t bytes) {
  if (auto hook = alloc_hook_.load()) hook(bytes);
  uint64_t pending = inject_failures_.load();
  while (pending > 0) {
    if (inject_failures_.compare_exchange_weak(pending, pending - 1)) return nullptr;
  }
  const uint64_t per_alloc = limit_per_alloc_.load(), total = limit_total_.load();
  if ((per_alloc > 0 && bytes > per_alloc) || (total > 0 && system_bytes_.load() + bytes > total)) return nullptr;
  void* ptr = bound_alloc(bytes);
  if (ptr != nullptr) system_bytes_.fetch_add(bytes);
  return ptr;
}

void* HostPool::bound_alloc(size_t bytes) {
  std::vector<int> cpus;
  {
    std::lock_guard<std::mutex> lock(numa_mu_);
    cpus = numa_cpus_;
  }
  void* ptr = nullptr;
  bool bound = false;
  std::vector<int> seen;
  {
    ThreadBinding binding(cpus);  // the thread's own affinity is back when this scope ends, error or not
    bound = binding.bound();
    seen = binding.seen();
#ifdef CKPT_OFFLOAD_WITH_CUDA
    if (pinned_) {
      ExistingContextGuard guard;
      // Portable: any device may copy from or to the block, so one pool serves every GPU.
      cudaError_t err = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
      if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        ptr = nullptr;
      } else {
        CKPT_CUDA_CHECK(err);
      }
    } else
#endif
    {
      if (posix_memalign(&ptr, kHostAlignment, std::max<size_t>(bytes, 1)) != 0) ptr = nullptr;
      // Placed where it is first touched: touch each page now, on the node's CPUs.
      if (ptr != nullptr && bound) {
        for (size_t at = 0; at < bytes; at += kHostAlignment) static_cast<volatile char*>(ptr)[at] = 0;
      }
    }
  }
  std::lock_guard<std::mutex> lock(numa_mu_);
  last_alloc_cpus_ = std::move(seen);
  if (bound && ptr != nullptr) numa_placed_ += 1;
  return ptr;
}

void HostPool::system_free(void* ptr, size_t bytes) {
  system_bytes_.fetch_sub(std::min<uint64_t>(bytes, system_bytes_.load()));
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (pinned_) {
    ExistingContextGuard guard;
    CKPT_CUDA_CHECK_WARN(cudaFreeHost(ptr));
    return;
  }
#endif
  std::free(ptr);
}

void HostPool::evict_until(size_t extra, size_t limit) {
  // Idle blocks first, smallest first: the larger ones serve more requests. A block whose last
  // copy is still running is waited for before it goes back to the system.
  for (int pass = 0; pass < 2 && st_.reserved_bytes + extra > limit; ++pass) {
    for (auto it = free_.begin(); it != free_.end() && st_.reserved_bytes + extra > limit;) {
      FreeBlock& fb = it->second;
      if (pass == 0 && !event_done(fb.last_use)) {
        ++it;
        continue;
      }
      if (fb.last_use) fb.last_use->synchronize();
      system_free(fb.ptr, fb.capacity);
      st_.reserved_bytes -= fb.capacity;
      st_.blocks_reserved -= 1;
      st_.free_calls += 1;
      it = free_.erase(it);
    }
  }
}

HostPool::FreeMap::iterator HostPool::best_fit(size_t cls) {
  auto it = free_.lower_bound(cls);
  if (it == free_.end()) return it;
  // Among blocks of the smallest fitting capacity, one no copy is reading any more.
  for (auto same = it; same != free_.end() && same->first == it->first; ++same) {
    if (event_done(same->second.last_use)) return same;
  }
  return it;
}

size_t HostPool::bound_limit(uint64_t high_water, uint64_t working_set) {
  return std::max(static_cast<size_t>(kReserveBound * static_cast<double>(high_water)),
                  static_cast<size_t>(working_set));
}

std::shared_ptr<HostBlock> HostPool::acquire(size_t nbytes, bool wait_host, bool over_cap) {
  const size_t cls = round_size(nbytes);
  std::shared_ptr<HostBlock> block;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto pick = best_fit(cls);
    if (pick != free_.end()) {
      FreeBlock fb = pick->second;
      free_.erase(pick);
      st_.hits += 1;
      note_in_use(nbytes, fb.capacity);
      EventPtr pending = event_done(fb.last_use) ? nullptr : fb.last_use;
      block = std::make_shared<HostBlock>(shared_from_this(), fb.ptr, fb.capacity, nbytes, std::move(pending));
    } else {
      // Every free block is smaller than this request. The reserve bound, counting this request as
      // in use, decides how many of them go back to the system before the pool grows.
      const uint64_t h = std::max<uint64_t>(high_water_, st_.in_use_bytes + nbytes);
      const uint64_t w = std::max<uint64_t>(working_set_, st_.in_use_block_bytes + cls);
      evict_until(cls, bound_limit(h, w));
      if (st_.capacity_bytes > 0 && st_.reserved_bytes + cls > st_.capacity_bytes && !over_cap) {
        evict_until(cls, st_.capacity_bytes);
        if (st_.reserved_bytes + cls > st_.capacity_bytes) {
          st_.cap_refusals += 1;
          return nullptr;
        }
      }
      if (!over_cap && !node_has_room(cls)) {
        st_.node_refusals += 1;
        return nullptr;
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
      note_in_use(nbytes, cls);
      block = std::make_shared<HostBlock>(shared_from_this(), ptr, cls, nbytes, nullptr);
    }
  }
  if (wait_host) block->wait_pending();
  return block;
}

bool HostPool::fits(size_t nbytes) {
  const size_t cls = round_size(nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (best_fit(cls) != free_.end() || st_.capacity_bytes == 0) return true;
  // Every free block is smaller: acquire would return them to the system before growing.
  size_t free_bytes = 0;
  for (const auto& kv : free_) free_bytes += kv.first;
  return st_.reserved_bytes - free_bytes + cls <= st_.capacity_bytes;
}

std::shared_ptr<SpillTier> HostPool::spill() {
  std::lock_guard<std::mutex> lock(mu_);
  return spill_;
}

void HostPool::set_spill(std::shared_ptr<SpillTier> tier) {
  std::shared_ptr<SpillTier> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    old = std::move(spill_);
    spill_ = std::move(tier);
  }
  // Stopped outside the lock: its workers finish their jobs first, which return blocks here.
  if (old) old->stop();
}

namespace {
// The whole of a small file (/proc/meminfo, a cgroup's usage), with plain system calls: this runs
// under the pool's lock before it grows, and must not allocate much or block long.
bool read_small_file(const std::string& path, std::string& out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  out.clear();
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return n == 0;
}

bool parse_u64(const char* p, uint64_t& v) {
  while (*p == ' ' || *p == '\t') ++p;
  if (*p < '0' || *p > '9') return false;
  char* end = nullptr;
  v = std::strtoull(p, &end, 10);
  return end != p;
}

// The value of `key` in a memory.stat ("key value" lines), or 0.
uint64_t stat_value(const std::string& text, const std::string& key) {
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = text.find('\n', at);
    const size_t stop = end == std::string::npos ? text.size() : end;
    if (stop - at > key.size() && text.compare(at, key.size(), key) == 0 && text[at + key.size()] == ' ') {
      uint64_t v = 0;
      return parse_u64(text.c_str() + at + key.size(), v) ? v : 0;
    }
    at = stop + 1;
  }
  return 0;
}

}  // namespace

void HostPool::set_node_guard(std::string meminfo, std::vector<CgroupFiles> cgroups, uint64_t reserve) {
  std::lock_guard<std::mutex> lock(mu_);
  guard_on_ = !meminfo.empty() || !cgroups.empty();
  guard_meminfo_ = std::move(meminfo);
  guard_cgroups_ = std::move(cgroups);
  guard_reserve_ = reserve;
}

int64_t HostPool::node_available() {
  std::lock_guard<std::mutex> lock(mu_);
  return node_available_locked();
}

int64_t HostPool::node_available_locked() {
  if (!guard_on_) return -1;
  int64_t least = -1;
  auto take = [&least](int64_t v) { least = least < 0 ? v : std::min(least, v); };
  std::string text;
  if (!guard_meminfo_.empty() && read_small_file(guard_meminfo_, text)) {
    const size_t at = text.find("MemAvailable:");
    uint64_t kb = 0;
    if (at != std::string::npos && parse_u64(text.c_str() + at + 13, kb)) take(static_cast<int64_t>(kb * 1024));
  }
  for (const auto& [limit, usage_file, stat_file, inactive_key] : guard_cgroups_) {
    uint64_t used = 0;
    if (read_small_file(usage_file, text) && parse_u64(text.c_str(), used)) {
      if (read_small_file(stat_file, text)) used -= std::min(used, stat_value(text, inactive_key));
      take(used >= limit ? 0 : static_cast<int64_t>(limit - used));
    }
  }
  return least;
}

bool HostPool::node_has_room(size_t bytes) {
  if (!guard_on_) return true;
  const int64_t available = node_available_locked();
  // Growths still allocating with the lock released are not in the figures read yet: two
  // growths at once would otherwise both pass on one reading.
  return available < 0 || static_cast<uint64_t>(available) >= bytes + growing_bytes_ + guard_reserve_;
}

void* HostPool::allocate_unlocked(std::unique_lock<std::mutex>& lock, size_t cls) {
  // Accounted before allocating so concurrent acquires respect the cap, then allocated without
  // the lock: pinning takes about half a second per GiB.
  st_.reserved_bytes += cls;
  st_.blocks_reserved += 1;
  growing_bytes_ += cls;
  lock.unlock();
  void* ptr = nullptr;
  try {
    ptr = system_alloc(cls);
  } catch (...) {
    lock.lock();
    growing_bytes_ -= cls;
    st_.reserved_bytes -= cls;  // undo, and let the CUDA error through
    st_.blocks_reserved -= 1;
    throw;
  }
  lock.lock();
  growing_bytes_ -= cls;
  if (ptr == nullptr) {
    st_.reserved_bytes -= cls;
    st_.blocks_reserved -= 1;
    st_.alloc_failures += 1;
    st_.failed_alloc_bytes = cls;
  }
  return ptr;
}

void HostPool::note_in_use(size_t nbytes, size_t capacity) {
  st_.in_use_bytes += nbytes;
  st_.in_use_block_bytes += capacity;
  st_.blocks_in_use += 1;
  st_.peak_in_use_bytes = std::max(st_.peak_in_use_bytes, st_.in_use_bytes);
  high_water_ = std::max(high_water_, st_.in_use_bytes);
  working_set_ = std::max(working_set_, st_.in_use_block_bytes);
}

void HostPool::reserve(const std::vector<size_t>& sizes) {
  std::vector<size_t> order(sizes);
  std::sort(order.begin(), order.end(), std::greater<size_t>());
  std::unique_lock<std::mutex> lock(mu_);
  // Largest first, each paired with the smallest free block that fits: the pairing smallest-fit
  // acquires will find. Paired blocks are set aside so that later sizes cannot take them.
  std::vector<FreeBlock> aside;
  std::vector<size_t> missing;
  size_t requested = 0, capacity = 0, to_allocate = 0;
  for (size_t n : order) {
    requested += n;
    auto it = best_fit(round_size(n));
    if (it != free_.end()) {
      capacity += it->first;
      aside.push_back(it->second);
      free_.erase(it);
    } else {
      missing.push_back(round_size(n));
      to_allocate += missing.back();
    }
  }
  auto put_back = [this, &aside] {
    for (auto& fb : aside) free_.emplace(fb.capacity, fb);
    aside.clear();
  };
  if (st_.capacity_bytes > 0 && st_.reserved_bytes + to_allocate > st_.capacity_bytes) {
    evict_until(to_allocate, st_.capacity_bytes);  // an explicit call: free blocks outside the pairing may go
    if (st_.reserved_bytes + to_allocate > st_.capacity_bytes) {
      const uint64_t reserved = st_.reserved_bytes, cap = st_.capacity_bytes;
      put_back();
      throw std::runtime_error("ckpt_offload: HostPool.reserve would need " + std::to_string(to_allocate) +
                               " more bytes, over the pool's capacity of " + std::to_string(cap) + " bytes (" +
                               std::to_string(reserved) + " reserved); raise it with set_capacity() or reserve less");
    }
  }
  for (size_t cls : missing) {
    if (!node_has_room(cls)) {
      const int64_t available = node_available_locked();
      put_back();
      throw std::runtime_error("ckpt_offload: HostPool.reserve: the node has " + std::to_string(available) +
                               " bytes available; pinning " + std::to_string(cls) + " more would leave less than " +
                               std::to_string(guard_reserve_) + " (the node guard, set_node_guard)");
    }
    void* ptr = allocate_unlocked(lock, cls);
    if (ptr == nullptr) {
      put_back();
      throw std::runtime_error("ckpt_offload: HostPool.reserve: the system refused a host allocation of " +
                               std::to_string(cls) + " bytes" + (pinned_ ? " (pinned)" : ""));
    }
    st_.alloc_calls += 1;
    st_.allocated_bytes += cls;
    capacity += cls;
    aside.push_back(FreeBlock{ptr, cls, nullptr});
  }
  // The reserved requests count as held at once beside what is in use now.
  high_water_ = std::max<uint64_t>(high_water_, st_.in_use_bytes + requested);
  working_set_ = std::max<uint64_t>(working_set_, st_.in_use_block_bytes + capacity);
  evict_until(0, bound_limit(high_water_, working_set_));  // free blocks outside the pairing, if the bound needs it
  put_back();
}

size_t HostPool::empty_cache() {
  // The disk tier's per-process directory goes too when no file is left in it.
  if (auto tier = spill()) tier->remove_dir_if_empty();
  std::lock_guard<std::mutex> lock(mu_);
  high_water_ = st_.in_use_bytes;
  working_set_ = st_.in_use_block_bytes;
  size_t freed = 0;
  for (auto it = free_.begin(); it != free_.end();) {
    if (!event_done(it->second.last_use)) {
      ++it;
      continue;
    }
    system_free(it->second.ptr, it->second.capacity);
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
  {
    std::lock_guard<std::mutex> numa_lock(numa_mu_);
    out.numa_placed_allocs = numa_placed_;
  }
  out.high_water_bytes = high_water_;
  out.working_set_bytes = working_set_;
  return out;
}

void HostPool::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  st_.alloc_calls = st_.allocated_bytes = st_.free_calls = 0;
  st_.hits = st_.misses = st_.cap_refusals = st_.alloc_failures = st_.node_refusals = 0;
  st_.failed_alloc_bytes = 0;
  st_.peak_in_use_bytes = st_.in_use_bytes;
  std::lock_guard<std::mutex> numa_lock(numa_mu_);
  numa_placed_ = 0;
}

void HostPool::give_back(void* ptr, size_t capacity, size_t requested, EventPtr last_use) {
  std::lock_guard<std::mutex> lock(mu_);
  st_.in_use_bytes -= requested;
  st_.in_use_block_bytes -= capacity;
  st_.blocks_in_use -= 1;
  free_.emplace(capacity, FreeBlock{ptr, capacity, std::move(last_use)});
}

}  // namespace ckpt_offload
