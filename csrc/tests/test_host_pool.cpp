// Unit tests of the host pool on its host-only path (HostPool::create(false)) and of its disk tier
// (spill.h) in a directory under /tmp; no torch, no GPU.
// Usage: test_host_pool [name...]   (no name: run all; --list: print the names). Exit 1 on any failure.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <cerrno>

#include "host_pool.h"
#include "spill.h"

using ckpt_offload::HostBlock;
using ckpt_offload::HostPool;
using ckpt_offload::PoolStats;
using ckpt_offload::SpillPathError;
using ckpt_offload::SpillStats;
using ckpt_offload::SpillTier;

namespace {

std::atomic<int> g_failures{0};
std::mutex g_print_mu;

// Unlike assert(), stays on under NDEBUG (the tests build in Release) and does not stop the test.
#define CHECK(cond) check_impl((cond), #cond, __FILE__, __LINE__, std::string())
#define CHECK_MSG(cond, msg) check_impl((cond), #cond, __FILE__, __LINE__, (msg))
#define CHECK_EQ(a, b)                                                                      \
  do {                                                                                      \
    const auto check_a_ = (a);                                                              \
    const auto check_b_ = (b);                                                              \
    check_impl(check_a_ == check_b_, #a " == " #b, __FILE__, __LINE__,                      \
               std::to_string(check_a_) + " vs " + std::to_string(check_b_));               \
  } while (0)
#define CHECK_THROWS(expr, Exc)                                                             \
  do {                                                                                      \
    bool check_thrown_ = false;                                                             \
    try {                                                                                   \
      (void)(expr);                                                                         \
    } catch (const Exc&) {                                                                  \
      check_thrown_ = true;                                                                 \
    }                                                                                       \
    check_impl(check_thrown_, #expr " throws " #Exc, __FILE__, __LINE__, std::string());   \
  } while (0)

bool check_impl(bool ok, const char* what, const char* file, int line, const std::string& detail) {
  if (!ok) {
    g_failures.fetch_add(1);
    std::lock_guard<std::mutex> lock(g_print_mu);
    std::fprintf(stderr, "  FAILED %s:%d: %s%s%s\n", file, line, what, detail.empty() ? "" : "  -- ",
                 detail.c_str());
  }
  return ok;
}

constexpr size_t KiB = 1024;
constexpr size_t MiB = 1024 * KiB;

std::string describe(const PoolStats& s) {
  return "reserved " + std::to_string(s.reserved_bytes) + ", high water " + std::to_string(s.high_water_bytes) +
         ", working set " + std::to_string(s.working_set_bytes);
}

// reserved <= max(1.15 x H, W): what host_pool.h promises for any sequence.
bool within_general_bound(const PoolStats& s) {
  return static_cast<double>(s.reserved_bytes) <=
         std::max(HostPool::kReserveBound * static_cast<double>(s.high_water_bytes),
                  static_cast<double>(s.working_set_bytes));
}

// reserved <= 1.15 x H: what it promises when steps are shaped as in training.
bool within_step_bound(const PoolStats& s) {
  return static_cast<double>(s.reserved_bytes) <= HostPool::kReserveBound * static_cast<double>(s.high_water_bytes);
}

// One training step: every request held at once (forward), then all released (backward), in the
// given order (reverse by default, as backward reloads). Checks `bound` after every acquire.
bool run_step(HostPool& pool, const std::vector<size_t>& sizes, bool (*bound)(const PoolStats&),
              const std::string& ctx, bool release_in_order = false) {
  std::vector<std::shared_ptr<HostBlock>> held;
  for (size_t n : sizes) {
    held.push_back(pool.acquire(n, true));
    if (!CHECK_MSG(held.back() != nullptr, ctx)) return false;
    const PoolStats s = pool.stats();
    if (!CHECK_MSG(bound(s), ctx + ": " + describe(s))) return false;
  }
  if (release_in_order) {
    for (auto& b : held) b.reset();
  } else {
    while (!held.empty()) held.pop_back();
  }
  return true;
}

// The fine-tuning case of the design: 31 checkpointed inputs of batch 1 x length x hidden 4096 in
// bf16, the length uniform in 2048..8192 and padded to a multiple of 64.
constexpr size_t kLayers = 31;
size_t ft_bytes(size_t length) { return length * 4096 * 2; }
size_t ft_length(std::mt19937_64& rng) { return 2048 + 64 * (rng() % ((8192 - 2048) / 64 + 1)); }

// ---------------------------------------------------------------------------------------------

void test_round_size() {
  // Below 8 KiB: multiples of 512, never less than 512, less than 512 bytes of waste.
  for (size_t n = 0; n <= 8 * KiB; ++n) {
    const size_t r = HostPool::round_size(n);
    const bool ok = r % 512 == 0 && r >= n && r >= 512 && (n == 0 || r - n < 512);
    if (!CHECK_MSG(ok, "n=" + std::to_string(n) + " r=" + std::to_string(r))) return;
  }
  // Above: waste below 1/16 of the request, and exactly 16 classes per power of two.
  std::vector<size_t> sizes;
  for (int k = 13; k < 36; ++k) {
    const size_t p = size_t{1} << k;
    for (size_t d : {size_t{0}, size_t{1}, size_t{511}, p / 32, p / 16 - 1, p / 16, p / 16 + 1, p / 2 + 3, p - 1}) {
      sizes.push_back(p + d);
    }
  }
  std::mt19937_64 rng(1234);
  for (int i = 0; i < 200000; ++i) sizes.push_back(8 * KiB + 1 + rng() % (4ULL << 30));
  for (size_t n : sizes) {
    const size_t r = HostPool::round_size(n);
    const std::string ctx = "n=" + std::to_string(n) + " r=" + std::to_string(r);
    if (!CHECK_MSG(r >= n, ctx)) return;
    if (!CHECK_MSG((r - n) * 16 < n, ctx + " (waste >= 6.25%)")) return;
    if (!CHECK_MSG(r % 512 == 0, ctx)) return;
    if (!CHECK_MSG(HostPool::round_size(r) == r, ctx + " (a class size must map to itself)")) return;
  }
  for (int k = 13; k < 30; ++k) {
    const size_t lo = size_t{1} << k;
    size_t classes = 0, last = 0;
    for (size_t n = lo + 1; n <= 2 * lo; n += 256) {
      const size_t r = HostPool::round_size(n);
      CHECK_MSG(r >= last, "round_size must not decrease");
      if (r != last) ++classes;
      last = r;
    }
    CHECK_MSG(classes == 16, "classes in (2^" + std::to_string(k) + ", 2^" + std::to_string(k + 1) +
                                 "]: " + std::to_string(classes));
  }
}

void test_hit_reuse() {
  auto pool = HostPool::create(false);
  CHECK(!pool->pinned());
  const size_t n = 100000;
  auto b = pool->acquire(n, true);
  if (!CHECK(b != nullptr)) return;
  CHECK_EQ(b->size(), n);
  CHECK_EQ(b->capacity(), HostPool::round_size(n));
  CHECK(b->pending() == nullptr);
  std::memset(b->data(), 0xab, b->capacity());  // the whole capacity is usable memory
  void* first = b->data();
  PoolStats s = pool->stats();
  CHECK_EQ(s.alloc_calls, 1u);
  CHECK_EQ(s.misses, 1u);
  CHECK_EQ(s.hits, 0u);
  CHECK_EQ(s.in_use_bytes, n);
  CHECK_EQ(s.blocks_in_use, 1u);
  CHECK_EQ(s.reserved_bytes, HostPool::round_size(n));

  b.reset();
  s = pool->stats();
  CHECK_EQ(s.in_use_bytes, 0u);
  CHECK_EQ(s.blocks_in_use, 0u);
  CHECK_EQ(s.reserved_bytes, HostPool::round_size(n));
  CHECK_EQ(s.peak_in_use_bytes, n);

  // Same size again: served from the free block, no new allocation.
  b = pool->acquire(n, true);
  if (!CHECK(b != nullptr)) return;
  CHECK(b->data() == first);
  s = pool->stats();
  CHECK_EQ(s.hits, 1u);
  CHECK_EQ(s.misses, 1u);
  CHECK_EQ(s.alloc_calls, 1u);
  b.reset();

  // Another size of the same class is a hit too; a different class is a miss.
  const size_t same_class = HostPool::round_size(n) - 7;
  b = pool->acquire(same_class, true);
  CHECK(b && b->data() == first);
  CHECK_EQ(b ? b->size() : 0, same_class);
  auto other = pool->acquire(3 * n, true);
  CHECK(other && other->data() != first);
  s = pool->stats();
  CHECK_EQ(s.hits, 2u);
  CHECK_EQ(s.misses, 2u);
  CHECK_EQ(s.alloc_calls, 2u);
  CHECK_EQ(s.blocks_in_use, 2u);
}

void test_cap_refusal() {
  auto pool = HostPool::create(false);
  const size_t n = 256 * KiB;
  const size_t cls = HostPool::round_size(n);
  pool->set_capacity(2 * cls);
  auto a = pool->acquire(n, true);
  auto b = pool->acquire(n, true);
  CHECK(a != nullptr);
  CHECK(b != nullptr);
  auto c = pool->acquire(n, true);
  CHECK(c == nullptr);
  PoolStats s = pool->stats();
  CHECK_EQ(s.cap_refusals, 1u);
  CHECK_EQ(s.capacity_bytes, 2 * cls);
  CHECK(s.reserved_bytes <= s.capacity_bytes);
  CHECK_EQ(s.misses, 2u);  // a refusal is not a miss
  CHECK_EQ(s.alloc_calls, 2u);
  CHECK_EQ(s.in_use_bytes, 2 * n);
  // reserve() raises instead of returning nullptr.
  CHECK_THROWS(pool->reserve(n), std::runtime_error);

  // A freed block makes room again (as a hit); removing the cap lets the pool grow.
  b.reset();
  c = pool->acquire(n, true);
  CHECK(c != nullptr);
  CHECK_EQ(pool->stats().hits, 1u);
  CHECK(pool->acquire(n, true) == nullptr);
  CHECK_EQ(pool->stats().cap_refusals, 2u);
  pool->set_capacity(0);
  auto d = pool->acquire(n, true);
  CHECK(d != nullptr);
  CHECK_EQ(pool->stats().cap_refusals, 2u);

  // Lowering the cap below what is reserved frees free blocks.
  d.reset();
  pool->set_capacity(2 * cls);
  s = pool->stats();
  CHECK_EQ(s.reserved_bytes, 2 * cls);
  CHECK_EQ(s.free_calls, 1u);
}

void test_alloc_failure() {
  auto pool = HostPool::create(false);
  const size_t n = 128 * KiB;
  pool->inject_alloc_failures(1);
  CHECK(pool->acquire(n, true) == nullptr);  // nothing free to give back, so no retry helps
  PoolStats s = pool->stats();
  CHECK_EQ(s.alloc_failures, 1u);
  CHECK_EQ(s.alloc_calls, 0u);
  CHECK_EQ(s.reserved_bytes, 0u);
  CHECK_EQ(s.blocks_reserved, 0u);
  CHECK_EQ(s.in_use_bytes, 0u);

  auto b = pool->acquire(n, true);  // the injected failure is used up
  CHECK(b != nullptr);
  CHECK_EQ(pool->stats().alloc_failures, 1u);

  // With a free block of another class the pool gives it back and retries once. (A large block in
  // use keeps the small free one within the slack, so it survives until the failure.)
  auto big = pool->acquire(16 * n, true);
  CHECK(big != nullptr);
  b.reset();
  pool->inject_alloc_failures(1);
  b = pool->acquire(2 * n, true);
  CHECK(b != nullptr);
  s = pool->stats();
  CHECK_EQ(s.alloc_failures, 2u);
  CHECK_EQ(s.free_calls, 1u);
  CHECK_EQ(s.reserved_bytes, HostPool::round_size(16 * n) + HostPool::round_size(2 * n));

  // Two failures in a row defeat the retry. (A request the free 2n block fits would take it
  // instead of allocating, so this one is larger.)
  b.reset();
  pool->inject_alloc_failures(2);
  CHECK(pool->acquire(4 * n, true) == nullptr);
  s = pool->stats();
  CHECK_EQ(s.alloc_failures, 4u);
  CHECK_EQ(s.free_calls, 2u);
  CHECK_EQ(s.in_use_bytes, 16 * n);

  pool->inject_alloc_failures(1);
  CHECK_THROWS(pool->reserve(n), std::runtime_error);
  CHECK_EQ(pool->stats().alloc_failures, 5u);
  CHECK(pool->acquire(n, true) != nullptr);
}

void test_empty_cache() {
  auto pool = HostPool::create(false);
  size_t expect = 0;
  {
    auto a = pool->acquire(64 * KiB, true);
    auto b = pool->acquire(300 * KiB, true);
    auto c = pool->acquire(2 * MiB, true);
    CHECK(a && b && c);
    expect = HostPool::round_size(64 * KiB) + HostPool::round_size(300 * KiB) + HostPool::round_size(2 * MiB);
    // Blocks in use are not freed.
    CHECK_EQ(pool->empty_cache(), 0u);
  }
  PoolStats s = pool->stats();
  CHECK_EQ(s.reserved_bytes, expect);
  CHECK_EQ(s.blocks_reserved, 3u);
  CHECK_EQ(pool->empty_cache(), expect);
  s = pool->stats();
  CHECK_EQ(s.reserved_bytes, 0u);
  CHECK_EQ(s.blocks_reserved, 0u);
  CHECK_EQ(s.free_calls, 3u);
  CHECK_EQ(pool->empty_cache(), 0u);
  auto d = pool->acquire(64 * KiB, true);
  CHECK(d != nullptr);
  s = pool->stats();
  CHECK_EQ(s.hits, 0u);
  CHECK_EQ(s.misses, 4u);
}

void test_reserve() {
  auto pool = HostPool::create(false);
  const size_t n = MiB + 12345;
  const size_t cls = HostPool::round_size(n);
  pool->reserve(n, 3);
  PoolStats s = pool->stats();
  CHECK_EQ(s.alloc_calls, 3u);
  CHECK_EQ(s.allocated_bytes, 3 * cls);
  CHECK_EQ(s.reserved_bytes, 3 * cls);
  CHECK_EQ(s.blocks_reserved, 3u);
  CHECK_EQ(s.in_use_bytes, 0u);
  CHECK_EQ(s.misses, 0u);

  std::vector<std::shared_ptr<HostBlock>> held;
  for (int i = 0; i < 3; ++i) held.push_back(pool->acquire(n, true));
  for (auto& b : held) CHECK(b != nullptr && b->capacity() == cls);
  s = pool->stats();
  CHECK_EQ(s.hits, 3u);
  CHECK_EQ(s.misses, 0u);
  CHECK_EQ(s.alloc_calls, 3u);
  CHECK_EQ(s.blocks_in_use, 3u);
  held.push_back(pool->acquire(n, true));  // the fourth needs an allocation
  CHECK_EQ(pool->stats().misses, 1u);
  CHECK_EQ(pool->stats().alloc_calls, 4u);
}

// Random acquire/release traffic, no structure at all: reserved memory stays within the general
// bound max(1.15 x H, W), and no two live blocks overlap.
void test_slack_random() {
  auto pool = HostPool::create(false);
  std::mt19937_64 rng(42);
  std::vector<std::shared_ptr<HostBlock>> live;
  std::map<uintptr_t, uintptr_t> ranges;  // start -> end of live blocks
  uint64_t acquires = 0;
  for (int step = 0; step < 4000; ++step) {
    const bool release = !live.empty() && (live.size() > 24 || rng() % 100 < 45);
    if (release) {
      const size_t i = rng() % live.size();
      ranges.erase(reinterpret_cast<uintptr_t>(live[i]->data()));
      live[i] = std::move(live.back());
      live.pop_back();
    } else {
      // Mostly a few recurring sizes (as activations are), sometimes anything from 64 KiB to 8 MiB.
      static const size_t common[] = {64 * KiB, 192 * KiB, MiB, 3 * MiB + 4096};
      const size_t n = rng() % 3 ? common[rng() % 4] : 64 * KiB + rng() % (8 * MiB);
      auto b = pool->acquire(n, true);
      ++acquires;
      if (!CHECK(b != nullptr)) return;
      const auto start = reinterpret_cast<uintptr_t>(b->data());
      const auto end = start + b->capacity();
      auto next = ranges.lower_bound(start);
      const bool overlaps = (next != ranges.end() && next->first < end) ||
                            (next != ranges.begin() && std::prev(next)->second > start);
      if (!CHECK_MSG(!overlaps, "a block handed out twice")) return;
      ranges.emplace(start, end);
      static_cast<char*>(b->data())[0] = 1;
      static_cast<char*>(b->data())[b->capacity() - 1] = 1;
      live.push_back(std::move(b));
    }
    const PoolStats s = pool->stats();
    if (!CHECK_MSG(within_general_bound(s), "step " + std::to_string(step) + ": " + describe(s))) return;
  }
  live.clear();
  const PoolStats s = pool->stats();
  CHECK_EQ(s.in_use_bytes, 0u);
  CHECK_EQ(s.blocks_in_use, 0u);
  CHECK_EQ(s.hits + s.misses, acquires);
  CHECK(s.hits > acquires / 2);  // recurring sizes are mostly reused
  CHECK_EQ(s.blocks_reserved, s.alloc_calls - s.free_calls);
}

void test_threads() {
  auto pool = HostPool::create(false);
  constexpr int kThreads = 4;
  constexpr int kIters = 20000;
  std::atomic<uint64_t> acquires{0};
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Start together: on a loaded machine a thread could otherwise finish before the next starts.
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      std::mt19937 rng(100 + t);
      std::vector<std::pair<std::shared_ptr<HostBlock>, uint64_t>> held;
      // At least kIters each, and long enough that a missing lock gets its chance to show.
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
      for (int i = 0; i < kIters || std::chrono::steady_clock::now() < until; ++i) {
        if (held.size() < 4 && (held.empty() || rng() % 2)) {
          static const size_t sizes[] = {4 * KiB, 64 * KiB, 100 * KiB, 512 * KiB, MiB};
          auto b = pool->acquire(sizes[rng() % 5] + rng() % 64, true);
          acquires.fetch_add(1);
          if (!CHECK(b != nullptr)) return;
          // A token at both ends: another thread handed the same memory would overwrite it.
          const uint64_t token = (uint64_t(t) << 32) | uint64_t(i);
          std::memcpy(b->data(), &token, sizeof token);
          std::memcpy(static_cast<char*>(b->data()) + b->size() - sizeof token, &token, sizeof token);
          held.emplace_back(std::move(b), token);
        } else {
          const size_t k = rng() % held.size();
          uint64_t head = 0, tail = 0;
          auto& b = held[k].first;
          std::memcpy(&head, b->data(), sizeof head);
          std::memcpy(&tail, static_cast<char*>(b->data()) + b->size() - sizeof tail, sizeof tail);
          CHECK_MSG(head == held[k].second && tail == held[k].second, "block shared between threads");
          held[k] = std::move(held.back());
          held.pop_back();
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  const PoolStats s = pool->stats();
  CHECK_EQ(s.in_use_bytes, 0u);
  CHECK_EQ(s.blocks_in_use, 0u);
  CHECK_EQ(s.hits + s.misses, acquires.load());
  CHECK_EQ(s.alloc_calls, s.misses);  // no failures were injected
  CHECK_EQ(s.blocks_reserved, s.alloc_calls - s.free_calls);
  CHECK(s.hits > 0);
}


// Longest step first, then 200 steps of the distribution: no allocation and no free at all.
void test_fine_tuning() {
  auto pool = HostPool::create(false);
  if (!run_step(*pool, std::vector<size_t>(kLayers, ft_bytes(8192)), within_step_bound, "longest step")) return;
  const PoolStats first = pool->stats();
  CHECK_EQ(first.alloc_calls, kLayers);
  std::mt19937_64 rng(7);
  size_t distinct_classes = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    const size_t n = ft_bytes(ft_length(rng));
    distinct_classes += HostPool::round_size(n) != last;
    last = HostPool::round_size(n);
    if (!run_step(*pool, std::vector<size_t>(kLayers, n), within_step_bound, "step " + std::to_string(step))) return;
  }
  const PoolStats s = pool->stats();
  CHECK(distinct_classes > 50);  // the lengths really did vary
  CHECK_EQ(s.alloc_calls, first.alloc_calls);
  CHECK_EQ(s.free_calls, 0u);
  CHECK_EQ(s.hits, 200 * kLayers);
  CHECK_EQ(s.reserved_bytes, kLayers * HostPool::round_size(ft_bytes(8192)));
}

// Lengths growing by 64 from 2048 to 8192: one allocation per layer per new size class, never one
// per layer per step; the bound holds throughout, so the smaller blocks go back as the sizes grow.
void test_growing() {
  auto pool = HostPool::create(false);
  size_t new_classes = 0, steps = 0, last = 0;
  for (size_t length = 2048; length <= 8192; length += 64, ++steps) {
    const size_t n = ft_bytes(length);
    new_classes += HostPool::round_size(n) > last;
    last = HostPool::round_size(n);
    if (!run_step(*pool, std::vector<size_t>(kLayers, n), within_step_bound, "length " + std::to_string(length))) {
      return;
    }
  }
  const PoolStats s = pool->stats();
  CHECK_EQ(steps, 97u);
  CHECK_EQ(new_classes, 33u);  // two octaves of 16 classes, and the first
  CHECK_EQ(s.alloc_calls, kLayers * new_classes);
  CHECK(s.free_calls <= kLayers * (new_classes - 1));
  CHECK(s.reserved_bytes >= kLayers * HostPool::round_size(ft_bytes(8192)));
  CHECK(within_step_bound(s));
}

// Short and long steps alternating: after the first long step, no allocation and no free.
void test_alternating() {
  auto pool = HostPool::create(false);
  const size_t short_n = ft_bytes(2048), long_n = ft_bytes(8192);
  for (int step = 0; step < 40; ++step) {
    const size_t n = step % 2 == 0 ? short_n : long_n;
    if (!run_step(*pool, std::vector<size_t>(kLayers, n), within_step_bound, "step " + std::to_string(step))) return;
    if (step == 1) {
      const PoolStats s = pool->stats();
      CHECK_EQ(s.alloc_calls, 2 * kLayers);  // the short step's blocks, then the long one's
      pool->reset_stats();
    }
  }
  const PoolStats s = pool->stats();
  CHECK_EQ(s.alloc_calls, 0u);
  CHECK_EQ(s.free_calls, 0u);
  CHECK(s.reserved_bytes <= kLayers * HostPool::round_size(long_n) * 115 / 100);
}

// Adversarial step sequences, each checked after every acquire:
// (a) k equal requests a step, sizes in any order (random, sawtooth, growing then shrinking,
//     released in either order): reserved <= 1.15 x H always, and a step no larger than the largest
//     so far never allocates or frees;
// (b) per-layer sizes of any profile, the longest step first, then dominated steps whose requests
//     arrive in random order: no allocation, no free, reserved <= 1.15 x H;
// (c) the documented limit: one request of S, then two of 0.6 S held at once.
void test_bound_adversarial() {
  std::mt19937_64 rng(2024);
  for (int trial = 0; trial < 60; ++trial) {
    auto pool = HostPool::create(false);
    const size_t k = 1 + rng() % 40;
    const size_t unit = 8 * KiB + rng() % (256 * KiB);  // classes within 1/16 from 8 KiB up
    const int pattern = trial % 4;
    size_t largest = 0;
    for (int step = 0; step < 80; ++step) {
      size_t mult = 0;
      switch (pattern) {
        case 0: mult = 1 + rng() % 64; break;                             // random
        case 1: mult = 1 + (step % 9) * 8; break;                         // sawtooth
        case 2: mult = step < 40 ? 1 + step : 80 - step; break;           // up, then down
        default: mult = step % 2 ? 64 : 1 + rng() % 8; break;             // long / short
      }
      const size_t n = unit * mult;
      const PoolStats before = pool->stats();
      const std::string ctx = "trial " + std::to_string(trial) + " step " + std::to_string(step);
      if (!run_step(*pool, std::vector<size_t>(k, n), within_step_bound, ctx, step % 3 == 0)) return;
      const PoolStats after = pool->stats();
      if (n <= largest) {
        if (!CHECK_MSG(after.alloc_calls == before.alloc_calls && after.free_calls == before.free_calls,
                       ctx + ": a step no larger than the largest allocated or freed")) {
          return;
        }
      }
      largest = std::max(largest, n);
    }
  }
  for (int trial = 0; trial < 40; ++trial) {
    auto pool = HostPool::create(false);
    const size_t k = 2 + rng() % 30;
    std::vector<size_t> profile(k);
    for (auto& p : profile) p = 1 + rng() % 100;  // any mix of large and small tensors per layer
    const size_t longest = 64 + rng() % 4096;
    std::vector<size_t> sizes(k);
    for (size_t i = 0; i < k; ++i) sizes[i] = profile[i] * longest * 64;
    if (!run_step(*pool, sizes, within_step_bound, "longest")) return;
    const PoolStats first = pool->stats();
    for (int step = 0; step < 40; ++step) {
      const size_t length = 1 + rng() % longest;
      for (size_t i = 0; i < k; ++i) sizes[i] = profile[i] * length * 64;
      std::shuffle(sizes.begin(), sizes.end(), rng);
      if (!run_step(*pool, sizes, within_step_bound, "profile trial " + std::to_string(trial), step % 2 == 0)) return;
    }
    const PoolStats s = pool->stats();
    CHECK_EQ(s.alloc_calls, first.alloc_calls);
    CHECK_EQ(s.free_calls, 0u);
  }
  {
    auto pool = HostPool::create(false);
    const size_t big = 16 * MiB, small = big / 10 * 6;
    run_step(*pool, {big}, within_step_bound, "S");
    auto a = pool->acquire(small, true);
    auto b = pool->acquire(small, true);
    const PoolStats s = pool->stats();
    CHECK(a && a->capacity() == big);  // rule 1: the free S block serves the first
    CHECK_EQ(s.reserved_bytes, big + HostPool::round_size(small));
    CHECK_EQ(s.working_set_bytes, s.reserved_bytes);
    CHECK(within_general_bound(s));
    CHECK(!within_step_bound(s));  // 1.6 S held for 1.2 S requested: above 1.15 x H, as documented
  }
}

// reserve() pairs sizes with free blocks, allocates only the rest, and counts them in H and W.
void test_reserve_pairs() {
  auto pool = HostPool::create(false);
  const std::vector<size_t> step = {3 * MiB, MiB, 2 * MiB, MiB};
  pool->reserve(step);
  PoolStats s = pool->stats();
  CHECK_EQ(s.alloc_calls, 4u);
  CHECK_EQ(s.high_water_bytes, 7 * MiB);
  CHECK_EQ(s.working_set_bytes, 7 * MiB);
  pool->reserve(step);    // already there
  pool->reserve(MiB, 4);  // four 1 MiB requests fit the four blocks too
  CHECK_EQ(pool->stats().alloc_calls, 4u);
  // The reserved step and shorter ones, requests in any order, are served without allocating.
  run_step(*pool, {MiB, 3 * MiB, MiB, 2 * MiB}, within_step_bound, "reserved step");
  run_step(*pool, {MiB / 2, MiB, 3 * MiB - 1, MiB}, within_step_bound, "shorter step");
  s = pool->stats();
  CHECK_EQ(s.alloc_calls, 4u);
  CHECK_EQ(s.free_calls, 0u);
  // One call is one step: two 3 MiB requests need one more block, and the bound (H = 7 MiB) then
  // returns the free blocks outside this pairing that exceed it.
  pool->reserve(3 * MiB, 2);
  s = pool->stats();
  CHECK_EQ(s.alloc_calls, 5u);
  CHECK_EQ(s.free_calls, 2u);
  CHECK_EQ(s.reserved_bytes, 8 * MiB);
  CHECK(within_step_bound(s));

  // Free blocks outside the pairing go back when the bound needs it (reserve() is an explicit
  // call): twenty free 1 MiB blocks, then 64 MiB reserved: 84 MiB would exceed 1.15 x 64 MiB.
  pool = HostPool::create(false);
  run_step(*pool, std::vector<size_t>(20, MiB), within_general_bound, "twenty");
  pool->reserve(64 * MiB, 1);
  s = pool->stats();
  CHECK_EQ(s.free_calls, 11u);
  CHECK_EQ(s.reserved_bytes, 73 * MiB);
  CHECK(within_step_bound(s));
}

// Pinned pools need a usable CUDA runtime; without one (host-only build or no driver) create()
// refuses clearly instead of failing later.
void test_pinned() {
  if (!ckpt_offload::cuda_runtime_usable()) {
    CHECK_THROWS(HostPool::create(true), std::invalid_argument);
    return;
  }
  auto pool = HostPool::create(true);
  CHECK(pool->pinned());
  auto b = pool->acquire(MiB, true);
  CHECK(b != nullptr);
  if (b) std::memset(b->data(), 1, b->size());
  CHECK(pool->stats().pinned);
}

// ---------------------------------------------------------------------------------------------
// The disk tier

std::string temp_dir() {
  char templ[] = "/tmp/ckpt_offload_test_XXXXXX";
  return mkdtemp(templ) ? std::string(templ) : std::string();
}

size_t entries(const std::string& dir) {
  size_t n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) n += (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0);
    closedir(d);
  }
  return n;
}

void fill(HostBlock& b, unsigned seed) {
  auto* p = static_cast<unsigned char*>(b.data());
  for (size_t i = 0; i < b.size(); ++i) p[i] = static_cast<unsigned char>((i * 131 + seed) & 0xff);
}

bool holds(const HostBlock& b, unsigned seed) {
  const auto* p = static_cast<const unsigned char*>(b.data());
  for (size_t i = 0; i < b.size(); ++i) {
    if (p[i] != static_cast<unsigned char>((i * 131 + seed) & 0xff)) return false;
  }
  return true;
}

// Stopped workers let go of the tier (and its directory) soon after; waits up to 5 s.
bool gone_soon(const std::string& dir) {
  for (int i = 0; i < 500 && entries(dir) > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return entries(dir) == 0;
}

// Block -> file -> another block, bytes equal; one file per tensor, gone with its last reference;
// the per-process directory gone with the tier.
void test_spill_roundtrip() {
  const std::string dir = temp_dir();
  auto pool = HostPool::create(false);
  auto tier = SpillTier::create(dir, 0, 2, 1);
  const std::string proc = tier->process_dir();
  CHECK_MSG(proc.rfind(dir + "/ckpt_offload-" + std::to_string(getpid()) + "-", 0) == 0, proc);
  CHECK_EQ(entries(proc), 0u);  // the probes are gone
  uint64_t total = 0;
  unsigned seed = 1;
  for (size_t n : {size_t{1000}, size_t{4096}, size_t{3 * MiB + 123}}) {
    auto src = pool->acquire(n, true);
    fill(*src, seed);
    auto file = tier->new_file(n, *src);
    CHECK(file != nullptr);
    if (!file) return;
    auto w = tier->write(file, std::move(src), nullptr, seed);
    w->wait();
    CHECK_MSG(!w->failed(), w->message());
    w->take_block();  // back to the pool
    CHECK_EQ(entries(proc), 1u);
    auto dst = pool->acquire(n, true);
    std::memset(dst->data(), 0, dst->size());
    auto r = tier->read(file, std::move(dst), nullptr, seed);
    r->wait();
    CHECK_MSG(!r->failed(), r->message());
    auto back = r->take_block();
    CHECK(back && holds(*back, seed));
    w.reset();
    r.reset();
    file.reset();
    CHECK_EQ(entries(proc), 0u);
    total += n;
    ++seed;
  }
  const SpillStats s = tier->stats();
  CHECK_EQ(s.tensors_spilled, 3u);
  CHECK_EQ(s.bytes_spilled, total);
  CHECK_EQ(s.tensors_read, 3u);
  CHECK_EQ(s.bytes_read, total);
  CHECK_EQ(s.files, 0u);
  CHECK_EQ(s.disk_bytes, 0u);
  tier->stop();
  tier.reset();
  CHECK(gone_soon(dir));
  rmdir(dir.c_str());
}

void test_spill_bad_path() {
  const std::string dir = temp_dir();
  CHECK_THROWS(SpillTier::create(dir + "/missing", 0, 2, 1), SpillPathError);
  const std::string file = dir + "/a_file";
  std::fclose(std::fopen(file.c_str(), "w"));
  CHECK_THROWS(SpillTier::create(file, 0, 2, 1), SpillPathError);
  CHECK_THROWS(SpillTier::create("", 0, 2, 1), SpillPathError);
  try {
    SpillTier::create(file, 0, 2, 1);
  } catch (const SpillPathError& e) {
    CHECK_MSG(std::string(e.what()).find("is not a directory") != std::string::npos, e.what());
  }
  unlink(file.c_str());
  CHECK_EQ(entries(dir), 0u);  // nothing made by the failed calls
  rmdir(dir.c_str());
}

// An injected ENOSPC: the block keeps the data, the tier stops; an injected EIO on read names the file.
void test_spill_faults() {
  const std::string dir = temp_dir();
  auto pool = HostPool::create(false);
  auto tier = SpillTier::create(dir, 0, 2, 1);
  tier->inject_fault(true, 2, ENOSPC);  // the second write from now
  for (unsigned i = 1; i <= 2; ++i) {
    auto b = pool->acquire(64 * KiB, true);
    fill(*b, i);
    auto file = tier->new_file(64 * KiB, *b);
    auto w = tier->write(file, std::move(b), nullptr, i);
    w->wait();
    if (i == 1) {
      CHECK(!w->failed());
      continue;
    }
    CHECK(w->failed());
    CHECK_EQ(w->error_number(), ENOSPC);
    CHECK_MSG(w->message().find(file->path()) != std::string::npos, w->message());
    CHECK_MSG(w->message().find("errno 28") != std::string::npos, w->message());
    auto kept = w->take_block();
    CHECK(kept && holds(*kept, i));  // the tensor's only copy is intact
    CHECK(!tier->usable());
    CHECK(tier->new_file(64 * KiB, *kept) == nullptr);
    CHECK_EQ(tier->stats().write_errors, 1u);
  }
  tier->stop();
  auto reader = SpillTier::create(dir, 0, 2, 1);
  reader->inject_fault(false, 1, EIO);
  auto b = pool->acquire(64 * KiB, true);
  fill(*b, 7);
  auto file = reader->new_file(64 * KiB, *b);
  auto w = reader->write(file, std::move(b), nullptr, 7);
  w->wait();
  CHECK(!w->failed());
  auto r = reader->read(file, pool->acquire(64 * KiB, true), nullptr, 7);
  r->wait();
  CHECK(r->failed());
  CHECK_EQ(r->error_number(), EIO);
  CHECK_MSG(r->message().find(file->path()) != std::string::npos, r->message());
  CHECK_EQ(reader->stats().read_errors, 1u);
  w.reset();
  r.reset();
  file.reset();
  reader->stop();
  reader.reset();
  tier.reset();
  CHECK(gone_soon(dir));
  rmdir(dir.c_str());
}

// Two growths at once under the node guard: the second checks the node while the first is still
// allocating (the pool lock released), on a reading that does not show the first yet. With room for
// one of them only, the second is refused.
std::atomic<int> g_allocs_entered{0};
std::atomic<bool> g_allocs_go{false};

void hold_first_alloc(size_t /*bytes*/) {
  if (g_allocs_entered.fetch_add(1) == 0) {
    while (!g_allocs_go.load()) std::this_thread::yield();
  }
}

void test_node_guard_concurrent() {
  char path[] = "/tmp/ckpt_offload_meminfo_XXXXXX";
  const int fd = mkstemp(path);
  if (!CHECK(fd >= 0)) return;
  const std::string text = "MemTotal:       8192 kB\nMemAvailable:    3072 kB\n";  // 3 MiB: one 2 MiB block
  CHECK(write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  close(fd);
  auto pool = HostPool::create(false);
  pool->set_node_guard(path, {}, 0);
  g_allocs_entered.store(0);
  g_allocs_go.store(false);
  pool->set_alloc_hook(hold_first_alloc);
  std::shared_ptr<HostBlock> first;
  std::thread grower([&] { first = pool->acquire(2 * MiB, true); });
  while (g_allocs_entered.load() == 0) std::this_thread::yield();  // the first is allocating, unlocked
  auto second = pool->acquire(2 * MiB, true);
  g_allocs_go.store(true);
  grower.join();
  pool->set_alloc_hook(nullptr);
  CHECK(first != nullptr);
  CHECK_MSG(second == nullptr, "two growths passed the node guard on one reading");
  CHECK_EQ(pool->stats().node_refusals, 1u);
  unlink(path);
}

void test_alloc_limit() {
  // A limit on one allocation (WSL2's) and on what the pool holds (a memlock limit): the refused
  // growth is soft, counted, and the size refused is reported; freeing makes room again.
  auto pool = HostPool::create(false);
  pool->set_alloc_limit(MiB, 0);
  CHECK(pool->acquire(MiB + 1, true) == nullptr);
  PoolStats s = pool->stats();
  CHECK_EQ(s.alloc_failures, 1u);
  CHECK_EQ(s.failed_alloc_bytes, HostPool::round_size(MiB + 1));
  CHECK_EQ(s.reserved_bytes, 0u);
  auto a = pool->acquire(MiB, true);
  CHECK(a != nullptr);
  pool->set_alloc_limit(0, 2 * MiB);
  auto b = pool->acquire(MiB, true);  // 2 MiB held: at the limit
  CHECK(b != nullptr);
  CHECK(pool->acquire(64 * KiB, true) == nullptr);  // past it
  CHECK_EQ(pool->stats().alloc_failures, 2u);
  CHECK_THROWS(pool->reserve(MiB + 64 * KiB), std::runtime_error);
  a.reset();
  b.reset();
  CHECK_EQ(pool->empty_cache(), 2 * MiB);
  auto c = pool->acquire(2 * MiB, true);  // what was freed counts no more
  CHECK(c != nullptr);
  pool->set_alloc_limit(0, 0);
  CHECK(pool->acquire(4 * MiB, true) != nullptr);
}

void test_numa_binding() {
  // Each growth runs with the thread bound to the node's CPUs; the thread's affinity is put back.
  cpu_set_t before;
  if (!CHECK(pthread_getaffinity_np(pthread_self(), sizeof before, &before) == 0)) return;
  int last = -1;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &before)) last = c;
  }
  auto pool = HostPool::create(false);
  auto a = pool->acquire(MiB, true);
  CHECK(pool->last_alloc_cpus().empty());
  pool->set_numa_cpus(1, {last});
  auto b = pool->acquire(2 * MiB, true);
  CHECK(b != nullptr);
  CHECK(pool->last_alloc_cpus() == std::vector<int>{last});
  PoolStats s = pool->stats();
  CHECK_EQ(s.numa_node, 1);
  CHECK_EQ(s.numa_placed_allocs, 1u);
  cpu_set_t after;
  CHECK(pthread_getaffinity_np(pthread_self(), sizeof after, &after) == 0);
  CHECK(CPU_EQUAL(&before, &after));
  pool->set_numa_cpus(-1, {});
  auto c = pool->acquire(4 * MiB, true);
  CHECK(pool->last_alloc_cpus().empty());
  CHECK_EQ(pool->stats().numa_node, -1);
}

