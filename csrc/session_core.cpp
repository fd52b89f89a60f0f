// SessionCore: an OffloadSession's per-tensor work (see session_core.h and ckpt_offload/session.py).
//
// Every method runs holding the GIL, which guards the state below; the GIL is released only around
// copy-engine calls, never between reading and writing that state. Python objects held here (a
// tensor kept on the device, the owner's weak reference) are dropped with the GIL held.
#include "session_core.h"

#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "copy_engine.h"
#include "graph_nodes.h"
#include "host_pool.h"
#include "spill.h"

namespace py = pybind11;

namespace ckpt_offload {
namespace {

constexpr int64_t kNoTask = std::numeric_limits<int64_t>::min();

// stats()'s figures counted here (summed over every session).
std::atomic<uint64_t> g_shared_views{0};
std::atomic<uint64_t> g_kept_on_device{0};
std::atomic<uint64_t> g_midpoint_misses{0};
std::atomic<uint64_t> g_unmovable_kept{0};  // would be offloaded, but the engine cannot take them

int64_t graph_task() { return torch::autograd::get_current_graph_task_id(); }

// A dense strided tensor with data (not nested, quantized, or a lazy conjugate or negative view) on
// a CUDA device, or on the CPU where allow_cpu: its bytes; else -1.
int64_t offload_size(const at::Tensor& t, bool allow_cpu) {
  if (!(t.is_cuda() || (allow_cpu && t.is_cpu()))) return -1;
  if (t.layout() != c10::kStrided || t.is_nested() || t.is_quantized() || t.is_conj() || t.is_neg()) return -1;
  if (!t.has_storage()) return -1;
  return static_cast<int64_t>(t.nbytes());
}

// The element range [start, end) of its storage a tensor covers.
std::pair<int64_t, int64_t> element_range(const at::Tensor& t) {
  const int64_t start = t.storage_offset();
  if (t.numel() == 0) return {start, start};
  int64_t end = start + 1;
  for (int64_t d = 0; d < t.dim(); ++d) end += (t.size(d) - 1) * t.stride(d);
  return {start, end};
}

bool plain_tensor(PyObject* obj) { return Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(THPVariableClass); }

// Python functions and flags the core calls (looked up once).
struct PyParts {
  py::object timeline, profiler, named_engine, modified_error, warn_refused, warn_unmovable, engine, pack_subclass, unpack_subclass;
  py::object timeline_globals, profiler_globals;  // the two modules' namespaces, read by naming()
  py::str enabled{"enabled"}, profiler_on{"_is_profiler_enabled"};
};

PyParts& parts() {
  static PyParts* p = [] {
    auto* out = new PyParts();  // never destroyed: Python objects must not die after the interpreter
    out->timeline = py::module_::import("ckpt_offload.timeline");
    out->profiler = py::module_::import("torch.autograd.profiler");
    out->timeline_globals = out->timeline.attr("__dict__");
    out->profiler_globals = out->profiler.attr("__dict__");
    out->named_engine = out->timeline.attr("NamedEngine");
    out->engine = py::module_::import("ckpt_offload.engine");
    auto session = py::module_::import("ckpt_offload.session");
    out->modified_error = session.attr("_modified_error");
    out->warn_refused = session.attr("_warn_refused");
    out->warn_unmovable = session.attr("_warn_unmovable");
    out->pack_subclass = session.attr("_pack_subclass");
    out->unpack_subclass = session.attr("_unpack_subclass");
    return out;
  }();
  return *p;
}

// Whether copies are named for a timeline or a profiler (timeline.enabled, or torch's profiler on).
// Read from the modules' namespaces (one dict lookup each, per copy), not through getattr.
bool naming() {
  PyParts& p = parts();
  auto flag = [](const py::object& globals, const py::str& name) {
    PyObject* v = PyDict_GetItemWithError(globals.ptr(), name.ptr());  // borrowed
    if (v == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return false;
    }
    if (v == Py_True) return true;
    if (v == Py_False) return false;
    const int truth = PyObject_IsTrue(v);  // -1: its __bool__ raised, and the error is set
    if (truth < 0) throw py::error_already_set();
    return truth == 1;
  };
  return flag(p.timeline_globals, p.enabled) || flag(p.profiler_globals, p.profiler_on);
}

struct Record {
  HandlePtr handle;
  std::shared_ptr<CopyEngine> engine;
  size_t nbytes = 0;
  int64_t seq = 0;    // the last pack that uses this copy: where backward needs it first
  int64_t group = 0;  // the checkpoint call (layer) of that pack
  int64_t storage_offset = 0;
  int64_t version = 0;      // the source's version when offloaded (handle->source_version() reads it now)
  bool prefetched = false;  // a reload is on its way (started ahead of the fetch)
  bool read_ahead = false;  // a read from the disk tier was asked for
  int64_t task = kNoTask;   // the backward (graph task) that fetched it last: not prefetched again there
  at::Tensor tensor;        // once back, while views sharing the copy are still to be unpacked
  int64_t users = 0;        // the live packs attached to this copy (views of one range share it)
  int64_t left = 0;         // of those, how many this backward has still to unpack while tensor is held
  uint64_t hold = 0;        // which holding of tensor this is (a pack that unpacked from it knows)
};
using RecordPtr = std::shared_ptr<Record>;

// The GIL for a scope, taken only where this thread lacks it (autograd drops Packed objects holding it,
// and runs midpoint hooks without it): lighter than pybind's gil_scoped_acquire on both paths.
class WithGil {
 public:
  WithGil() : held_(PyGILState_Check() != 0) {
    if (!held_) state_ = PyGILState_Ensure();
  }
  ~WithGil() {
    if (!held_) PyGILState_Release(state_);
  }
  WithGil(const WithGil&) = delete;
  WithGil& operator=(const WithGil&) = delete;

 private:
  bool held_;
  PyGILState_STATE state_{};
};

// What autograd keeps for one saved tensor: a record plus how to view it, or the tensor itself while
// it stays on the device (kept, or waiting in the keep-last queue).
struct Packed {
  py::object kept;  // the tensor, while on the device
  RecordPtr record;
  bool has_view = false;  // else the record's own tensor
  std::vector<int64_t> view_size, view_stride;
  int64_t view_delta = 0;  // element offset from the record's start
  int64_t seq = 0;         // pack position: a kept tensor's reload point for what was packed before it
  int64_t group = 0;       // which hooks() context (checkpoint call) packed it
  int64_t version = 0;     // saved-tensor hooks switch autograd's in-place check off; unpack redoes it
  std::optional<c10::VariableVersion> counter;  // once the tensor itself is no longer held
  std::optional<c10::Stream> stream;            // the producer's stream, for a send the keep-last queue deferred
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> source;  // names it in errors
  uint64_t hold = 0;  // the record's holding this pack last unpacked from

