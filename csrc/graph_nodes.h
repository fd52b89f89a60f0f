// The autograd node behind a Python grad_fn object, across the torch versions ckpt_offload builds
// against: bindings.cpp (NodePath) and session_core.cpp (midpoint hooks) read graphs through it.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/utils/pybind.h>

namespace ckpt_offload {

// A grad_fn object points to its node by a shared_ptr or a weak_ptr (torch up to 2.13, where the
// graph owns the node) or an intrusive_ptr (2.14). Overloads, not `requires`: C++17 builds too.
template <typename T>
torch::autograd::Node* raw_node(const std::shared_ptr<T>& p) {
  return p.get();
}
template <typename T>
torch::autograd::Node* raw_node(const std::weak_ptr<T>& p) {
  return p.lock().get();
}
template <typename T>
torch::autograd::Node* raw_node(const c10::intrusive_ptr<T>& p) {
  return p.get();
}

// The autograd node behind a grad_fn object (a built-in node's or a custom Function's), or null.
inline torch::autograd::Node* node_of(PyObject* obj) {
  if (torch::autograd::THPCppFunction_Check(obj)) {
    return raw_node(reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata);
  }
  if (THPFunction_Check(obj)) return raw_node(reinterpret_cast<THPFunction*>(obj)->cdata);
  return nullptr;
}

// A path through an autograd graph, from a block's output node to its midpoint's: at each step the
// next_functions entry taken and the name of the node it leads to (see midpoints.py).
struct NodePath {
  std::vector<std::pair<size_t, std::string>> steps;

  // The node the path leads to from start (start itself for no steps), or null where a step is
  // missing or names another node (that forward built a different graph).
  torch::autograd::Node* follow(torch::autograd::Node* start) const {
    const torch::autograd::Edge* edge = last_edge(start);
    return steps.empty() ? start : edge ? edge->function.get() : nullptr;
  }

  // follow() for a grad_fn object: the grad_fn it leads to, or None. One call in place of a
  // next_functions tuple per step.
  pybind11::object follow_py(pybind11::handle start) const {
    torch::autograd::Node* node = node_of(start.ptr());
    if (node == nullptr) return pybind11::none();
    if (steps.empty()) return pybind11::reinterpret_borrow<pybind11::object>(start);
    const torch::autograd::Edge* edge = last_edge(node);
    if (edge == nullptr) return pybind11::none();
    PyObject* obj = torch::autograd::functionToPyObject(edge->function);
    if (obj == nullptr) throw pybind11::error_already_set();
    return pybind11::reinterpret_steal<pybind11::object>(obj);
  }

 private:
  const torch::autograd::Edge* last_edge(torch::autograd::Node* node) const {
    const torch::autograd::Edge* edge = nullptr;
    for (const auto& [k, name] : steps) {
      if (node == nullptr || k >= node->next_edges().size()) return nullptr;
      edge = &node->next_edge(k);
      if (!edge->function || edge->function->name() != name) return nullptr;
      node = edge->function.get();
    }
    return edge;
  }
};

}  // namespace ckpt_offload
