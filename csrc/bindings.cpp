// Python bindings of ckpt_offload._C: argument checks here, work in host_pool.cpp and copy_engine.cpp.
// pybind11 first: c10 declares pybind11::class_ without the hidden visibility pybind11 gives it, and
// whichever declaration comes first decides (else every py::class_ here warns).
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/utils/pybind.h>  // the tensor, device and dtype casters

#include <ATen/ops/from_blob.h>

#include <optional>
#include <vector>

#include <cerrno>

#include "copy_engine.h"
#include "graph_nodes.h"
#include "host_pool.h"
#include "session_core.h"
#include "spill.h"
#include "timeline.h"

#ifndef CKPT_OFFLOAD_TORCH_VERSION
#define CKPT_OFFLOAD_TORCH_VERSION "unknown"
#endif

namespace py = pybind11;
using namespace ckpt_offload;

namespace {

using release_gil = py::call_guard<py::gil_scoped_release>;

py::dict pool_stats_dict(const PoolStats& s) {
  py::dict d;
  d["reserved_bytes"] = s.reserved_bytes;
  d["in_use_bytes"] = s.in_use_bytes;
  d["peak_in_use_bytes"] = s.peak_in_use_bytes;
  d["high_water_bytes"] = s.high_water_bytes;
  d["in_use_block_bytes"] = s.in_use_block_bytes;
  d["working_set_bytes"] = s.working_set_bytes;
  d["blocks_reserved"] = s.blocks_reserved;
  d["blocks_in_use"] = s.blocks_in_use;
  d["alloc_calls"] = s.alloc_calls;
  d["allocated_bytes"] = s.allocated_bytes;
  d["free_calls"] = s.free_calls;
  d["hits"] = s.hits;
  d["misses"] = s.misses;
  d["cap_refusals"] = s.cap_refusals;
  d["alloc_failures"] = s.alloc_failures;
  d["node_refusals"] = s.node_refusals;
  d["capacity_bytes"] = s.capacity_bytes;
  d["failed_alloc_bytes"] = s.failed_alloc_bytes;
  d["numa_node"] = s.numa_node;
  d["numa_placed_allocs"] = s.numa_placed_allocs;
  d["pinned"] = s.pinned;
  return d;
}

py::dict engine_stats_dict(const EngineStats& s) {
  py::dict d;
  d["tensors_offloaded"] = s.tensors_offloaded;
  d["bytes_offloaded"] = s.bytes_offloaded;
  d["tensors_prefetched"] = s.tensors_prefetched;
  d["bytes_prefetched"] = s.bytes_prefetched;
  d["tensors_fetched"] = s.tensors_fetched;
  d["reloads_on_demand"] = s.reloads_on_demand;
  d["tensors_released"] = s.tensors_released;
  d["offloads_refused"] = s.offloads_refused;
  d["compacted"] = s.compacted;
  d["pending_sources"] = s.pending_sources;
  d["reload_wait_ms"] = s.reload_wait_ms;
  d["reload_waits_measured"] = s.reload_waits_measured;
  d["d2h_copy_ms"] = s.d2h_copy_ms;
  d["d2h_bytes_timed"] = s.d2h_bytes_timed;
  d["d2h_copies_timed"] = s.d2h_copies_timed;
  d["h2d_copy_ms"] = s.h2d_copy_ms;
  d["h2d_bytes_timed"] = s.h2d_bytes_timed;
  d["h2d_copies_timed"] = s.h2d_copies_timed;
  return d;
}

py::dict spill_stats_dict(const std::shared_ptr<SpillTier>& tier) {
  const SpillStats s = tier ? tier->stats() : SpillStats();
  py::dict d;
  d["tensors_spilled"] = s.tensors_spilled;
  d["bytes_spilled"] = s.bytes_spilled;
  d["tensors_read"] = s.tensors_read;
  d["bytes_read"] = s.bytes_read;
  d["write_ms"] = s.write_ms;
  d["read_ms"] = s.read_ms;
  d["reads_ahead"] = s.reads_ahead;
  d["read_waits"] = s.read_waits;
  d["write_waits"] = s.write_waits;
  d["reads_over_cap"] = s.reads_over_cap;
  d["write_errors"] = s.write_errors;
  d["read_errors"] = s.read_errors;
  d["files"] = s.files;
  d["disk_bytes"] = s.disk_bytes;
  d["peak_disk_bytes"] = s.peak_disk_bytes;
  d["max_bytes"] = s.max_bytes;
  d["io_mode"] = tier ? py::object(py::str(s.direct ? "direct" : "buffered")) : py::object(py::none());
  d["failed"] = s.failed;
  d["workers_busy"] = s.workers_busy;
  return d;
}

// set_spill_dir: the tier, with the simulated runtime's observer, delays and broken rules when CPU
// engines made now would get that runtime.
std::shared_ptr<SpillTier> make_spill_tier(const std::string& path, uint64_t max_bytes, int read_ahead,
                                           int spill_ahead) {
  const Break broken = break_from_env();
  const bool sim = std::string(test_path_from_env()) == "async-sim";
  const bool disk_break = broken == Break::kSpillWrite || broken == Break::kSpillD2H;
  TORCH_CHECK_VALUE(!disk_break || sim, "HostPool.set_spill_dir: CKPT_OFFLOAD_TEST_BREAK=spill_write/spill_d2h is a ",
                    "testing aid of the simulated runtime; set CKPT_OFFLOAD_TEST_CPU=1 and CKPT_OFFLOAD_TEST_ASYNC=1");
  std::shared_ptr<SpillTier> tier;
  try {
    tier = SpillTier::create(path, max_bytes, read_ahead, spill_ahead);
  } catch (const SpillPathError& e) {
    throw py::value_error(std::string("HostPool.") + e.what());
  }
  if (sim) {
    tier->set_test_hooks(make_sim_disk_observer(), sim_disk_max_us(), sim_seed(), broken == Break::kSpillWrite,
                         broken == Break::kSpillD2H);
  }
  return tier;
}

size_t checked_size(int64_t n, const char* what) {
  TORCH_CHECK_VALUE(n >= 0, what, " must be a non-negative number of bytes, got ", n);
  return static_cast<size_t>(n);
}

std::shared_ptr<HostPool> make_pool(std::optional<bool> pinned) {
  return HostPool::create(pinned.value_or(cuda_runtime_usable()));
}

// A uint8 CPU tensor over the block's memory. The tensor owns a reference to the block, so the
// memory cannot go back to the pool while the tensor lives.
at::Tensor block_tensor(const std::shared_ptr<HostBlock>& block) {
  auto keep = block;
  return at::from_blob(
      block->data(), {static_cast<int64_t>(block->size())}, [keep](void*) {},
      at::TensorOptions().dtype(at::kByte));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ckpt_offload C++/CUDA core: pinned host pool and asynchronous copy engine";

  m.def("build_info", [] {
    py::dict d;
    d["torch_version"] = CKPT_OFFLOAD_TORCH_VERSION;
#ifdef CKPT_OFFLOAD_WITH_CUDA
    d["with_cuda"] = true;
    d["cuda_version"] = std::to_string(CUDART_VERSION / 1000) + "." + std::to_string((CUDART_VERSION % 1000) / 10);
#else
    d["with_cuda"] = false;
    d["cuda_version"] = py::none();
#endif
    return d;
  });
  m.def("test_path", &test_path_from_env,
        "The runtime a CPU engine created now gets: 'off' (CKPT_OFFLOAD_TEST_CPU unset), 'sync', or "
        "'async-sim' (CKPT_OFFLOAD_TEST_ASYNC=1)");
  m.def("cuda_usable", &cuda_runtime_usable,
        "True when the extension has CUDA and a driver with at least one device is present");
  m.def("set_profiling", &CopyEngine::set_profiling, py::arg("on"));
  m.def("profiling", &CopyEngine::profiling);

  // The timeline recorder (ckpt_offload.timeline() is its Python face).
  m.def(
      "timeline_start",
      [](int64_t capacity) {
        TORCH_CHECK_VALUE(capacity >= 1, "timeline_start: capacity must be >= 1, got ", capacity);
        py::gil_scoped_release no_gil;
        timeline::start(static_cast<size_t>(capacity));
        try {
          for (auto& e : CopyEngine::all_engines()) e->anchor_timeline();
        } catch (...) {
          uint64_t dropped = 0;
          timeline::stop(dropped);
          throw;
        }
      },
      py::arg("capacity"),
      "Starts recording copies, reload waits, pinned allocations and marks into a ring of `capacity` records");
  m.def(
      "timeline_stop",
      [] {
        uint64_t dropped = 0;
        std::vector<TimelineEntry> entries;
        {
          py::gil_scoped_release no_gil;
          entries = timeline::stop(dropped);
        }
        py::list out;
        for (const auto& e : entries) {
          py::dict d;
          d["kind"] = e.kind;
          d["device"] = e.device;
          d["id"] = e.id;
          d["bytes"] = e.bytes;
          d["flags"] = e.flags;
          d["queued_ns"] = e.queued_ns;
          d["start_ns"] = e.start_ns;
          d["end_ns"] = e.end_ns;
          d["same_stream"] = e.same_stream;
          out.append(d);
        }
        return py::make_tuple(out, dropped);
      },
      "Stops recording; returns (records oldest first, number of records the ring overwrote). Times are ns of "
      "the host's steady clock, -1 where an event had not completed: wait for the streams first");
  m.def("timeline_recording", &timeline::recording);
  m.def("timeline_now_ns", &timeline::now_ns, "The clock timeline records are stamped in");
  m.def("timeline_mark", &timeline::mark_host, py::arg("phase"), py::arg("key"),
        "A mark stamped with the host clock, while recording");

  // Saved-tensor hooks switch off autograd's in-place check; the hooks restore it with this: the
  // tensor's version counter, held without holding the tensor's memory.
  m.def("storage_key", &storage_key, py::arg("tensor"),
        "A storage's identity as an integer (its address, as UntypedStorage._cdata): stable while something holds "
        "the storage, even weakly (an OffloadHandle does)");

  py::class_<NodePath>(m, "NodePath", "A path through an autograd graph: ((next_functions index, node name), ...)")
      .def(py::init([](std::vector<std::pair<size_t, std::string>> steps) { return NodePath{std::move(steps)}; }),
           py::arg("steps"))
      .def("follow", &NodePath::follow_py, py::arg("node"),
           "The grad_fn the path leads to from node (a grad_fn), or None where the graph differs");

  py::class_<HostBlock, std::shared_ptr<HostBlock>>(m, "HostBlock",
                                                    "A pool block; its memory returns to the pool when the last "
                                                    "reference (this object or a tensor from tensor()) dies.")
      .def_property_readonly("size", &HostBlock::size)
      .def_property_readonly("capacity", &HostBlock::capacity)
      .def_property_readonly("ptr", [](const HostBlock& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def("tensor", &block_tensor);

  py::class_<HostPool, std::shared_ptr<HostPool>>(m, "HostPool")
      .def(py::init(&make_pool), py::arg("pinned") = py::none(),
           "pinned=None pins when CUDA is usable; pinned=True raises when it is not")
      .def(
          "acquire",
          // Always waits on the host for a copy that may still read a reused block: Python has no
          // stream to order its own writes after that copy.
          [](HostPool& p, int64_t nbytes) { return p.acquire(checked_size(nbytes, "acquire: nbytes"), true); },
          py::arg("nbytes"), release_gil(),
          "A block of at least nbytes, or None when the capacity cap or the system refuses; waits for any copy "
          "still reading a reused block")
      .def(
          "reserve",
          [](HostPool& p, int64_t nbytes, int64_t count) {
            TORCH_CHECK_VALUE(count >= 0, "HostPool.reserve: count must be >= 0, got ", count);
            p.reserve(checked_size(nbytes, "HostPool.reserve: nbytes"), static_cast<size_t>(count));
          },
          py::arg("nbytes"), py::arg("count") = 1, release_gil(),
          "Makes sure `count` requests of nbytes, held at once, are served from free blocks; allocates "
          "only what the free blocks cannot cover (a second call allocates nothing)")
      .def(
          "reserve",
          [](HostPool& p, const std::vector<int64_t>& sizes) {
            std::vector<size_t> checked;
            checked.reserve(sizes.size());
            for (int64_t n : sizes) checked.push_back(checked_size(n, "HostPool.reserve: every size"));
            py::gil_scoped_release no_gil;
            p.reserve(checked);
          },
          py::arg("sizes"),
          "The same for a list of request sizes held at once (ckpt_offload.reserve_for passes one step's)")
      .def("set_node_guard", &HostPool::set_node_guard, py::arg("meminfo"), py::arg("cgroups"), py::arg("reserve"),
           release_gil(),
           "Refuse to grow past what the node has left (see ckpt_offload.engine.guard_node, which sets it "
           "from hostmem's files): meminfo's MemAvailable and each (limit, usage file) cgroup's limit less its "
           "usage must stay at or above reserve bytes after an allocation. An empty meminfo and no cgroup: off.")
      .def("node_available", &HostPool::node_available, release_gil(),
           "What the node guard reads as available now, in bytes; -1 when it is off or reads nothing.")
      .def("empty_cache", &HostPool::empty_cache, release_gil())
      .def(
          "set_capacity",
          [](HostPool& p, int64_t nbytes) { p.set_capacity(checked_size(nbytes, "set_capacity: nbytes")); },
          py::arg("nbytes"), release_gil(), "0 removes the cap")
      .def("stats",
           [](HostPool& p) {
             PoolStats s;
             {
               py::gil_scoped_release no_gil;  // the pool lock can be held across a pinning call
               s = p.stats();
             }
             return pool_stats_dict(s);
           })
      .def(
          "reset_stats",
          [](HostPool& p) {
            p.reset_stats();
            if (auto tier = p.spill()) tier->reset_stats();
          },
          release_gil())
      .def_property_readonly("pinned", &HostPool::pinned)
      .def(
          "set_spill_dir",
          [](HostPool& p, py::object path, std::optional<int64_t> max_bytes, int64_t read_ahead, int64_t spill_ahead) {
            if (path.is_none()) {
              py::gil_scoped_release no_gil;
              p.set_spill(nullptr);
              return;
            }
            py::object fs = py::module_::import("os").attr("fspath")(path);
            TORCH_CHECK_VALUE(py::isinstance<py::str>(fs), "HostPool.set_spill_dir: path must be a str or os.PathLike ",
                              "of str (or None to switch the disk tier off)");
            TORCH_CHECK_VALUE(!max_bytes || *max_bytes > 0, "HostPool.set_spill_dir: max_bytes must be a positive ",
                              "number of bytes or None (no budget), got ", max_bytes.value_or(0));
            TORCH_CHECK_VALUE(read_ahead >= 0 && read_ahead <= 1024, "HostPool.set_spill_dir: read_ahead must be ",
                              "between 0 and 1024 layers, got ", read_ahead);
            TORCH_CHECK_VALUE(spill_ahead >= 0 && spill_ahead <= 1024, "HostPool.set_spill_dir: spill_ahead must be ",
                              "between 0 and 1024 writes, got ", spill_ahead);
            const std::string dir = fs.cast<std::string>();
            auto tier = make_spill_tier(dir, static_cast<uint64_t>(max_bytes.value_or(0)), static_cast<int>(read_ahead),
                                        static_cast<int>(spill_ahead));
            py::gil_scoped_release no_gil;
            p.set_spill(std::move(tier));
          },
          py::arg("path"), py::arg("max_bytes") = py::none(), py::arg("read_ahead") = 2, py::arg("spill_ahead") = 1,
          "Once the pool's cap is reached, offloads spill the blocks of the earliest layers to files in a "
          "per-process directory under path (None switches the disk tier off). max_bytes: the disk budget. "
          "read_ahead: layers a read starts ahead of the reload. spill_ahead: writes started before the cap refuses")
      .def_property_readonly(
          "spill_dir",
          [](HostPool& p) -> py::object {
            auto tier = p.spill();
            if (!tier) return py::none();
            const std::string dir = tier->process_dir();
            return dir.empty() ? py::object(py::none()) : py::object(py::str(dir));
          },
          "The per-process directory the disk tier writes in (None when off or removed by empty_cache())")
      .def_property_readonly(
          "spill_read_ahead", [](HostPool& p) { auto t = p.spill(); return t ? t->read_ahead() : 0; },
          "Layers a read from the disk tier starts ahead of the reload (0 without a disk tier)")
      .def("spill_stats", [](HostPool& p) { return spill_stats_dict(p.spill()); })
      .def(
          "inject_spill_fault",
          [](HostPool& p, const std::string& op, int64_t nth, int err) {
            TORCH_CHECK_VALUE(op == "write" || op == "read", "inject_spill_fault: op must be 'write' or 'read', got '",
                              op, "'");
            TORCH_CHECK_VALUE(nth >= 0, "inject_spill_fault: nth must be >= 0, got ", nth);
            TORCH_CHECK_VALUE(err > 0, "inject_spill_fault: errno must be positive, got ", err);
            auto tier = p.spill();
            TORCH_CHECK(tier, "inject_spill_fault: the pool has no disk tier (call set_spill_dir first)");
            tier->inject_fault(op == "write", static_cast<uint64_t>(nth), err);
          },
          py::arg("op"), py::arg("nth") = 1, py::arg("errno") = ENOSPC,
          "Testing aid: the nth next write (or read) of the disk tier fails with this errno (nth=0 clears)")
      .def(
          "set_spill_worker_linger",
          [](HostPool& p, double seconds) {
            TORCH_CHECK_VALUE(seconds >= 0 && seconds <= 60, "set_spill_worker_linger: seconds must be between 0 and 60, got ",
                              seconds);
            auto tier = p.spill();
            TORCH_CHECK(tier, "set_spill_worker_linger: the pool has no disk tier (call set_spill_dir first)");
            tier->set_worker_linger(static_cast<int64_t>(seconds * 1e6));
          },
          py::arg("seconds"),
          "Testing aid: each disk worker waits this long after a job before it returns to the queue")
      .def(
          "inject_alloc_failures",
          [](HostPool& p, int64_t n) {
            TORCH_CHECK_VALUE(n >= 0, "inject_alloc_failures: n must be >= 0, got ", n);
            p.inject_alloc_failures(static_cast<uint64_t>(n));
          },
          py::arg("n"), "Testing aid: the next n host allocations fail as if pinned memory ran out")
      .def(
          "set_alloc_limit",
          [](HostPool& p, int64_t per_alloc, int64_t total) {
            p.set_alloc_limit(checked_size(per_alloc, "set_alloc_limit: per_alloc"),
                              checked_size(total, "set_alloc_limit: total"));
          },
          py::arg("per_alloc") = 0, py::arg("total") = 0, release_gil(),
          "Testing aid: host allocations over per_alloc bytes fail (as WSL2 refuses large pinned "
          "allocations), and so do those that would take what the pool holds past total bytes (a memlock "
          "limit); 0: no limit")
      .def(
          "set_numa_cpus",
          [](HostPool& p, int64_t node, const std::vector<int>& cpus) {
            py::gil_scoped_release no_gil;
            p.set_numa_cpus(node, cpus);
          },
          py::arg("node"), py::arg("cpus"),
          "Each later host allocation runs with the allocating thread bound to these CPUs (NUMA node `node`'s), "
          "its own affinity put back afterwards; an empty list stops it. ckpt_offload.engine.place_pool decides.")
      .def("last_alloc_cpus", &HostPool::last_alloc_cpus, release_gil(),
           "Testing aid: the CPUs the allocating thread was bound to during the last host allocation, as read "
           "back from the kernel then; empty when it was not bound")
      .def_static(
          "round_size", [](int64_t n) { return HostPool::round_size(checked_size(n, "round_size: nbytes")); },
          py::arg("nbytes"), "The size class (block capacity) a request of nbytes is allocated with");

  py::class_<OffloadHandle, std::shared_ptr<OffloadHandle>>(m, "OffloadHandle")
      .def_property_readonly("state",
                             [](OffloadHandle& h) {
                               HandleState st;
                               {
                                 py::gil_scoped_release no_gil;
                                 st = h.state();
                               }
                               return std::string(state_name(st));
                             })
      .def_property_readonly("nbytes", &OffloadHandle::nbytes)
      .def_property_readonly("shape", [](const OffloadHandle& h) { return h.sizes(); })
      .def_property_readonly("stride", [](const OffloadHandle& h) { return h.strides(); })
      .def_property_readonly("dtype", [](const OffloadHandle& h) { return h.dtype(); })
      .def_property_readonly("device", [](const OffloadHandle& h) { return h.device(); })
      .def_property_readonly("storage_key", &OffloadHandle::storage_key,
                             "storage_key() of the tensor it copied (0 without a storage): held weakly, not reused")
      .def_property_readonly("compacted", &OffloadHandle::compacted)
      .def_property_readonly("id", &OffloadHandle::id, "Serial number, named by hazard errors of the simulated runtime")
      .def_property_readonly("value", &OffloadHandle::source_version,
                             "The offloaded tensor's version counter, read now")
      .def("host_bytes", [](OffloadHandle& h) -> py::object {
        at::Tensor t;
        {
          py::gil_scoped_release no_gil;  // waits for the copy to the host
          t = h.host_bytes();
        }
        if (!t.defined()) return py::none();
        return py::cast(t);
      });

  py::class_<CopyEngine, std::shared_ptr<CopyEngine>>(m, "CopyEngine")
      .def(py::init([](const c10::Device& device, std::shared_ptr<HostPool> pool) {
             return CopyEngine::create(device, pool ? pool : CopyEngine::global_pool());
           }),
           py::arg("device"), py::arg("pool") = nullptr)
      .def(py::init([](const std::string& device, std::shared_ptr<HostPool> pool) {
             return CopyEngine::create(c10::Device(device), pool ? pool : CopyEngine::global_pool());
           }),
           py::arg("device"), py::arg("pool") = nullptr)
      .def("offload", &CopyEngine::offload, py::arg("tensor"), release_gil(),
           "Starts the copy to host; returns a handle, or None when the pool refused a block")
      .def("prefetch", &CopyEngine::prefetch, py::arg("handle"), release_gil())
      .def("fetch", &CopyEngine::fetch, py::arg("handle"), py::arg("keep_host") = false, release_gil())
      .def("release", &CopyEngine::release, py::arg("handle"), release_gil())
      .def("read_ahead", &CopyEngine::read_ahead, py::arg("handle"), release_gil(),
           "A spilled handle: starts reading it back into a pool block within the cap; else nothing. False when "
           "no block was free within the cap (ask again later)")
      .def("poll", &CopyEngine::poll, release_gil())
      .def(
          "release_sources",
          [](CopyEngine& e, int64_t keep_bytes) {
            TORCH_CHECK_VALUE(keep_bytes >= 0, "release_sources: keep_bytes must be >= 0, got ", keep_bytes);
            py::gil_scoped_release no_gil;
            return e.release_sources(static_cast<size_t>(keep_bytes));
          },
          py::arg("keep_bytes") = 0,
          "Hands sources back to the allocator, all but those with fewer than keep_bytes of later copies queued "
          "after them; unfinished copies are waited for on the producing stream, not on the host. Returns how "
          "many are still held")
      .def("synchronize", &CopyEngine::synchronize, release_gil())
      .def("stats",
           [](CopyEngine& e) {
             EngineStats s;
             {
               py::gil_scoped_release no_gil;  // never wait for the engine lock holding the GIL
               s = e.stats();
             }
             return engine_stats_dict(s);
           })
      .def("reset_stats", &CopyEngine::reset_stats, release_gil())
      .def("timeline_mark", &CopyEngine::timeline_mark, py::arg("phase"), py::arg("key"), release_gil(),
           "While a timeline records: a mark at the present end of the caller's current stream")
      .def_property_readonly("device", &CopyEngine::device)
      .def_property_readonly("pool", &CopyEngine::pool)
      .def_property_readonly("uses_cuda", &CopyEngine::uses_cuda)
      .def_property_readonly("runtime", &CopyEngine::runtime_name, "'cuda', 'sync' or 'async-sim'")
      .def_readonly_static("HAND_BACK_BYTES", &CopyEngine::kHandBackBytes,
                           "offload() hands back sources with at least this many bytes of copies queued after them");

  bind_session_core(m);
  m.def("engine_for", &CopyEngine::for_device, py::arg("device"),
        "The process-wide engine of a device (created on first use), sharing the global pool");
  m.def(
      "engine_for", [](const std::string& device) { return CopyEngine::for_device(c10::Device(device)); },
      py::arg("device"));
  m.def("all_engines", &CopyEngine::all_engines);
  m.def("global_pool", &CopyEngine::global_pool);
}
