"""The Ascend SoC families the transfer kernel targets and their rules the kernel cannot express: one table for the
device backend (`npu_backend`, reading the SoC from ACL) and the emulator (`emu_backend`, told which to model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def soc_from_name(name: str, ub_bytes: int, vector_cores: int) -> SocSpec:
    """The kernel's rules for a SoC name as ACL reports it (Ascend910B1, Ascend910_9391, Ascend310P3)."""
    family = "310p" if "310p" in name.lower() else ("a3" if "910_93" in name.lower() else "a2")
    base = SOCS[family]
    return SocSpec(family, ub_bytes, vector_cores, base.has_datacopy_pad, base.has_bf16)
