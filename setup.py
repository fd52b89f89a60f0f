# Builds ckpt_offload._C from csrc/ with torch.utils.cpp_extension (use --no-build-isolation so it
# compiles against the torch you run). The metadata, extras and build requirements are in
# pyproject.toml; what is here must be code: the toolkit, the CUDA or host-only variant, the build record.
#
# Environment switches:
#   CKPT_OFFLOAD_WITH_CUDA=0|1  force the host-only or the CUDA build. Default: CUDA when the
#                               installed torch has CUDA and a CUDA toolkit is found. Whether a GPU
#                               is present never matters: a GPU-less box builds the CUDA variant.
#   CUDA_HOME / CUDA_PATH       the toolkit to use. Default: searched (see find_cuda_toolkit), which
#                               also sees through an `nvcc` on PATH that is only a wrapper script.
#   CKPT_OFFLOAD_DEBUG=1        -O0 -g instead of -O3.
#   CKPT_OFFLOAD_SANITIZE=1     AddressSanitizer + UndefinedBehaviorSanitizer (-O1 -g unless DEBUG); Python
#                               then needs LD_PRELOAD of the ASan runtime (scripts/test_sanitized.sh).
#   MAX_JOBS=N                  parallel compile jobs (ninja).
import os
import re
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "ckpt_offload"))
from _toolkit import find_cuda_toolkit  # noqa: E402  (stdlib only; shared with CMake and the loader)
from _floor import CUDA_MIN, cuda_message, torch_message, torch_too_old  # noqa: E402

sys.path.pop(0)


def env_flag(name):
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if value not in ("0", "1"):
        raise SystemExit(f"ckpt_offload setup: {name} must be 0 or 1, got {value!r}")
    return value == "1"


try:
    import torch  # noqa: E402
except ImportError:
    raise SystemExit(
        "ckpt_offload setup: torch is not importable. The extension compiles against the torch already "
        "installed: install torch first, then `pip install --no-build-isolation ...` (an isolated build "
        "environment has no torch, or another one; see docs/install.md)"
    ) from None

if torch_too_old(torch.__version__):
    raise SystemExit(torch_message("ckpt_offload setup", torch.__version__))
torch_has_cuda = torch.version.cuda is not None
forced = env_flag("CKPT_OFFLOAD_WITH_CUDA")
toolkit = find_cuda_toolkit() if forced is not False and torch_has_cuda else None
if forced is True and not torch_has_cuda:
    raise SystemExit(f"ckpt_offload setup: CKPT_OFFLOAD_WITH_CUDA=1 but torch {torch.__version__} has no CUDA")
if forced is True and toolkit is None:
    raise SystemExit(
        "ckpt_offload setup: CKPT_OFFLOAD_WITH_CUDA=1 but no CUDA toolkit was found "
        "(looked at CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda*); set CUDA_HOME=/path/to/cuda"
    )
with_cuda = toolkit is not None if forced is None else forced
cuda_version = None
if with_cuda:
    with open(os.path.join(toolkit, "include", "cuda_runtime_api.h")) as f:
        m = re.search(r"#define CUDART_VERSION\s+(\d+)", f.read())
    cuda_version = (int(m.group(1)) // 1000, int(m.group(1)) % 1000 // 10) if m else None
    if cuda_version is None or cuda_version < CUDA_MIN:
        raise SystemExit(cuda_message("ckpt_offload setup", cuda_version, toolkit))
if with_cuda:
    # torch.utils.cpp_extension reads CUDA_HOME once, when it is imported.
    os.environ["CUDA_HOME"] = toolkit

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

debug = env_flag("CKPT_OFFLOAD_DEBUG")
cxx_flags = ["-O0", "-g"] if debug else ["-O3"]
sanitize = ["-fsanitize=address,undefined"] if env_flag("CKPT_OFFLOAD_SANITIZE") else []
if sanitize:
    cxx_flags = (cxx_flags if debug else ["-O1", "-g"]) + sanitize + ["-fno-omit-frame-pointer"]
# The sources include only the ATen headers they use (ATen/core/Tensor.h, ATen/ops/<op>.h): these two
# make an include of all of torch's operators (ATen/ATen.h, torch/extension.h) a compile error, since
# it would more than double the build time. CMakeLists.txt defines the same.
macros = [
    ("CKPT_OFFLOAD_TORCH_VERSION", f'"{torch.__version__}"'),
    ("AT_PER_OPERATOR_HEADERS", None),
    ("TORCH_ASSERT_ONLY_METHOD_OPERATORS", None),
]
if with_cuda:
    macros.append(("CKPT_OFFLOAD_WITH_CUDA", None))

sources = [os.path.join("csrc", f) for f in (
    "bindings.cpp", "copy_engine.cpp", "runtime.cpp", "runtime_sim.cpp", "runtime_cuda.cpp", "host_pool.cpp",
    "spill.cpp", "cuda_util.cpp", "timeline.cpp", "session_core.cpp",
)]
Extension = CUDAExtension if with_cuda else CppExtension
ext = Extension(
    "ckpt_offload._C",
    sources,
    define_macros=macros,
    extra_compile_args={"cxx": cxx_flags, "nvcc": cxx_flags} if with_cuda else cxx_flags,
    extra_link_args=sanitize,
)



class BuildExt(BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)):
    """build_ext that also writes the build record the loader compares with the running torch: into
    the build tree (so every wheel carries it) and, for an in-place or editable build, into the
    source tree beside the .so. Only a build writes it: sdist and egg_info leave it alone."""

    def run(self):
        super().run()
        folders = [os.path.join(self.build_lib, "ckpt_offload")]
        if self.inplace:
            folders.append(self.get_finalized_command("build_py").get_package_dir("ckpt_offload"))
        for folder in folders:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "_build_info.py"), "w") as f:
                f.write("# Written by setup.py at build time; compared with the running torch on import.\n")
                f.write(f"TORCH_VERSION = {torch.__version__!r}\n")
                f.write(f"WITH_CUDA = {with_cuda!r}\n")
                f.write(f"CUDA_VERSION = {'.'.join(map(str, cuda_version)) if cuda_version else None!r}\n")
                f.write(f"CUDA_HOME = {toolkit!r}\n")


print(f"ckpt_offload setup: torch {torch.__version__}, CUDA build: {with_cuda}" + (f" (toolkit {toolkit})" if with_cuda else ""))

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