  ~Packed() {
    if (!kept && !record) return;
    WithGil gil;  // the record's counts are guarded by it, and a tensor may hold a Python object
    kept = py::object();
    if (record) {
      // Its graph died or its node ran: a reload held for the packs sharing the copy waits for
      // one fewer (else it stays on the device until the record dies, after a retained graph).
      record->users -= 1;
      if (record->tensor.defined() && hold != record->hold && --record->left <= 0) record->tensor = at::Tensor();
    }
  }

  int64_t current_version() const {
    if (kept) return THPVariable_Unpack(kept.ptr())._version();
    return counter ? static_cast<int64_t>(counter->current_version()) : version;
  }
};
using PackedPtr = std::shared_ptr<Packed>;
// The Python object autograd holds for a Packed (a PackedObject, below): made once per saved tensor.
py::object wrap_packed(PackedPtr p);

class SessionCore;

// A hook on the autograd node in the middle of a layer's backward: starts the reloads that layer's
// reload point held back (SessionCore::flush). Under compiled autograd it is left out of the graph
// (compiled_args adds nothing): the next reload point then counts a miss and reloads from the start.
struct MidpointHook : torch::autograd::FunctionPreHook {
  explicit MidpointHook(std::weak_ptr<SessionCore> core) : core_(std::move(core)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override;
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {}

 private:
  std::weak_ptr<SessionCore> core_;
};

class SessionCore : public std::enable_shared_from_this<SessionCore> {
 public:
  // The policy (OffloadSession validates it and reads and writes it through properties).
  int64_t min_bytes = 0;
  int64_t keep_last = 0;
  int64_t prefetch = 1;
  std::optional<int64_t> prefetch_bytes;
  bool by_layer = true;  // prefetch counts layers (hooks() contexts), else tensors
  bool track_modules = false;
  bool sees_weights = false;
  bool test_cpu = false;
  bool defer = false;  // reload points wait for a midpoint (Midpoints)
  uint64_t misses = 0;
  uint64_t fired = 0;  // midpoint hooks autograd reached
  int64_t group = 0;
  py::object owner;  // weakref.ref to the OffloadSession: asked for the model's tensors

  // -- the hooks ------------------------------------------------------------------------------
  py::object pack(py::handle obj, bool keep) {
    const at::Tensor& t = unpack_tensor(obj);
    auto p = std::make_shared<Packed>();
    p->version = t._version();
    // Numbered once candidate() is done: it may call Python (the model's tensors, once a forward),
    // and another thread may pack meanwhile.
    bool unmovable = false;
    const bool offload = candidate(obj, t, &unmovable);
    p->seq = next_seq_;
    p->group = group;
    if (!offload) {
      keep_detached(*p, obj, t);
      if (unmovable && !keep) {
        g_unmovable_kept.fetch_add(1);
        parts().warn_unmovable(py::cast(t.device().str()), py::bool_(t.is_cpu() && !test_cpu),
                               owner ? owner() : py::none());
      }
      return wrap_packed(std::move(p));
    }
    next_seq_ += 1;
    if (keep) {
      keep_detached(*p, obj, t);
      return wrap_packed(std::move(p));
    }
    // Sent now, or from the keep-last queue: held detached only once it stays (the pool refused it,
    // or the forward ended with it in the queue).
    p->kept = py::reinterpret_borrow<py::object>(obj);
    if (keep_last == 0) {
      send(*p);
      return wrap_packed(std::move(p));
    }
    // The newest keep_last candidates wait on the device; the oldest of them goes now.
    if (t.is_cuda()) p->stream = c10::impl::getDeviceGuardImpl(t.device().type())->getStream(t.device());
    deferred_.push_back(p);
    if (static_cast<int64_t>(deferred_.size()) > keep_last) {
      PackedPtr oldest = deferred_.front();
      deferred_.pop_front();
      try {
        send(*oldest);
      } catch (...) {
        // Out of the queue, so end() will not detach it: a saved output kept as given would hold
        // its graph in a cycle through this Packed (which autograd already holds).
        hold_detached(*oldest);
        throw;
      }
    }
    return wrap_packed(std::move(p));
  }

  py::object unpack(const PackedPtr& p) {
    if (p->kept) {
      // Held here: reload_point may let another thread run (the GIL is released around copies),
      // whose pack can send this one out of the keep-last queue and clear p->kept.
      py::object kept = p->kept;
      const int64_t now = THPVariable_Unpack(kept.ptr())._version();
      if (now != p->version) raise_modified(p, now);
      reload_point(p->seq, p->group);
      return kept;
    }
    const int64_t now = static_cast<int64_t>(p->counter->current_version());
    if (now != p->version) raise_modified(p, now);
    at::Tensor base = load(*p->record, *p);
    if (!p->has_view) return py::cast(base);
    return py::cast(base.as_strided(p->view_size, p->view_stride, base.storage_offset() + p->view_delta));
  }

  // unmovable: where given, set when t would be offloaded but the engine cannot take it (a CPU tensor
  // outside the test path, a lazy conjugate or negative view): pack counts and reports it.
  bool candidate(py::handle obj, const at::Tensor& t, bool* unmovable = nullptr) {
    // Parameters, buffers, tensor subclasses (fake, functional, DTensor), meta and CPU tensors are
    // never offloaded: nothing is freed by copying them, or there is no data to copy.
    if (!plain_tensor(obj.ptr())) return false;
    int64_t nbytes = offload_size(t, test_cpu);
    const bool stays = nbytes < 0 && (t.is_cuda() || t.is_cpu()) && t.layout() == c10::kStrided && t.has_storage() &&
                       !t.is_nested() && !t.is_quantized();
    if (stays) nbytes = static_cast<int64_t>(t.nbytes());
    if (nbytes <= 0 || nbytes < min_bytes) return false;
    // Only a parameter, a buffer or a view of one stays as a weight: a leaf that needs grad is none
    // by itself (the first layer's input under peft's enable_input_require_grads, the view of its
    // input a custom autograd.Function saves). Parameters fail plain_tensor above; a module's
    // tensors given as plain tensors (torch.func.functional_call) are found by storage below.
    const bool view = t.is_view();
    if (view) {
      // A view of a parameter (F.linear saves weight.t()): copying it frees nothing, and under FSDP2
      // the unsharded parameter's storage is freed (resize_(0)) after the forward, possibly while the
      // copy still reads it. Looked up per view: FSDP2 registers its unsharded parameters after the
      // module hooks have noted the sharded ones.
      py::object base = py::reinterpret_steal<py::object>(THPVariable_Wrap(t._base()));
      if (!base || !plain_tensor(base.ptr())) return false;
    }
    const intptr_t key = storage_key(t);
    if (!module_keys_.empty() && module_keys_.count(key)) return false;
    if (root_ && (view || !t.grad_fn() || sees_weights || root_gathered_)) {
      // A module's weight or buffer given positionally (a buffer, a detach()ed weight, a view of
      // either). An op's fresh output (a grad_fn, no base: the hidden states a block gets) has a
      // storage of its own and needs no lookup, so the model's tensors are gathered only when a
      // forward first packs something else.
      if (!root_gathered_) gather_root();
      if (root_keys_.count(key)) return false;
    }
    if (stays) {
      if (unmovable != nullptr) *unmovable = true;
      return false;
    }
    return true;
  }

