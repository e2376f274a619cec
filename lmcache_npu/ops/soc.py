"""The Ascend SoC families the transfer kernel targets and their rules the kernel cannot express: one table for the
device backend (`npu_backend`, reading the SoC from ACL) and the emulator (`emu_backend`, told which to model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..platform.npu_smi import soc_family
from .plan import UB_BLOCK_BYTES, PageLayout, TransferPlan


@dataclass(frozen=True)
class SocSpec:
    """What the host launcher reads from the platform on a real device."""

    name: str
    ub_bytes: int
    vector_cores: int
    has_datacopy_pad: bool
    has_bf16: bool


SOCS = {
    "a2": SocSpec("a2", 196608, 48, True, True),  # Ascend910B1/B2: 24 AI cores x 2 AIV
    "a3": SocSpec("a3", 196608, 48, True, True),  # Ascend910_93xx
    "310p": SocSpec("310p", 262144, 8, False, False),  # Ascend310P3: 8 AI cores
}


def check_soc_rules(plan: TransferPlan, soc: SocSpec) -> None:
    """Rules of the target SoC that the kernel cannot express, raised before launch."""
    for plane in plan.moved_planes:
        where = f"plane {plane.label} (group {plane.group})"
        if not soc.has_bf16 and plane.dtype == torch.bfloat16:
            raise ValueError(f"{where}: {soc.name} has no bf16")
        if plane.layout == PageLayout.ND and not soc.has_datacopy_pad and plane.row_bytes % UB_BLOCK_BYTES:
            raise ValueError(
                f"{where}: row_bytes {plane.row_bytes} is not a multiple of 32 B; {soc.name} has no DataCopyPad, so "
                "ND rows must be whole 32 B units"
            )


# The AscendC arch CANN compiles the kernel for, per family: A2 and A3 share one binary (c220); CANN's generated
# launcher registers no kernel on a SoC of another arch, and every launch then fails with a bare error code.
KERNEL_ARCH = {"a2": "c220", "a3": "c220", "310p": "m200"}


def _family(name: str, what: str) -> str:
    """The family of a SoC the kernel is built for, or a ValueError naming the SoC and the rule."""
    family = soc_family(name)
    if family == "a5":
        raise ValueError(f"{what} {name} is an Atlas A5 (ascend950, arch c310): the transfer kernel has not been built "
                         "or proven for it yet; lmcache-npu supports A2/A3 (Ascend910B*, Ascend910_93*) and 310P")
    if family not in KERNEL_ARCH:
        raise ValueError(f"{what} {name!r} is not a SoC the transfer kernel is built for: A2/A3 (Ascend910B*, "
                         "Ascend910_93*) or 310P (Ascend310P*)")
    return family


def soc_from_name(name: str, ub_bytes: int, vector_cores: int) -> SocSpec:
    """The kernel's rules for a SoC name as ACL reports it (Ascend910B1, Ascend910_9391, Ascend310P3); a ValueError
    for a family the kernel is not built for (A5 included)."""
    family = _family(name, "SoC")
    base = SOCS[family]
    return SocSpec(family, ub_bytes, vector_cores, base.has_datacopy_pad, base.has_bf16)


def check_built_soc(built_soc: Optional[str], running_soc: str) -> None:
    """Refuses a kernel library built for another arch than the running SoC's, naming both (an empty `built_soc`
    is a build that did not record it: nothing to compare)."""
    if not built_soc:
        return
    built_arch = KERNEL_ARCH[_family(built_soc, "the kernel library's SOC_VERSION")]
    running_arch = KERNEL_ARCH[_family(running_soc, "SoC")]
    if built_arch != running_arch:
        raise ValueError(f"lmcache_npu._npu was built for SOC_VERSION {built_soc} ({built_arch}) but this NPU is "
                         f"{running_soc} ({running_arch}): CANN would register no kernel and every launch would "
                         "fail; rebuild with SOC_VERSION set to this card's SoC (docs/npu_build.md)")