const std::vector<std::pair<std::string, std::function<void()>>> kTests = {
    {"round_size", test_round_size},   {"hit_reuse", test_hit_reuse},     {"cap_refusal", test_cap_refusal},
    {"alloc_failure", test_alloc_failure}, {"empty_cache", test_empty_cache}, {"reserve", test_reserve},
    {"slack_random", test_slack_random}, {"threads", test_threads},       {"pinned", test_pinned},
    {"fine_tuning", test_fine_tuning},   {"growing", test_growing},         {"alternating", test_alternating},
    {"bound_adversarial", test_bound_adversarial}, {"reserve_pairs", test_reserve_pairs},
    {"spill_roundtrip", test_spill_roundtrip}, {"spill_bad_path", test_spill_bad_path},
    {"spill_faults", test_spill_faults}, {"node_guard_concurrent", test_node_guard_concurrent},
    {"alloc_limit", test_alloc_limit},   {"numa_binding", test_numa_binding},
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> names(argv + 1, argv + argc);
  if (names.size() == 1 && names[0] == "--list") {
    for (auto& t : kTests) std::printf("%s\n", t.first.c_str());
    return 0;
  }
  if (names.empty()) {
    for (auto& t : kTests) names.push_back(t.first);
  }
  int failed_tests = 0;
  for (const auto& name : names) {
    auto it = std::find_if(kTests.begin(), kTests.end(), [&](const auto& t) { return t.first == name; });
    if (it == kTests.end()) {
      std::fprintf(stderr, "unknown test: %s (see --list)\n", name.c_str());
      return 2;
    }
    const int before = g_failures.load();
    try {
      it->second();
    } catch (const std::exception& e) {
      check_impl(false, "unexpected exception", __FILE__, __LINE__, e.what());
    }
    const bool ok = g_failures.load() == before;
    failed_tests += ok ? 0 : 1;
    std::printf("[%s] %s\n", ok ? "  OK  " : "FAILED", name.c_str());
  }
  return failed_tests == 0 ? 0 : 1;
}