  // -- forwards and layers --------------------------------------------------------------------
  void new_forward() {
    if (track_modules) open_context();
    if (starts_.empty() || starts_.back() != next_seq_) starts_.push_back(next_seq_);
    // Only starts at or after the oldest live record still delimit anything.
    const int64_t oldest = records_.empty() ? next_seq_ : records_.front().seq;
    size_t drop = 0;
    while (starts_.size() - drop > 1 && starts_[drop + 1] <= oldest) ++drop;
    starts_.erase(starts_.begin(), starts_.begin() + static_cast<std::ptrdiff_t>(drop));
  }

  void end() {
    if (track_modules) close_context();
    for (auto& p : deferred_) hold_detached(*p);  // the keep-last queue stays on the device
    deferred_.clear();
    module_keys_.clear();
    poll();
  }

  // Every source goes back to the allocator now, those whose copy to the host is still running
  // ordered after it on their stream (no host wait).
  void poll() {
    if (engines_.empty()) return;
    if (engines_.size() == 1) {  // the common case, without a copy of the map
      auto eng = engines_.begin()->second;
      py::gil_scoped_release nogil;
      eng->release_sources(0);
      return;
    }
    std::vector<std::shared_ptr<CopyEngine>> engines;  // another thread may add one while the GIL is released
    for (auto& kv : engines_) engines.push_back(kv.second);
    py::gil_scoped_release nogil;
    for (auto& eng : engines) eng->release_sources(0);
  }

  void set_root(bool active) {
    root_ = active;
    root_gathered_ = false;
    root_keys_.clear();
  }

  void add_module_keys(const std::vector<intptr_t>& keys) { module_keys_.insert(keys.begin(), keys.end()); }

  // -- reloads --------------------------------------------------------------------------------
  // Starts the reloads held by a reload point (called from the middle of a layer's backward).
  // later: where given, the reloads to start are left there for the caller, who starts them once it
  // has let go of the GIL (the midpoint hook), else they start here.
  void flush(std::vector<RecordPtr>* later = nullptr) {
    auto it = pending_.find(std::this_thread::get_id());
    if (it == pending_.end()) return;
    const Pending held = it->second;
    pending_.erase(it);
    if (held.task == graph_task()) prefetch_before(held.seq, later);  // else left by an earlier backward
  }

  bool arm(py::handle node_obj) {
    torch::autograd::Node* node = node_of(node_obj.ptr());
    if (node == nullptr) return false;
    node->add_pre_hook(std::make_unique<MidpointHook>(weak_from_this()));
    return true;
  }

