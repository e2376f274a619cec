"""What `npu-smi` says about an Ascend card, reduced to the SoC name CANN's CMake and `SOC_VERSION` accept.

One rule in one place for `setup.py` (which loads this file by path, before the package or torch can be imported:
stdlib only, no relative imports), `doctor` and the host facts of `ascend_host`.

The rule is vllm-ascend's (`v0.23.0:setup.py`, `get_chip_type`) and LMCache-Ascend's (`setup.py`, `_get_npu_soc`),
spelled the way CANN names its platform files (`<soc>.ini`: `Ascend910B1`, `Ascend910_9392`):

* A2 and 310P print `Chip Type : Ascend` and `Chip Name : 910B1` / `310P3`: the SoC is `Ascend910B1` / `Ascend310P3`;
* A3 prints no Chip Type, `Chip Name : Ascend910` and `NPU Name : 9392`: the SoC is `Ascend910_9392` (the chip name
  alone, `Ascend910`, is refused by CANN's CMake: finding R2);
* A5 (Ascend 950) prints `Chip Name` and `NPU Name` in the board query without `-c` (which it does not accept):
  `Ascend950PR` + `9599` gives `Ascend950PR_9599` (vllm-ascend's images use `ascend950dt_9582`);
* A2G3 boards of the CH edition of the driver print `A2G3`: vllm-ascend builds them as `ascend910b1`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from typing import Callable, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

Runner = Callable[[Sequence[str]], Optional[str]]  # a command's stdout, or None when it cannot run or fails
NPU_SMI = "npu-smi"
FAMILIES = ("a2", "a3", "310p", "a5")


def run_command(command: Sequence[str], timeout: float = 10.0) -> Optional[str]:
    """stdout of `command`, or None when it is not installed, fails or hangs (npu-smi can block on a busy driver)."""
    if shutil.which(command[0]) is None:
        return None
    try:
        out = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.info("%s did not run: %s", " ".join(command), exc)
        return None
    return out.stdout if out.returncode == 0 else None


def parse_fields(text: str) -> dict[str, str]:
    """`Key : value` lines of npu-smi's list output; the first occurrence of a key wins (a later MCU block of a
    multi-chip report must not override the NPU chip's name)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key, value = " ".join(key.split()), value.strip()
        if sep and key and key not in fields:
            fields[key] = value
    return fields


def _present(value: Optional[str]) -> Optional[str]:
    """npu-smi prints NA (or nothing) for a field it cannot read in a container."""
    if value is None:
        return None
    value = "".join(value.split())
    return value if value and value.upper() not in ("NA", "N/A", "-") else None


def _base_name(chip_name: str) -> str:
    """`Ascend910`, `Ascend 910B4` (the `-m` table) and `910B1` all name the chip without the `Ascend` prefix."""
    name = "".join(chip_name.split())
    return name[len("ascend"):] if name.lower().startswith("ascend") else name


def soc_from_fields(chip_name: Optional[str], npu_name: Optional[str] = None,
                    chip_type: Optional[str] = None) -> Optional[str]:
    """The SoC from npu-smi's three fields, or None when they do not name an NPU chip CANN can build for."""
    chip_name, npu_name, chip_type = _present(chip_name), _present(npu_name), _present(chip_type)
    if chip_name is None or chip_name.lower() == "mcu" or (chip_type or "").lower() == "mcu":
        return None  # the board's management MCU is chip 1 (or 2) of a card, never a build target
    base = _base_name(chip_name)
    if "a2g3" in base.lower():
        return "Ascend910B1"  # vllm-ascend v0.23.0 builds the CH edition's A2G3 as ascend910b1
    if not re.match(r"^\d{3}", base):
        return None  # a placeholder such as the manuals' "xxx"
    if base == "910" or base.startswith("950"):  # A3 and A5: chip name + "_" + NPU name
        if npu_name is None:
            logger.info("npu-smi names chip %r without an NPU Name: not a SoC CANN accepts", chip_name)
            return None  # "Ascend910" alone is what CANN's CMake refuses (R2)
        return f"Ascend{base}_{npu_name}"
    return f"Ascend{base}"  # A2, 310P (and the older 910A, 310B): Chip Type + Chip Name


