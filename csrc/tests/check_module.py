"""ctest smoke check of the CMake-built package: it imports, every ckpt_offload module comes from the
build tree (not from a source checkout or an editable install), and build_info() matches the configure.

Usage: check_module.py PACKAGE_DIR WITH_CUDA(ON|OFF) TORCH_VERSION
"""
import os
import sys

pkg_dir, with_cuda, torch_version = sys.argv[1], sys.argv[2].upper() in ("ON", "1", "TRUE"), sys.argv[3]
pkg_dir = os.path.realpath(pkg_dir)

import ckpt_offload  # noqa: E402

foreign = sorted(
    f"{name}: {mod.__file__}"
    for name, mod in list(sys.modules.items())
    if (name == "ckpt_offload" or name.startswith("ckpt_offload."))
    and getattr(mod, "__file__", None)
    and not os.path.realpath(mod.__file__).startswith(pkg_dir + os.sep)
)
info = ckpt_offload.build_info()
errors = []
if foreign:
    errors.append("modules loaded from outside " + pkg_dir + ":\n  " + "\n  ".join(foreign))
if info["with_cuda"] != with_cuda:
    errors.append(f"with_cuda is {info['with_cuda']}, configured {with_cuda}")
if info["torch_version"] != torch_version:
    errors.append(f"torch_version is {info['torch_version']}, configured {torch_version}")
if with_cuda != (info["cuda_version"] is not None):
    errors.append(f"cuda_version {info['cuda_version']!r} does not fit with_cuda={with_cuda}")
print(info)
if errors:
    sys.exit("FAILED: " + "\n".join(errors))