  // A learned block's forward ended with out: hooks the node path leads to from out's grad_fn.
  // 1: hooked; 0: the path does not match this graph; -1: out is not a plain tensor with a grad_fn
  // (the caller looks for its node in Python).
  int arm_path(const NodePath& path, py::handle out) {
    if (Py_TYPE(out.ptr()) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return -1;
    const at::Tensor& t = THPVariable_Unpack(out.ptr());
    if (!t.requires_grad()) return -1;
    const auto& fn = t.grad_fn();
    if (!fn) return -1;
    torch::autograd::Node* node = path.follow(fn.get());
    if (node == nullptr) return 0;
    node->add_pre_hook(std::make_unique<MidpointHook>(weak_from_this()));
    return 1;
  }

  // A learned layer's checkpoint in one call (checkpointing.run_learned): a new layer, the session's
  // hooks pushed around torch's checkpoint(function, *args, **kwargs) and popped however it ends, the
  // layer's sources handed back (poll), and the midpoint's node hooked by following walk from the
  // output. spec: (push, pop, pack hook, unpack hook, torch.utils.checkpoint, kwargs), made once per
  // session. Returns (out, armed): armed as arm_path, or 2 where there was nothing to hook (midpoints
  // off, grad off, inside a backward).
  py::tuple run_layer(const py::tuple& spec, py::handle function, const py::tuple& args, const NodePath& walk) {
    if (spec.size() != 6) throw py::value_error("SessionCore.run_layer: spec is (push, pop, pack, unpack, module, kwargs)");
    static PyObject* checkpoint_name = PyUnicode_InternFromString("checkpoint");
    group += 1;
    PyObject* pushed = PyObject_CallFunctionObjArgs(spec[0].ptr(), spec[2].ptr(), spec[3].ptr(), nullptr);
    if (pushed == nullptr) throw py::error_already_set();
    Py_DECREF(pushed);
    PyObject* out = nullptr;
    {
      PyObject* checkpoint = PyObject_GetAttr(spec[4].ptr(), checkpoint_name);
      const Py_ssize_t n = PyTuple_GET_SIZE(args.ptr());
      PyObject* call_args = checkpoint ? PyTuple_New(n + 1) : nullptr;
      if (call_args != nullptr) {
        Py_INCREF(function.ptr());
        PyTuple_SET_ITEM(call_args, 0, function.ptr());
        for (Py_ssize_t k = 0; k < n; ++k) {
          PyObject* a = PyTuple_GET_ITEM(args.ptr(), k);
          Py_INCREF(a);
          PyTuple_SET_ITEM(call_args, k + 1, a);
        }
        out = PyObject_Call(checkpoint, call_args, spec[5].ptr());
        Py_DECREF(call_args);
      }
      Py_XDECREF(checkpoint);
    }
    if (out == nullptr) {
      py::error_already_set failed;  // taken out of the interpreter while the hooks come off
      pop_layer(spec);
      throw failed;
    }
    py::object result = py::reinterpret_steal<py::object>(out);
    pop_layer(spec);
    int armed = 2;
    if (defer && at::GradMode::is_enabled() && graph_task() == -1) armed = arm_path(walk, result);
    return py::make_tuple(std::move(result), armed);
  }

  py::object pending() const {
    auto it = pending_.find(std::this_thread::get_id());
    if (it == pending_.end()) return py::none();
    return py::make_tuple(it->second.seq, it->second.group, it->second.task);
  }

  // The live records, in pack order (testing aid: a record held from Python stays alive).
  std::vector<RecordPtr> live_records() const {
    std::vector<RecordPtr> out;
    for (const auto& e : records_) {
      if (auto r = e.rec.lock()) out.push_back(std::move(r));
    }
    return out;
  }

 private:
  struct Entry {
    int64_t seq;
    std::weak_ptr<Record> rec;
  };
  struct StorageEntry {
    std::weak_ptr<Record> rec;
    int64_t start, end;
    at::ScalarType dtype;
  };
  struct Pending {
    int64_t seq, group, task;
  };
  bool in_context_ = false;  // listed among the open offload_activations contexts

  // The offload_activations contexts open now, each a session; the GIL guards the list.
  static std::vector<std::weak_ptr<SessionCore>>& open_contexts() {
    static auto* list = new std::vector<std::weak_ptr<SessionCore>>();  // never destroyed, as parts()
    return *list;
  }

  void open_context() {
    if (in_context_) return;
    in_context_ = true;
    auto& list = open_contexts();
    list.erase(std::remove_if(list.begin(), list.end(), [](const auto& w) { return w.expired(); }), list.end());
    list.push_back(weak_from_this());
  }

  void close_context() {
    if (!in_context_) return;
    in_context_ = false;
    auto& list = open_contexts();
    list.erase(std::remove_if(list.begin(), list.end(),
                              [this](const auto& w) {
                                auto c = w.lock();
                                return !c || c.get() == this;
                              }),
               list.end());
  }

  // A live record of another open context that covers t's range of the same storage, unwritten since.
  RecordPtr sent_by_enclosing(intptr_t key, int64_t start, int64_t end, const at::Tensor& t, int64_t version) {
    for (const auto& w : open_contexts()) {
      auto other = w.lock();
      if (!other || other.get() == this) continue;
      auto found = other->by_storage_.find(key);
      if (found == other->by_storage_.end()) continue;
      for (const auto& e : found->second) {
        RecordPtr rec = e.rec.lock();
        if (rec && e.dtype == t.scalar_type() && rec->version == version &&
            static_cast<int64_t>(rec->handle->source_version()) == rec->version && e.start <= start &&
            end <= e.end && rec->engine == engine_for(t)) {
          return rec;
        }
      }
    }
    return nullptr;
  }

  void pop_layer(const py::tuple& spec) {
    PyObject* popped = PyObject_CallNoArgs(spec[1].ptr());
    if (popped == nullptr) throw py::error_already_set();
    Py_DECREF(popped);
    poll();
  }

  // Held detached (torch's advice for pack hooks): a saved output held with its grad_fn would make a
  // cycle node -> Packed -> tensor -> node that no collector sees (Packed is not GC-tracked). The
  // original is named by source. A __torch_dispatch__ subclass (DTensor, TwoTensor) detaches through
  // its own dispatch and stays that subclass, without the grad_fn, as torch's own saved outputs do.
  static void keep_detached(Packed& p, py::handle obj, const at::Tensor& t) {
    if (!t.grad_fn()) {  // no graph to cycle through: the tensor itself
      p.kept = py::reinterpret_borrow<py::object>(obj);
      return;
    }
    at::Tensor d = t.detach();
    // The same counter whatever dispatch keys are excluded here (a dispatch mode's pack: no ADInplaceOrView).
    torch::autograd::impl::set_version_counter(d, torch::autograd::impl::version_counter(t));
    p.kept = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(d)));
    p.source = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(t.getIntrusivePtr());
  }

  // keep_detached for a pack that holds its tensor as given (a send refused, the keep-last queue).
  static void hold_detached(Packed& p) {
    if (!p.kept) return;
    py::object obj = p.kept;
    keep_detached(p, obj, THPVariable_Unpack(obj.ptr()));
  }

  static const at::Tensor& unpack_tensor(py::handle obj) {
    if (!THPVariable_Check(obj.ptr())) throw py::type_error("OffloadSession.pack: expected a tensor");
    return THPVariable_Unpack(obj.ptr());
  }

  [[noreturn]] void raise_modified(const PackedPtr& p, int64_t now) {
    py::object err = parts().modified_error(wrap_packed(p), now);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
    throw py::error_already_set();
  }

  void gather_root() {
    py::object session = owner ? owner() : py::none();
    root_keys_.clear();
    if (!session.is_none()) {
      for (py::handle k : session.attr("_gather_root")()) root_keys_.insert(k.cast<intptr_t>());
    }
    root_gathered_ = true;
  }

  py::object named(const std::shared_ptr<CopyEngine>& eng, int64_t grp, bool prefetched) {
    py::object session = owner ? owner() : py::none();
    return parts().named_engine(py::cast(eng), session, grp, prefetched);
  }

  std::shared_ptr<CopyEngine> engine_for(const at::Tensor& t) {
    const int index = t.get_device();  // -1: the CPU
    auto it = engines_.find(index);
    if (it != engines_.end()) return it->second;
    // Through ckpt_offload.engine.engine_for, once per device: the process-wide engine (tests put
    // an engine of their own there).
    auto eng = parts().engine.attr("engine_for")(py::cast(t.device())).cast<std::shared_ptr<CopyEngine>>();
    engines_.emplace(index, eng);
    return eng;
  }

  void attach(Packed& p, const RecordPtr& rec, const at::Tensor& t, bool view) {
    if (view) {
      p.has_view = true;
      p.view_size = t.sizes().vec();
      p.view_stride = t.strides().vec();
      p.view_delta = t.storage_offset() - rec->storage_offset;
    }
    p.record = rec;
    rec->users += 1;
    // Its own counter: a tensor sharing the storage need not share the version.
    p.counter = torch::autograd::impl::version_counter(t);
    if (!p.source) p.source = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(t.getIntrusivePtr());
    p.stream.reset();
    p.kept = py::object();
  }

