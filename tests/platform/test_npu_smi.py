"""npu-smi's reports -> the SoC CANN builds for, on recorded reports of every family (tests/platform/data says where
each comes from), the runner's fallbacks with a fake npu-smi, and setup.py's soc_version() through the same file."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path
from typing import Optional, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.platform import npu_smi
from lmcache_npu.platform.npu_smi import (
    detected_soc,
    driver_version_from_table,
    npu_ids,
    parse_fields,
    run_board_info,
    soc_family,
    soc_from_board_info,
    soc_from_fields,
    soc_from_table,
    soc_version,
)

from .recorded import load

REPO = Path(__file__).resolve().parents[2]

BOARDS = [  # file, SoC, family
    ("board_a2_910b4.txt", "Ascend910B4", "a2"),
    ("board_a2_910b1.txt", "Ascend910B1", "a2"),
    ("board_a3_9392.txt", "Ascend910_9392", "a3"),
    ("board_310p3.txt", "Ascend310P3", "310p"),
    ("board_a5_950pr.txt", "Ascend950PR_9599", "a5"),
    ("board_910a.txt", "Ascend910A", None),  # a real chip, no family of this plugin
    ("board_310b1.txt", "Ascend310B1", None),
    ("board_mcu.txt", None, None),  # the card's MCU is never the SoC
    ("board_a2_without_chip.txt", None, None),  # the NPU's board, which names no chip
]


@pytest.mark.parametrize("name,soc,family", BOARDS)
def test_recorded_board_reports(name: str, soc: Optional[str], family: Optional[str]) -> None:
    assert soc_from_board_info(load(name)) == soc
    assert soc_family(soc) == family


def test_a3_is_never_the_chip_name_alone() -> None:
    """Finding R2: the old setup.py returned "Ascend910" on A3, which CANN's CMake refuses."""
    a3 = load("board_a3_9392.txt")
    assert soc_from_board_info(a3) == "Ascend910_9392"
    without_npu_name = "\n".join(line for line in a3.splitlines() if "NPU Name" not in line)
    assert soc_from_board_info(without_npu_name) is None  # the control: nothing rather than a name CANN refuses


@pytest.mark.parametrize("fields,soc", [
    (("910B3", None, "Ascend"), "Ascend910B3"),
    (("Ascend910", "9391", None), "Ascend910_9391"),
    (("Ascend 910B4", None, None), "Ascend910B4"),  # the `npu-smi info -m` spelling
    (("A2G3", None, "Ascend"), "Ascend910B1"),  # vllm-ascend v0.23.0: the CH edition's A2G3 builds as ascend910b1
    (("Ascend950DT", "9582", None), "Ascend950DT_9582"),
    (("Ascend950PR", None, None), None),  # A5 without its NPU name
    (("xxx", None, "Ascend"), None),  # the manuals' placeholder
    (("NA", "9392", None), None), (("", None, None), None), ((None, None, None), None),
])
def test_fields_to_soc(fields: tuple, soc: Optional[str]) -> None:
    assert soc_from_fields(*fields) == soc


@pytest.mark.parametrize("soc,family", [
    ("Ascend910B1", "a2"), ("ascend910b1", "a2"), ("ASCEND910B2C", "a2"), ("910B4", "a2"), ("ascend910b4-1", "a2"),
    ("Ascend910_9391", "a3"), ("ascend910_9392", "a3"), ("ascend910_9362", "a3"), ("910c", "a3"),
    ("Ascend310P3", "310p"), ("ascend310p1", "310p"), ("310P3", "310p"), ("ascend310p3vir02", "310p"),
    ("ascend950dt_9582", "a5"), ("Ascend950PR_9599", "a5"),
    ("a2", "a2"), ("a3", "a3"), ("310p", "310p"), ("a5", "a5"),  # the backend's own family names
    ("Ascend910", None), ("Ascend910A", None), ("Ascend310B1", None), ("Ascend310", None), ("", None), (None, None),
])
def test_soc_family(soc: Optional[str], family: Optional[str]) -> None:
    assert soc_family(soc) == family


PADDING = st.text(alphabet=" \t", max_size=12)


@settings(max_examples=100, deadline=None)
@given(lead=PADDING, gap=PADDING, tail=PADDING, noise=st.lists(st.sampled_from(
    ["NPU ID : 0", "Chip ID : 0", "Board ID : 0x02", "PCIe Bus Info : 0000:61:00.0", "VDie ID : 42C711D4 20B03704",
     "", "Chip Count : 1"]), max_size=6), case=st.sampled_from([
         (("Ascend", "910B1", None), "Ascend910B1"), ((None, "Ascend910", "9392"), "Ascend910_9392"),
         (("Ascend", "310P3", None), "Ascend310P3"), ((None, "Ascend950PR", "9599"), "Ascend950PR_9599")]))
def test_any_spacing_and_any_other_fields_give_the_same_soc(lead, gap, tail, noise, case) -> None:
    (chip_type, chip_name, npu_name), soc = case
    lines = [f"{lead}{key}{gap}:{tail}{value}{tail}" for key, value in
             (("Chip Type", chip_type), ("Chip Name", chip_name), ("NPU Name", npu_name)) if value is not None]
    assert soc_from_board_info("\n".join(noise + lines + noise)) == soc


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=400))
def test_arbitrary_text_never_raises(text: str) -> None:
    parse_fields(text)
    soc = soc_from_board_info(text)
    assert soc is None or soc.startswith("Ascend")
    soc_family(text)
    soc_from_table(text)
    driver_version_from_table(text)


