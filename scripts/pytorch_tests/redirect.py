"""pytest plugin: runs PyTorch's own checkpoint tests with ckpt_offload's checkpoint substituted.

PT_REDIRECT=plain     nothing is patched: torch's own checkpoint (the baseline).
PT_REDIRECT=redirect  before the test modules import it, torch.utils.checkpoint.checkpoint becomes
                      a wrapper that sends each call made with use_reentrant=False to
                      ckpt_offload.checkpoint(..., offload=True), and every other call to torch's.
ckpt_offload calls torch's checkpoint itself; those calls always reach torch's, so nothing recurses.
PT_REDIRECT_STATS=path writes how many calls went each way, per test, as JSON.

Loaded with `-p redirect` (run.sh puts this folder on the path).
"""
import functools
import json
import os
import sys

os.environ.setdefault("CKPT_OFFLOAD_TEST_CPU", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.utils.checkpoint as _tuc  # noqa: E402

MODE = os.environ.get("PT_REDIRECT", "plain")
if MODE not in ("plain", "redirect"):
    raise SystemExit(f"PT_REDIRECT must be plain or redirect, got {MODE!r}")
_STATS = {"redirected": 0, "passed_through": 0}
_PER_TEST: dict = {}
_current = [None]

if MODE == "redirect":
    import ckpt_offload  # noqa: E402

    _torch_checkpoint = _tuc.checkpoint
    _ours = ckpt_offload.checkpoint

    @functools.wraps(_torch_checkpoint)
    def _redirected(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if kwargs.get("use_reentrant", None) is False and not caller.startswith("ckpt_offload"):
            _STATS["redirected"] += 1
            if _current[0] is not None:
                _PER_TEST[_current[0]] = _PER_TEST.get(_current[0], 0) + 1
            kwargs.pop("use_reentrant")
            return _ours(*args, offload=True, use_reentrant=False, **kwargs)
        _STATS["passed_through"] += 1
        return _torch_checkpoint(*args, **kwargs)

    _tuc.checkpoint = _redirected  # checkpoint_sequential looks the module global up: redirected too


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current[0] = item.nodeid
    yield
    _current[0] = None


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("PT_REDIRECT_STATS")
    if out:
        with open(out, "w") as f:
            json.dump({"mode": MODE, "stats": _STATS, "per_test_redirected": _PER_TEST}, f, indent=1)