  void send(Packed& p) {
    const at::Tensor t = THPVariable_Unpack(p.kept.ptr());
    // The storage's identity while a record of it lives (its handle holds it), and the element
    // range the tensor covers in it.
    const intptr_t key = storage_key(t);
    auto [start, end] = element_range(t);
    auto found = by_storage_.find(key);
    // One dead entry: the address of a storage whose records are gone, now another's (the
    // allocator reuses addresses at once): nothing to share.
    if (found != by_storage_.end() && (found->second.size() > 1 || !found->second[0].rec.expired())) {
      // A view of a range already on its way: share that copy instead of moving it twice, unless
      // either side was written since (the copy would be stale).
      for (const auto& e : found->second) {
        RecordPtr rec = e.rec.lock();
        if (rec && e.dtype == t.scalar_type() && rec->version == p.version &&
            static_cast<int64_t>(rec->handle->source_version()) == rec->version && e.start <= start &&
            end <= e.end) {
          g_shared_views.fetch_add(1);
          attach(p, rec, t, true);
          move(rec, p.seq, p.group);
          return;
        }
      }
    }
    if (track_modules) {
      // Nested offload_activations contexts: a tensor an enclosing one already sent (a layer's input
      // saved by ops on both sides of the inner context) shares that copy, fetched when this
      // context's backward reaches it.
      if (RecordPtr rec = sent_by_enclosing(key, start, end, t, p.version)) {
        g_shared_views.fetch_add(1);
        attach(p, rec, t, true);
        return;
      }
    }
    at::Tensor src = t;
    bool whole = false;
    if (end - start > t.numel()) {
      // Gaps between elements (q, k, v split from one projection): when the whole storage is not
      // much larger, move it once and view every slice from it, instead of compacting each slice
      // on the device first.
      const int64_t storage_elems = static_cast<int64_t>(t.storage().nbytes()) / t.element_size();
      if (storage_elems <= 4 * t.numel()) {
        src = t.detach().as_strided({storage_elems}, {1}, 0);
        start = 0;
        end = storage_elems;
        whole = true;
      }
    }
    auto eng = engine_for(t);
    HandlePtr handle;
    {
      std::optional<c10::StreamGuard> on_producer;
      if (p.stream && *p.stream != c10::impl::getDeviceGuardImpl(t.device().type())->getStream(t.device())) {
        on_producer.emplace(*p.stream);  // order the copy after the producer, not today's stream
      }
      if (naming()) {
        py::object h = named(eng, p.group, false).attr("offload")(src);
        if (!h.is_none()) handle = h.cast<HandlePtr>();
      } else {
        py::gil_scoped_release nogil;
        handle = eng->offload(src);
      }
    }
    if (!handle) {
      hold_detached(p);
      g_kept_on_device.fetch_add(1);
      parts().warn_refused(py::cast(eng), owner ? owner() : py::none());  // the session notes it too
      return;  // stays on the device
    }
    auto rec = std::make_shared<Record>();
    rec->handle = handle;
    rec->engine = eng;
    rec->nbytes = handle->nbytes();
    rec->seq = p.seq;
    rec->group = p.group;
    rec->storage_offset = start;
    rec->version = p.version;
    if (records_.empty() || records_.back().seq <= p.seq) {
      records_.push_back({p.seq, rec});
    } else {  // a deferred send after a later one
      records_.insert(upper(p.seq), {p.seq, rec});
    }
    if (records_.size() >= compact_at_) compact();
    if (!handle->compacted()) {
      auto& entries = by_storage_[key];
      if (entries.empty() || (entries.size() == 1 && entries[0].rec.expired())) {
        const bool fresh = entries.empty();
        entries.assign(1, StorageEntry{rec, start, end, t.scalar_type()});
        if (fresh && by_storage_.size() > prune_at_) prune_storages();
      } else {  // a storage that outlives its graphs (an input fed every step) keeps one list
        entries.erase(std::remove_if(entries.begin(), entries.end(),
                                     [](const StorageEntry& e) { return e.rec.expired(); }),
                      entries.end());
        entries.push_back(StorageEntry{rec, start, end, t.scalar_type()});
      }
    }
    attach(p, rec, t, whole);
  }

  std::vector<Entry>::iterator lower(int64_t seq) {
    return std::lower_bound(records_.begin(), records_.end(), seq,
                            [](const Entry& e, int64_t s) { return e.seq < s; });
  }
  std::vector<Entry>::iterator upper(int64_t seq) {
    return std::upper_bound(records_.begin(), records_.end(), seq,
                            [](int64_t s, const Entry& e) { return s < e.seq; });
  }

  // A later pack shares rec's copy: backward needs it first there, so it is reloaded with that
  // pack's layer.
  void move(const RecordPtr& rec, int64_t seq, int64_t grp) {
    for (auto it = records_.end(); it != records_.begin();) {
      --it;
      if (it->rec.lock() == rec) {
        records_.erase(it);
        rec->seq = seq;
        rec->group = grp;
        records_.insert(lower(seq), {seq, rec});
        return;
      }
    }
  }

  // Records of graphs that died without backward leave dead entries; drop them with a doubling
  // threshold so the cost stays constant per pack.
  void compact() {
    records_.erase(std::remove_if(records_.begin(), records_.end(), [](const Entry& e) { return e.rec.expired(); }),
                   records_.end());
    prune_storages();
    compact_at_ = std::max<size_t>(64, 2 * records_.size());
  }

  // A key whose records are all gone: its storage's address may belong to another by now.
  void prune_storages() {
    for (auto it = by_storage_.begin(); it != by_storage_.end();) {
      const bool dead = std::all_of(it->second.begin(), it->second.end(),
                                    [](const StorageEntry& e) { return e.rec.expired(); });
      it = dead ? by_storage_.erase(it) : std::next(it);
    }
    prune_at_ = std::max<size_t>(256, 2 * by_storage_.size());
  }

  at::Tensor load(Record& rec, Packed& p) {
    if (rec.tensor.defined()) {  // a view sharing the copy, unpacked before: the last one lets it go
      p.hold = rec.hold;
      rec.left -= 1;
      at::Tensor t = rec.tensor;
      if (rec.left <= 0) rec.tensor = at::Tensor();
      return t;
    }
    // The host copy stays until the record dies: hooks are not told whether this backward retains
    // the graph, and a retained graph must be reloaded (with prefetch) by the next one. The device
    // copy is not held here: autograd holds it as long as a node needs it.
    at::Tensor t;
    if (naming()) {
      t = named(rec.engine, rec.group, rec.prefetched).attr("fetch")(rec.handle, true).cast<at::Tensor>();
    } else {
      py::gil_scoped_release nogil;
      t = rec.engine->fetch(rec.handle, true);  // the copy needed now goes first
    }
    rec.prefetched = false;
    rec.task = graph_task();
    if (rec.users > 1) {
      rec.tensor = t;
      rec.left = rec.users - 1;
      p.hold = ++rec.hold;
    }
    // The pack being unpacked, not the record's: a copy shared with a later graph's pack sits among
    // that graph's entries, and this backward must not reload those.
    reload_point(p.seq, p.group);
    return t;
  }

