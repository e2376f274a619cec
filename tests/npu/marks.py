"""What each NPU test needs, as marks with the reason a reader of `-rs` sees on a machine without it.

The rule (finding T1 of the 2026-11 first-contact audit): a machine without torch_npu, or where torch_npu sees no
card, skips with the reason; a machine whose card torch_npu sees must run the kernels, so `lmcache_npu._npu` being
absent or failing to load there (a missing RUNPATH, a library it needs) fails the test with the import error. The
module is imported, not looked up: `find_spec` finds an `_npu.so` that cannot load.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
from functools import lru_cache
from typing import Any, Callable, Optional

import pytest

RUN, SKIP, FAIL = "run", "skip", "fail"
NPU_MODULE = "lmcache_npu._npu"

NEEDS_TORCH_NPU = pytest.mark.skipif(importlib.util.find_spec("torch_npu") is None,
                                     reason="no torch_npu: the NPU suite needs an Ascend NPU with CANN and torch_npu")
NEEDS_VLLM_ASCEND = pytest.mark.skipif(importlib.util.find_spec("vllm_ascend") is None,
                                       reason="no vllm_ascend: these tests need the vllm-ascend image")


def card_visible() -> bool:
    """Whether this machine has an Ascend card: torch_npu counts one, or, when torch_npu itself does not load, the
    driver's device nodes exist (a broken torch_npu on a card host is a failure to report, not a reason to skip)."""
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        return bool(torch.npu.is_available() and torch.npu.device_count() > 0)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - any failure to ask torch_npu falls back to the device nodes
        return bool(glob.glob("/dev/davinci[0-9]*"))


def npu_module_status(find_spec: Callable[[str], Any], import_module: Callable[[str], Any],
                      card_visible: Callable[[], bool], module: str = NPU_MODULE) -> tuple[str, str]:
    """(verdict, reason): RUN, SKIP (no torch_npu, or no visible card) or FAIL (a card, and `module` is not built or
    does not load: the reason carries the import error)."""
    if find_spec("torch_npu") is None:
        return SKIP, "no torch_npu: the NPU suite needs an Ascend NPU with CANN and torch_npu"
    if not card_visible():
        return SKIP, "torch_npu is installed but no Ascend NPU is visible"
    if find_spec(module) is None:
        return FAIL, (f"an Ascend NPU is visible but {module} is not built: install inside the Ascend image "
                      "(CANN present: ASCEND_HOME_PATH and SOC_VERSION), e.g. bash docker/install.sh")
    try:
        import_module(module)
    except Exception as exc:  # noqa: BLE001 - every way an extension fails to load is the verdict's reason
        return FAIL, f"an Ascend NPU is visible but {module} does not load: {type(exc).__name__}: {exc}"
    return RUN, ""


def import_after_selecting_a_device(module: str) -> Any:
    """Imports `module` with NPU 0 selected first: importing `_npu` runs CANN's kernel-registration constructor, which
    asks ACL for the SoC and aborts the process when no device is set up (finding F11 of the second look)."""
    import torch
    import torch_npu  # noqa: F401  (registers torch.npu)

    torch.npu.set_device(0)  # type: ignore[attr-defined]
    return importlib.import_module(module)


@lru_cache(maxsize=1)
def status() -> tuple[str, str]:
    """This machine's verdict, found once per session (the import of `_npu` happens at most once)."""
    return npu_module_status(importlib.util.find_spec, import_after_selecting_a_device, card_visible)


def enforce(verdict: str, reason: str) -> None:
    """Skip or fail the running test by a verdict."""
    if verdict == SKIP:
        pytest.skip(reason)
    if verdict == FAIL:
        pytest.fail(reason, pytrace=False)


def skip_or_fail(reason: str, visible: Optional[Callable[[], bool]] = None) -> None:
    """For a fixture whose backend is unavailable: skip where no card is visible, fail where one is (a
    `BackendUnavailable` on a card host is a broken install, not a machine without the hardware)."""
    if (visible or card_visible)():
        pytest.fail(f"an Ascend NPU is visible but the npu backend is unavailable: {reason}", pytrace=False)
    pytest.skip(reason)


def select_device(index: int = 0) -> None:
    """Make `npu:<index>` current before the backend's first ACL call (finding R1: aclrtGetSocName may return null
    when no device was set in the process)."""
    import torch
    import torch_npu  # noqa: F401

    torch.npu.set_device(index)  # type: ignore[attr-defined]


# The `npu_module` fixture (tests/npu/conftest.py) applies `status()`: a skip where no card is, a failure where a card
# is and `_npu` does not load.
NEEDS_NPU_MODULE = pytest.mark.usefixtures("npu_module")
NPU_KERNELS = [pytest.mark.npu, NEEDS_TORCH_NPU, NEEDS_NPU_MODULE]
