"""Which backend moves a worker's KV pages: the device's own kernels for "auto", a named one only where it can."""

import pytest
import torch

from lmcache_npu.ops.backend import auto_backend_name, backend_for_device, get_backend


@pytest.mark.parametrize("device_type", ["npu", "cuda"])
def test_auto_picks_the_devices_own_kernels(device_type: str) -> None:
    assert backend_for_device(device_type) == device_type


def test_auto_on_the_host_runs_memcpy() -> None:
    assert backend_for_device("cpu") == "host"  # the CI install builds lmcache_npu._host
    if torch.cuda.is_available():
        pytest.skip("a GPU machine's best backend is cuda")
    assert auto_backend_name() == "host"
    assert get_backend("auto").name == "host"


def test_auto_on_the_host_falls_back_to_the_emulator_then_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    missing: set[str] = set()
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name in missing else real_find_spec(name, *args))
    missing.add("lmcache_npu._host")
    assert backend_for_device("cpu") == "emu"
    missing.add("lmcache_npu._emu")
    assert backend_for_device("cpu") == "torch"


def test_the_emulator_and_torch_stay_available_by_name_on_the_host() -> None:
    assert backend_for_device("cpu", "emu") == "emu"
    assert backend_for_device("cpu", "torch") == "torch"
    assert backend_for_device("cpu", "host") == "host"


@pytest.mark.parametrize("device_type, requested", [("cuda", "emu"), ("npu", "emu"), ("cuda", "host"), ("npu", "host"),
                                                    ("npu", "cuda"), ("cpu", "npu"), ("cpu", "cuda")])
def test_a_backend_that_cannot_reach_the_pages_is_refused_by_name(device_type: str, requested: str) -> None:
    with pytest.raises(ValueError, match=f"backend '{requested}' cannot move {device_type} memory"):
        backend_for_device(device_type, requested)


def test_torch_moves_any_device_and_unknown_names_list_the_choices() -> None:
    assert backend_for_device("cuda", "torch") == "torch"
    with pytest.raises(ValueError, match="unknown transfer backend 'cann'.*torch"):
        backend_for_device("npu", "cann")
    with pytest.raises(ValueError, match="no transfer backend moves xpu memory"):
        backend_for_device("xpu")