def test_the_first_occurrence_of_a_field_wins() -> None:
    report = load("board_a2_910b4.txt") + load("board_mcu.txt")  # an NPU block, then its MCU's
    assert soc_from_board_info(report) == "Ascend910B4"


@pytest.mark.parametrize("name,driver,soc", [
    ("smi_table_a3.txt", "26.0.rc2", None),  # the table has no NPU Name: A3 stays unknown
    ("smi_table_310p3.txt", "25.2.0", "Ascend310P3"),
    ("smi_table_310p3_pasted.txt", "25.0.rc1.1", "Ascend310P3"),
])
def test_recorded_tables(name: str, driver: str, soc: Optional[str]) -> None:
    table = load(name)
    assert driver_version_from_table(table) == driver
    assert soc_from_table(table) == soc
    assert soc_from_board_info(table) is None  # a table is not a board report


def test_npu_ids_from_the_list() -> None:
    assert npu_ids(load("npu_smi_list.txt")) == [0, 1, 2]
    assert npu_ids("") == [] and npu_ids(None) == []


class FakeSmi:
    """npu-smi as a table of command lines -> stdout (None: the command fails)."""

    def __init__(self, answers: dict[str, Optional[str]]) -> None:
        self.answers, self.calls = answers, []

    def __call__(self, command: Sequence[str]) -> Optional[str]:
        line = " ".join(command[1:])
        self.calls.append(line)
        return self.answers.get(line)


def test_board_info_with_the_chip_first() -> None:
    smi = FakeSmi({"info -t board -i 0 -c 0": load("board_a2_910b1.txt")})
    assert soc_from_board_info(run_board_info(device=0, run=smi)) == "Ascend910B1"
    assert smi.calls == ["info -t board -i 0 -c 0"]


def test_board_info_falls_back_to_the_query_without_chip_on_a5() -> None:
    smi = FakeSmi({"info -t board -i 0 -c 0": None, "info -t board -i 0": load("board_a5_950pr.txt")})
    assert soc_from_board_info(run_board_info(device=0, run=smi)) == "Ascend950PR_9599"


def test_board_info_names_nothing_when_no_query_names_a_chip() -> None:
    smi = FakeSmi({"info -t board -i 0 -c 0": None, "info -t board -i 0": load("board_a2_without_chip.txt")})
    assert run_board_info(device=0, run=smi) is None


def test_detected_soc_walks_the_listed_npus() -> None:
    smi = FakeSmi({"info -l": load("npu_smi_list.txt"), "info -t board -i 0 -c 0": load("board_mcu.txt"),
                   "info -t board -i 1 -c 0": load("board_a3_9392.txt")})
    assert detected_soc(run=smi) == "Ascend910_9392"
    assert detected_soc(run=FakeSmi({})) is None  # no npu-smi at all


def test_soc_version_prefers_an_explicit_soc_version() -> None:
    smi = FakeSmi({"info -t board -i 0 -c 0": load("board_a2_910b4.txt")})
    assert soc_version({"SOC_VERSION": "ascend910_9391"}, run=smi) == "ascend910_9391" and smi.calls == []
    assert soc_version({"SOC_VERSION": " "}, run=smi) == "Ascend910B4"
    assert soc_version({}, run=FakeSmi({})) is None


def test_the_module_is_stdlib_only_and_has_no_relative_imports() -> None:
    """setup.py loads it by path before the package (or torch) can be imported."""
    tree = ast.parse(Path(npu_smi.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.module and node.level == 0}
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree))
    assert imported <= {"__future__", "logging", "os", "re", "shutil", "subprocess", "typing"}, imported


def _setup_soc_version():
    """setup.py's soc_version(), taken out of setup.py (which runs setup() when imported)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "soc_version")
    namespace: dict = {"ROOT": REPO}
    exec(compile(ast.Module([function], []), "setup.py", "exec"), namespace)
    return namespace["soc_version"]


def _fake_npu_smi(directory: Path, board: str) -> None:
    """An npu-smi on PATH that answers `info -l` and the board query of NPU 0 chip 0 and fails otherwise."""
    (directory / "board.txt").write_text(load(board))
    (directory / "list.txt").write_text(load("npu_smi_list.txt"))
    script = directory / "npu-smi"
    script.write_text(f"#!/bin/sh\ncase \"$*\" in\n  'info -l') cat '{directory}/list.txt';;\n"
                      f"  'info -t board -i 0 -c 0') cat '{directory}/board.txt';;\n  *) exit 1;;\nesac\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("board,soc", [("board_a3_9392.txt", "Ascend910_9392"), ("board_a2_910b4.txt", "Ascend910B4"),
                                       ("board_mcu.txt", None)])
def test_setup_py_builds_for_what_npu_smi_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, board: str,
                                                  soc: Optional[str]) -> None:
    _fake_npu_smi(tmp_path, board)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.delenv("SOC_VERSION", raising=False)
    assert _setup_soc_version()() == soc
    monkeypatch.setenv("SOC_VERSION", "ascend910b1")
    assert _setup_soc_version()() == "ascend910b1"  # an explicit choice wins over the card