  // Backward reached the tensor packed at seq: start the reloads of what was packed before it, now,
  // or with midpoints at the middle of this layer's backward (flush).
  void reload_point(int64_t seq, int64_t grp) {
    if (!defer) {
      prefetch_before(seq);
      return;
    }
    const int64_t task = graph_task();
    auto it = pending_.find(std::this_thread::get_id());
    if (it != pending_.end() && it->second.task != task) {
      pending_.erase(it);  // left by an earlier backward (one that stopped partway): stale
      it = pending_.end();
    }
    if (it != pending_.end() && it->second.group != grp) {
      // The previous layer's midpoint never fired (its hooked output got no gradient): start its
      // reloads now and reload from the start of each backward from here on.
      misses += 1;
      g_midpoint_misses.fetch_add(1);
      defer = false;
      const int64_t from = std::min(it->second.seq, seq);
      pending_.erase(it);
      prefetch_before(from);
      return;
    }
    if (it == pending_.end()) {
      pending_.emplace(std::this_thread::get_id(), Pending{seq, grp, task});
    } else {
      it->second.seq = std::min(it->second.seq, seq);  // several inputs of one layer: the earliest
    }
  }

  // Start the reloads backward needs next: records packed before position seq in the same forward,
  // nearest first. With a disk tier, the `read_ahead` units after those start their reads from disk
  // into host memory, so the reload finds them there.
  void prefetch_before(int64_t seq, std::vector<RecordPtr>* later = nullptr) {
    if (prefetch <= 0 || records_.empty()) return;
    const int64_t task = graph_task();
    int64_t ahead = ahead_.second;
    if (task == -1 || ahead_.first != task) {
      auto tier = CopyEngine::global_pool()->spill();
      ahead = tier ? tier->read_ahead() : 0;
      ahead_ = {task, ahead};
    }
    // Drop dead entries at the tail: backward consumes the newest first. A record fetched but
    // alive (a retained graph) stays: the next backward reloads it.
    while (!records_.empty() && records_.back().rec.expired()) records_.pop_back();
    std::ptrdiff_t i = (lower(seq) - records_.begin()) - 1;
    // Records packed before the forward that packed seq belong to other graphs (kept alive without
    // backward, or micro-batches whose backward comes later): not this backward's.
    auto s = std::upper_bound(starts_.begin(), starts_.end(), seq);
    const int64_t lowest = s == starts_.begin() ? -1 : *std::prev(s);
    int64_t queued = 0;
    size_t queued_bytes = 0;
    const int64_t limit = prefetch + ahead;
    bool have_group = false;
    int64_t grp = 0;
    std::vector<RecordPtr> todo, reads;
    while (i >= 0 && records_[i].seq >= lowest) {
      RecordPtr r = records_[i].rec.lock();
      --i;
      if (!r || r->task == task) continue;  // fetched by this backward already
      if (!by_layer || !have_group || r->group != grp) {  // a new unit: a layer's tensors go together
        if (queued >= limit) break;
        if (queued < prefetch && prefetch_bytes && queued > 0 &&
            static_cast<int64_t>(queued_bytes + r->nbytes) > *prefetch_bytes) {
          if (!ahead) break;
          queued = prefetch;  // the byte budget ends the reloads; the reads go on
        }
        queued += 1;
        grp = r->group;
        have_group = true;
      }
      if (queued > prefetch) {
        if (!r->prefetched && !r->read_ahead) {
          r->read_ahead = true;
          reads.push_back(r);
        }
        continue;
      }
      queued_bytes += r->nbytes;
      if (!r->prefetched) {
        r->prefetched = true;
        todo.push_back(std::move(r));
      }
    }
    if (!todo.empty()) {
      if (naming()) {
        for (auto& r : todo) named(r->engine, r->group, false).attr("prefetch")(r->handle);
      } else if (later != nullptr && reads.empty()) {  // the disk tier's reads go after the reloads
        later->insert(later->end(), std::make_move_iterator(todo.begin()), std::make_move_iterator(todo.end()));
      } else {
        py::gil_scoped_release nogil;
        for (auto& r : todo) r->engine->prefetch(r->handle);
      }
    }
    for (auto& r : reads) {
      bool started;
      {
        py::gil_scoped_release nogil;
        started = r->engine->read_ahead(r->handle);
      }
      if (!started) r->read_ahead = false;  // no host block free yet: asked again at the next reload point
    }
  }