def soc_from_board_info(text: str) -> Optional[str]:
    """The SoC from `npu-smi info -t board -i <id> [-c <chip>]` output, or None when it names none."""
    fields = parse_fields(text or "")
    return soc_from_fields(fields.get("Chip Name"), fields.get("NPU Name"), fields.get("Chip Type"))


def npu_ids(list_text: Optional[str]) -> list[int]:
    """The NPU IDs `npu-smi info -l` lists (a container that maps /dev/davinci3 alone may have no NPU 0)."""
    return [int(m) for m in re.findall(r"^\s*NPU ID\s*:\s*(\d+)\s*$", list_text or "", re.MULTILINE)]


def run_board_info(npu_smi: str = NPU_SMI, device: int = 0, chip: int = 0,
                   run: Runner = run_command) -> Optional[str]:
    """The board report of one chip that names it: `-t board -i <device> -c <chip>` (A2, A3, 310P), else the query
    without `-c` (A5 prints its Chip Name there and does not accept `-c`). None when neither names a chip."""
    with_chip = run([npu_smi, "info", "-t", "board", "-i", str(device), "-c", str(chip)])
    if with_chip and "Chip Name" in with_chip:
        return with_chip
    without_chip = run([npu_smi, "info", "-t", "board", "-i", str(device)])
    return without_chip if without_chip and "Chip Name" in without_chip else None


def detected_soc(npu_smi: str = NPU_SMI, run: Runner = run_command) -> Optional[str]:
    """The SoC npu-smi reports for the first NPU that names one (None without npu-smi or a card)."""
    for device in npu_ids(run([npu_smi, "info", "-l"])) or [0]:
        soc = soc_from_board_info(run_board_info(npu_smi, device, 0, run) or "")
        if soc:
            return soc
    return None


def soc_version(environ: Optional[Mapping[str, str]] = None, npu_smi: str = NPU_SMI,
                run: Runner = run_command) -> Optional[str]:
    """What to build for: $SOC_VERSION when set (an explicit choice, and the only source in a driverless
    `docker build`), else what npu-smi reports."""
    env = os.environ if environ is None else environ
    explicit = env.get("SOC_VERSION", "").strip()
    return explicit or detected_soc(npu_smi, run)


def soc_family(soc: Optional[str]) -> Optional[str]:
    """"a2", "a3", "310p" or "a5" for a SoC name in any spelling (Ascend910B1, ascend910_9391, 310P3, a3), else None
    (the 910A training chip, 310B edge modules and names no family of this plugin covers)."""
    if not soc:
        return None
    name = _base_name(soc).lower()
    if name in FAMILIES:
        return name
    if name.startswith("310p"):
        return "310p"
    if name.startswith("910b") or "a2g3" in name:
        return "a2"
    if name.startswith("910_93") or name.startswith("910c"):
        return "a3"  # vllm-ascend maps ascend910_93xx and "910c" to A3
    if name.startswith("950"):
        return "a5"
    return None


def driver_version_from_table(text: Optional[str]) -> Optional[str]:
    """The driver version in the header of the `npu-smi info` table (`| npu-smi 25.0.rc1.1   Version: 25.0.rc1.1 |`:
    the second field is the driver's version, per the npu-smi manual)."""
    match = re.search(r"npu-smi\s+\S+\s+Version:\s*([0-9][\w.\-]*)", text or "")
    return match.group(1) if match else None


def soc_from_table(text: Optional[str]) -> Optional[str]:
    """The SoC from the first NPU row of the `npu-smi info` table (`| 0     910B3   | OK ...`): a fallback when the
    board query is refused. The table has no NPU Name, so an A3 row (`Ascend910`) gives None."""
    for line in (text or "").splitlines():
        match = re.match(r"^\|\s*\d+\s+([A-Za-z0-9][\w\- ]*?)\s*\|\s*(OK|Warning|Alarm|Critical|0K)\b", line)
        if match:
            return soc_from_fields(match.group(1), None, "Ascend")
    return None
