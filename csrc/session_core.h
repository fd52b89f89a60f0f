// The bookkeeping of an OffloadSession (ckpt_offload/session.py) in C++: its saved-tensor hooks
// (pack, unpack), the records of what went to the host, the reload points and the prefetch that
// follows them, and the midpoint hooks. Python keeps the policy's validation, copies, the model's
// tensors (gathered on request) and the messages; everything per saved tensor runs here.
#pragma once

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

namespace ckpt_offload {

// A storage's identity as an integer (its StorageImpl's address, as UntypedStorage._cdata): stable
// while something holds the storage, even weakly (an OffloadHandle does).
inline intptr_t storage_key(const at::Tensor& t) {
  return t.has_storage() ? reinterpret_cast<intptr_t>(t.storage().unsafeGetStorageImpl()) : 0;
}

// Registers SessionCore, Packed and the session counters on the extension module.
void bind_session_core(pybind11::module_& m);

}  // namespace ckpt_offload