  int64_t next_seq_ = 0;
  std::vector<Entry> records_;  // live records by pack order (seq), ascending
  size_t compact_at_ = 64;
  // storage key -> the records of its ranges: a live record's handle holds its storage weakly, so
  // no other storage takes that key while an entry can match.
  std::unordered_map<intptr_t, std::vector<StorageEntry>> by_storage_;
  size_t prune_at_ = 256;
  std::vector<int64_t> starts_;     // pack position where each forward began, ascending
  std::deque<PackedPtr> deferred_;  // keep-last queue: packs still holding their tensor
  std::unordered_map<int, std::shared_ptr<CopyEngine>> engines_;
  // What a layer's reload point held back, per backward thread (autograd runs a device's backward
  // on one thread, the same for a layer's reload point and its midpoint).
  std::unordered_map<std::thread::id, Pending> pending_;
  std::pair<int64_t, int64_t> ahead_{kNoTask, 0};  // (graph task, the disk tier's read-ahead then)
  bool root_ = false;  // exclude the model's tensors (OffloadSession.exclude_module_tensors)
  bool root_gathered_ = false;
  std::unordered_set<intptr_t> root_keys_;    // their storages, once gathered in this forward
  std::unordered_set<intptr_t> module_keys_;  // the storages of the modules noted while tracking
};

torch::autograd::variable_list MidpointHook::operator()(const torch::autograd::variable_list& grads) {
  std::vector<RecordPtr> reloads;  // started after the GIL is let go: one taking of it per hook
  {
    WithGil gil;  // before the core: if it is the last reference, it goes under the GIL
    if (auto core = core_.lock()) {
      core->fired += 1;
      core->flush(&reloads);
    }
  }
  if (reloads.empty()) return grads;
  std::optional<py::gil_scoped_release> nogil;  // a hook run holding the GIL: the engine is never called with it
  if (PyGILState_Check()) nogil.emplace();
  for (auto& r : reloads) r->engine->prefetch(r->handle);
  return grads;
}

// The saved-tensor hooks autograd calls: a plain callable with vectorcall, so a call reaches the core
// without pybind's dispatcher, and with the class attribute _checkpoint_internal (False), which
// torch's checkpoint reads off the innermost pack hook on every entry (a bound method would raise
// and format an AttributeError each time).
enum HookKind : int { kPack = 0, kPackKept = 1, kUnpack = 2 };

// Packed's Python type: a plain object holding the PackedPtr, made and freed without pybind's
// instance registry (once per saved tensor, both ways); its attributes are read-only but version.
struct PackedObject {
  PyObject_HEAD
  PackedPtr p;
};

// A static Python type of this module: its name, size, dealloc, repr and doc; the caller adds the rest.
PyTypeObject static_type(const char* name, Py_ssize_t size, destructor dealloc, reprfunc repr, const char* doc) {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = name;
  t.tp_basicsize = size;
  t.tp_dealloc = dealloc;
  t.tp_repr = repr;
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_doc = doc;
  return t;
}

template <typename F>
PyObject* translated(F&& f) {
  try {
    return f().release().ptr();
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

const Packed& packed_of(PyObject* self) { return *reinterpret_cast<PackedObject*>(self)->p; }

PyObject* packed_kept(PyObject* self, void*) {
  const Packed& p = packed_of(self);
  return py::object(p.kept ? p.kept : py::none()).release().ptr();
}

PyObject* packed_record(PyObject* self, void*) {
  const Packed& p = packed_of(self);
  return translated([&] { return p.record ? py::cast(p.record) : py::none(); });
}

PyObject* packed_seq(PyObject* self, void*) { return PyLong_FromLongLong(packed_of(self).seq); }
PyObject* packed_group(PyObject* self, void*) { return PyLong_FromLongLong(packed_of(self).group); }
PyObject* packed_version(PyObject* self, void*) { return PyLong_FromLongLong(packed_of(self).version); }

int packed_set_version(PyObject* self, PyObject* value, void*) {
  if (value == nullptr) {
    PyErr_SetString(PyExc_AttributeError, "Packed.version cannot be deleted");
    return -1;
  }
  if (PyBool_Check(value) || !PyIndex_Check(value)) {
    PyErr_Format(PyExc_TypeError, "Packed.version: an int is needed, got %s", Py_TYPE(value)->tp_name);
    return -1;
  }
  PyObject* index = PyNumber_Index(value);
  if (index == nullptr) return -1;
  const long long v = PyLong_AsLongLong(index);
  Py_DECREF(index);
  if (v == -1 && PyErr_Occurred()) return -1;
  reinterpret_cast<PackedObject*>(self)->p->version = v;
  return 0;
}

PyObject* packed_current_version(PyObject* self, void*) {
  return translated([&] { return py::int_(packed_of(self).current_version()); });
}

PyObject* packed_copy(PyObject* self, void*) {
  // (dtype, device, shape) of what unpack returns for an offloaded tensor, else None.
  return translated([&]() -> py::object {
    const Packed& p = packed_of(self);
    if (!p.record) return py::none();
    const auto& h = *p.record->handle;
    std::vector<int64_t> shape = p.has_view ? p.view_size : h.sizes();
    py::object dtype = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(h.dtype())));
    return py::make_tuple(dtype, py::cast(h.device()), shape);
  });
}

PyObject* packed_source(PyObject* self, void*) {
  // The offloaded tensor while it lives elsewhere, else None.
  return translated([&]() -> py::object {
    const Packed& p = packed_of(self);
    if (!p.source) return py::none();
    auto impl = p.source->lock();
    if (!impl) return py::none();
    return py::cast(at::Tensor(std::move(impl)));
  });
}

PyGetSetDef packed_getset[] = {
    {"kept", packed_kept, nullptr, "The tensor while it stays on the device, else None", nullptr},
    {"record", packed_record, nullptr, "Its SessionRecord once offloaded, else None", nullptr},
    {"seq", packed_seq, nullptr, "Pack position: a kept tensor's reload point for what was packed before it", nullptr},
    {"group", packed_group, nullptr, "Which layer (hooks() context, checkpoint call) packed it", nullptr},
    {"version", packed_version, packed_set_version, "The version unpack expects (autograd's in-place check)",
     nullptr},
    {"current_version", packed_current_version, nullptr, "The saved tensor's version now", nullptr},
    {"copy", packed_copy, nullptr, "(dtype, device, shape) of what unpack returns once offloaded, else None",
     nullptr},
    {"source", packed_source, nullptr, "The offloaded tensor while it lives elsewhere, else None", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

void packed_dealloc(PyObject* self) {
  // ~Packed may drop the tensor it kept: the GIL is held here.
  reinterpret_cast<PackedObject*>(self)->p.~PackedPtr();
  Py_TYPE(self)->tp_free(self);
}

PyObject* packed_repr(PyObject* self) {
  const Packed& p = packed_of(self);
  return PyUnicode_FromFormat("<ckpt_offload Packed seq=%lld group=%lld %s>", static_cast<long long>(p.seq),
                              static_cast<long long>(p.group),
                              p.record ? "offloaded" : "on the device");
}

PyTypeObject packed_object_type = [] {
  PyTypeObject t = static_type("ckpt_offload._C.Packed", sizeof(PackedObject), packed_dealloc, packed_repr,
                               "What autograd keeps for one saved tensor of an OffloadSession (made by its pack hook)");
  t.tp_getset = packed_getset;
  return t;
}();

py::object wrap_packed(PackedPtr p) {
  auto* o = PyObject_New(PackedObject, &packed_object_type);
  if (o == nullptr) throw py::error_already_set();
  new (&o->p) PackedPtr(std::move(p));
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(o));
}

struct SavedHook {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* owner;    // the SessionCore's Python object, which keeps core alive
  SessionCore* core;
  int kind;
};

PyObject* saved_hook_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* h = reinterpret_cast<SavedHook*>(self);
  if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0)) {
    PyErr_SetString(PyExc_TypeError, h->kind == kUnpack ? "OffloadSession.unpack takes one Packed"
                                                         : "OffloadSession.pack takes one tensor");
    return nullptr;
  }
  if (h->kind != kUnpack) {
    if (THPVariable_Check(args[0]) && !THPVariable_CheckExact(args[0])) {
      // A tensor subclass: session.py packs a DTensor's local shard through this hook and notes what
      // it cannot take; None: packed as it is (kept on the device).
      PyObject* r = translated([&] {
        return parts().pack_subclass(py::handle(self), py::handle(args[0]), h->core->owner ? h->core->owner : py::none());
      });
      if (r != Py_None) return r;
      Py_DECREF(r);
    }
    return translated([&] { return h->core->pack(py::handle(args[0]), h->kind == kPackKept); });
  }
  if (Py_TYPE(args[0]) != &packed_object_type) {  // never subclassed: the exact type; else _pack_subclass's
    return translated([&] { return parts().unpack_subclass(py::handle(self), py::handle(args[0])); });
  }
  return translated([&] { return h->core->unpack(reinterpret_cast<PackedObject*>(args[0])->p); });
}

