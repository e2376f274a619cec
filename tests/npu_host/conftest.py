"""The fake Ascend device, built once per test session (and cached across sessions under build/npu-fake) against the
real ACL headers of the torch-npu wheel that `make check-npu-build` also uses (fetched once into build/)."""

from __future__ import annotations

from typing import Iterator

import pytest

from build_checks.npu_build.toolchain import ToolchainUnavailable, ensure_toolchain

from .fake_build import build_fake_npu
from .fake_npu import FakeNpu


@pytest.fixture(scope="session")
def fake_device() -> FakeNpu:
    """The process's one fake device (hypothesis tests reset it per example with `fresh()`)."""
    try:
        toolchain = ensure_toolchain()
    except ToolchainUnavailable as error:  # no network: nothing to compile against; say so rather than fail
        pytest.skip(f"the torch-npu wheel (ACL headers) could not be fetched: {error}")
    return FakeNpu(build_fake_npu(toolchain.acl_headers.parent))


@pytest.fixture
def fake_npu(fake_device: FakeNpu) -> Iterator[FakeNpu]:
    """The fake device, reset, with device 0 selected on the test's thread."""
    fake_device.fresh()
    yield fake_device
    fake_device.drain()
