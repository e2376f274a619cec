"""Every emulator rule has a deliberately broken kernel that trips it (and clean controls that do not)."""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).with_name("broken_kernels.cpp")
EMU_HEADERS = [ROOT / "csrc/ascendc/emu/ascendc_emu.h", ROOT / "csrc/ascendc/emu/emu_runtime.h"]


@pytest.fixture(scope="session")
def harness(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH to build the broken kernels")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [SOURCE, *EMU_HEADERS])).hexdigest()[:16]
    lib = tmp_path_factory.mktemp("emu_rules") / f"broken_kernels_{digest}.so"
    cmd = [compiler, "-std=c++17", "-O1", "-g", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
           f"-I{ROOT / 'csrc/ascendc'}", str(SOURCE), "-o", str(lib)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    dll = ctypes.CDLL(str(lib))
    dll.run_case.restype = ctypes.c_int
    dll.run_case.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_char_p,
                             ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    return dll


def run(dll: ctypes.CDLL, case: str, target: str = "a2", cores: int = 1, order: str = "sequential") -> tuple[int, str, str]:
    rule, message = ctypes.create_string_buffer(64), ctypes.create_string_buffer(2048)
    rc = dll.run_case(case.encode(), target.encode(), cores, order.encode(), rule, 64, message, 2048)
    assert rc != 2, message.value.decode()
    return rc, rule.value.decode(), message.value.decode()


# (case, target, cores, rule it must trip)
BROKEN = [
    ("datacopy_not_32", "a2", 1, "datacopy-len"),
    ("datacopy_block_count_zero", "a2", 1, "datacopy-params"),
    ("pad_block_count", "a2", 1, "datacopypad-limits"),
    ("pad_block_len", "a2", 1, "datacopypad-limits"),
    ("pad_on_soc", "310p", 1, "datacopypad-unsupported"),
    ("ub_overflow", "a2", 1, "ub-capacity"),
    ("ub_misaligned", "a2", 1, "ub-align"),
    ("queue_depth", "a2", 1, "queue-depth"),
    ("queue_too_many_buffers", "a2", 1, "queue-buffers"),
    ("queue_exhausted", "a2", 1, "queue-buffers"),
    ("use_after_free", "a2", 1, "use-after-free"),
    ("missing_enque_sync", "a2", 1, "unordered-ub-access"),
    ("missing_free_sync", "310p", 1, "unordered-ub-access"),
    ("uninitialised_read", "a2", 1, "uninitialised-ub-read"),
    ("gm_out_of_bounds", "a2", 1, "gm-bounds"),
    ("gm_tensor_bounds", "a2", 1, "gm-tensor-bounds"),
    ("gm_guard_overwrite", "a2", 2, "gm-guard"),
    ("gm_read_only", "a2", 1, "gm-read-only"),
    ("cross_core_write", "a2", 4, "cross-core-write"),
    ("wait_without_set", "a2", 1, "event"),
    ("set_twice", "a2", 1, "event"),
    ("fetched_twice", "a2", 1, "event"),
    ("set_never_waited", "a2", 1, "event"),
    ("two_pipes", "a2", 1, "tpipe"),
    ("datacopy_block_len_zero", "a2", 1, "datacopy-params"),
    ("datacopy_block_count_4096", "a2", 1, "datacopy-params"),
    ("pad_padding_too_wide", "a2", 1, "datacopypad-limits"),
    ("pad_block_len_not_elements", "a2", 1, "datacopypad-limits"),
    ("ub_slice_past_end", "a2", 1, "ub-bounds"),
    ("ub_dma_past_end", "a2", 1, "ub-bounds"),
    ("ub_scalar_past_end", "a2", 1, "ub-bounds"),
    ("ub_get_with_offset_misaligned", "a2", 1, "ub-align"),
    ("duplicate_misaligned", "a2", 1, "ub-align"),
    ("queue_deque_empty", "a2", 1, "queue-state"),
    ("queue_free_while_queued", "a2", 1, "queue-state"),
    ("queue_still_queued_at_end", "a2", 1, "queue-state"),
    ("missing_s_mte3", "a2", 1, "unordered-ub-access"),
    ("missing_v_mte3", "a2", 1, "unordered-ub-access"),
    ("missing_mte2_s", "a2", 1, "unordered-ub-access"),
    ("cross_core_setvalue_same_line", "a2", 2, "cross-core-write"),
    ("pipe_too_many_buffers", "a2", 1, "queue-buffers"),
    ("gm_mte3_write_after_write", "a2", 1, "gm-hazard"),
    ("gm_mte3_then_mte2", "a2", 1, "gm-hazard"),
    ("cross_core_read", "a2", 2, "cross-core-read"),
    ("ub_rewrite_after_free", "a2", 1, "unordered-ub-access"),
    ("manual_sync_vector_after_vector", "a2", 1, "unordered-ub-access"),
]

# The clean twin of a broken kernel above: the same code with the ordering it lacked.
CONTROLS = [("ordered_s_mte3", 1), ("ordered_v_mte3", 1), ("ordered_mte2_s", 1), ("cross_core_setvalue_own_lines", 2),
            ("ordered_gm_mte3_write_after_write", 1), ("ordered_gm_mte3_then_mte2", 1),
            ("ordered_ub_rewrite_after_free", 1), ("manual_sync_ordered_vector_after_vector", 1)]


@pytest.mark.parametrize("case,target,cores,rule", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_kernel_trips_its_rule(harness: ctypes.CDLL, case: str, target: str, cores: int, rule: str) -> None:
    rc, got_rule, message = run(harness, case, target, cores)
    assert rc == 1, f"{case} ran clean but must trip {rule}"
    assert got_rule == rule, message
    # The message names the core, the API and the caller's file:line.
    assert "[EMU]" in message and "broken_kernels.cpp:" in message or got_rule == "gm-guard"
    if got_rule not in ("cross-core-write", "cross-core-read", "gm-guard"):
        assert f"core 0/{cores}" in message


def test_rule_messages_name_the_line(harness: ctypes.CDLL) -> None:
    line = next(i for i, text in enumerate(SOURCE.read_text().splitlines(), 1) if "48);  // 48 B" in text)
    _, _, message = run(harness, "datacopy_not_32")
    assert f"broken_kernels.cpp:{line}" in message and "DataCopy(GM->UB)" in message


def test_cross_core_message_names_both_cores(harness: ctypes.CDLL) -> None:
    _, _, message = run(harness, "cross_core_write", cores=4)
    assert "cores 0" in message and "both write GM" in message


@pytest.mark.parametrize("order", ["sequential", "reverse", "shuffled"])
@pytest.mark.parametrize("target", ["a2", "a3"])
def test_correct_depth2_copy_is_clean(harness: ctypes.CDLL, target: str, order: str) -> None:
    rc, rule, message = run(harness, "correct_copy", target, cores=4, order=order)
    assert rc == 0, message


@pytest.mark.parametrize("target", ["a2", "310p"])
def test_correct_manual_flags_are_clean(harness: ctypes.CDLL, target: str) -> None:
    rc, rule, message = run(harness, "correct_manual_flags", target, cores=2)
    assert rc == 0, message


def test_two_allocated_event_ids_can_both_be_in_flight(harness: ctypes.CDLL) -> None:
    """The control of `fetched_twice`: AllocEventID reserves, so the second id differs and nothing collides."""
    rc, rule, message = run(harness, "allocated_twice", "a2")
    assert rc == 0, message


def test_datacopypad_is_fine_on_a2(harness: ctypes.CDLL) -> None:
    rc, rule, message = run(harness, "pad_on_soc", "a2")
    assert rc == 0, message


@pytest.mark.parametrize("case,cores", CONTROLS, ids=[c[0] for c in CONTROLS])
def test_the_ordered_twin_is_clean(harness: ctypes.CDLL, case: str, cores: int) -> None:
    rc, rule, message = run(harness, case, "a2", cores=cores)
    assert rc == 0, f"{case} tripped {rule}: {message}"