void saved_hook_dealloc(PyObject* self) {
  Py_XDECREF(reinterpret_cast<SavedHook*>(self)->owner);
  Py_TYPE(self)->tp_free(self);
}

PyObject* saved_hook_repr(PyObject* self) {
  static const char* names[] = {"pack", "pack_kept", "unpack"};
  return PyUnicode_FromFormat("<ckpt_offload session %s hook>", names[reinterpret_cast<SavedHook*>(self)->kind]);
}

PyTypeObject saved_hook_type = [] {
  PyTypeObject t = static_type("ckpt_offload._C.SavedHook", sizeof(SavedHook), saved_hook_dealloc, saved_hook_repr,
                               "A session's saved-tensor hook (pack, pack_kept or unpack)");
  t.tp_vectorcall_offset = offsetof(SavedHook, vectorcall);
  t.tp_call = PyVectorcall_Call;
  t.tp_flags |= Py_TPFLAGS_HAVE_VECTORCALL;
  return t;
}();

py::object make_hook(py::object core, int kind) {
  if (kind < kPack || kind > kUnpack) throw py::value_error("SessionCore.hook: kind is 0 (pack), 1 (pack_kept) or 2 (unpack)");
  auto* h = PyObject_New(SavedHook, &saved_hook_type);
  if (h == nullptr) throw py::error_already_set();
  h->vectorcall = saved_hook_call;
  h->core = core.cast<SessionCore*>();
  h->owner = core.release().ptr();
  h->kind = kind;
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(h));
}

}  // namespace

void bind_session_core(py::module_& m) {
  if (PyType_Ready(&saved_hook_type) < 0) throw py::error_already_set();
  if (PyDict_SetItemString(saved_hook_type.tp_dict, "_checkpoint_internal", Py_False) < 0) throw py::error_already_set();
  PyType_Modified(&saved_hook_type);
  Py_INCREF(&saved_hook_type);
  m.add_object("SavedHook", py::handle(reinterpret_cast<PyObject*>(&saved_hook_type)));
  py::class_<Record, RecordPtr>(m, "SessionRecord", "One offloaded byte range of a storage (read-only)")
      .def_readonly("handle", &Record::handle)
      .def_readonly("nbytes", &Record::nbytes)
      .def_readonly("seq", &Record::seq)
      .def_readonly("group", &Record::group)
      .def_readonly("prefetched", &Record::prefetched)
      .def_readonly("users", &Record::users);
  if (PyType_Ready(&packed_object_type) < 0) throw py::error_already_set();
  Py_INCREF(&packed_object_type);
  m.add_object("Packed", py::handle(reinterpret_cast<PyObject*>(&packed_object_type)));

  py::class_<SessionCore, std::shared_ptr<SessionCore>>(m, "SessionCore",
                                                        "An OffloadSession's hooks and records (session.py)")
      .def(py::init<>())
      .def_readwrite("min_bytes", &SessionCore::min_bytes)
      .def_readwrite("keep_last", &SessionCore::keep_last)
      .def_readwrite("prefetch", &SessionCore::prefetch)
      .def_readwrite("prefetch_bytes", &SessionCore::prefetch_bytes)
      .def_readwrite("by_layer", &SessionCore::by_layer)
      .def_readwrite("track_modules", &SessionCore::track_modules)
      .def_readwrite("sees_weights", &SessionCore::sees_weights)
      .def_readwrite("test_cpu", &SessionCore::test_cpu)
      .def_readwrite("defer", &SessionCore::defer)
      .def_readwrite("owner", &SessionCore::owner)
      .def_readwrite("group", &SessionCore::group)
      .def_readonly("misses", &SessionCore::misses)
      .def_readonly("fired", &SessionCore::fired, "How many midpoint hooks (arm) autograd reached")
      .def("hook", &make_hook, py::arg("kind"),
           "The saved-tensor hook autograd calls: 0 pack, 1 pack_kept, 2 unpack (see SavedHook)")
      .def("is_candidate", [](SessionCore& c, py::handle t) {
        if (!THPVariable_Check(t.ptr())) return false;
        return c.candidate(t, THPVariable_Unpack(t.ptr()));
      }, py::arg("tensor"))
      .def("next_layer", [](SessionCore& c) { c.group += 1; }, "What is packed from now on belongs to a new layer")
      .def("new_forward", &SessionCore::new_forward)
      .def("end", &SessionCore::end)
      .def("poll", &SessionCore::poll)
      .def("arm", &SessionCore::arm, py::arg("node"),
           "Hooks node (a grad_fn): autograd reaching it starts the reloads held back; False when it is none")
      .def("arm_path", &SessionCore::arm_path, py::arg("path"), py::arg("out"),
           "Hooks the node a NodePath leads to from out's grad_fn: 1 hooked, 0 no match, -1 out is no plain "
           "tensor with a grad_fn")
      .def("run_layer", &SessionCore::run_layer, py::arg("spec"), py::arg("function"), py::arg("args"), py::arg("walk"),
           "A learned layer's checkpoint with its hooks and its midpoint, in one call: (out, armed)")
      .def("set_root", &SessionCore::set_root, py::arg("active"))
      .def("add_module_keys", &SessionCore::add_module_keys, py::arg("keys"))
      .def("pending", &SessionCore::pending)
      .def("live_records", &SessionCore::live_records);

  m.def("session_counters", [] {
    py::dict d;
    d["shared_views"] = g_shared_views.load();
    d["tensors_kept_on_device"] = g_kept_on_device.load();
    d["midpoint_misses"] = g_midpoint_misses.load();
    d["unmovable_tensors_kept"] = g_unmovable_kept.load();
    return d;
  });
  m.def("reset_session_counters", [] {
    g_shared_views.store(0);
    g_kept_on_device.store(0);
    g_midpoint_misses.store(0);
    g_unmovable_kept.store(0);
  });
}

}  // namespace ckpt_offload
