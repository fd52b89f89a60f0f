"""What the NVIDIA driver and a GPU's PCIe link are, read from /proc and /sys or, where those say
nothing, from NVML (libnvidia-ml, through ctypes). None where neither tells. For the env report.

Standard library only: it must run where torch or the compiled core does not load.
"""
import ctypes
import os
import re

_DRIVER_VERSION = "/proc/driver/nvidia/version"
_PCI_DEVICES = "/sys/bus/pci/devices"
# Tests point these at a stand-in tree.

# PCIe generation by transfer rate (GT/s), and what one lane carries per direction after line
# coding (GB/s): 8b/10b up to gen 2, 128b/130b for gen 3 to 5, FLIT (1b/1b, FEC aside) for gen 6.
_GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
_LANE_GB_PER_S = {1: 0.25, 2: 0.5, 3: 8 * 128 / 130 / 8, 4: 16 * 128 / 130 / 8, 5: 32 * 128 / 130 / 8, 6: 64 / 8}


def nominal_gb_per_s(gen, width):
    """The link's nominal rate per direction in GB/s (10^9 bytes), or None when gen or width is unknown."""
    if gen not in _LANE_GB_PER_S or not width:
        return None
    return round(_LANE_GB_PER_S[gen] * width, 2)


def driver_version():
    """The kernel driver's version ("580.95.05"), from /proc/driver/nvidia/version or NVML; None without one."""
    try:
        with open(_DRIVER_VERSION) as f:
            m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", f.read())
        if m:
            return m.group(1)
    except OSError:
        pass
    return _nvml(lambda lib, _: _nvml_string(lib.nvmlSystemGetDriverVersion))


def pci_address(domain: int, bus: int, device: int) -> str:
    """The sysfs name of a device's function 0, as CUDA numbers it (`pci_domain_id`, `pci_bus_id`,
    `pci_device_id` of torch's device properties): "0000:3b:00.0"."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _gen(speed):
    """The PCIe generation of a sysfs link speed ("16.0 GT/s PCIe", "8 GT/s"), or None."""
    m = re.match(r"([\d.]+)\s*GT/s", speed or "")
    return _GEN_BY_GTS.get(float(m.group(1))) if m else None


def _width(text):
    return int(text) if text and text.isdigit() and int(text) > 0 else None


def pcie_link(address: str) -> dict:
    """A device's PCIe link: `gen` and `width` now (a GPU at rest may train its link down), `max_gen`
    and `max_width`, `nominal_gb_per_s` (of the link now, per direction) and `source` ("sysfs",
    "nvml" or None when neither tells). Values are None where unknown."""
    folder = os.path.join(_PCI_DEVICES, address)
    link = {
        "gen": _gen(_read(os.path.join(folder, "current_link_speed"))),
        "width": _width(_read(os.path.join(folder, "current_link_width"))),
        "max_gen": _gen(_read(os.path.join(folder, "max_link_speed"))),
        "max_width": _width(_read(os.path.join(folder, "max_link_width"))),
        "source": "sysfs",
    }
    if link["gen"] is None or link["width"] is None:
        from_nvml = _nvml(lambda lib, nvml_int: _nvml_link(lib, nvml_int, address))
        link = from_nvml if from_nvml else {k: None for k in link}
    link["nominal_gb_per_s"] = nominal_gb_per_s(link["gen"], link["width"])
    return link


# -- NVML through ctypes: only the few calls above, each checked -----------------------------------
def _nvml(query):
    """query(lib, nvml_int) between nvmlInit and nvmlShutdown; None when NVML is missing or fails."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if lib.nvmlInit_v2() != 0:
        return None

    def nvml_int(fn, *args):
        value = ctypes.c_uint()
        return value.value if fn(*args, ctypes.byref(value)) == 0 else None

    try:
        return query(lib, nvml_int)
    except (AttributeError, OSError, ValueError):
        return None
    finally:
        lib.nvmlShutdown()


def _nvml_string(fn, *args):
    buf = ctypes.create_string_buffer(96)
    return buf.value.decode() if fn(*args, buf, ctypes.c_uint(len(buf))) == 0 else None


def _nvml_link(lib, nvml_int, address):
    handle = ctypes.c_void_p()
    if lib.nvmlDeviceGetHandleByPciBusId_v2(address.encode(), ctypes.byref(handle)) != 0:
        return None
    return {
        "gen": nvml_int(lib.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        "width": nvml_int(lib.nvmlDeviceGetCurrPcieLinkWidth, handle),
        "max_gen": nvml_int(lib.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        "max_width": nvml_int(lib.nvmlDeviceGetMaxPcieLinkWidth, handle),
        "source": "nvml",
    }
