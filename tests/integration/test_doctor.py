"""`lmcache-npu doctor`: every check's verdicts from injected inputs, and the command end to end on this machine
(which has no NPU: it says so, and `--device npu` makes that blocking)."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_npu.tools import doctor
from lmcache_npu.tools.doctor import FAIL, OK, SKIP, WARN
from lmcache_npu.platform.ascend_host import AscendHostFacts
from lmcache_npu.platform.npu_budget import HCCL_SHARE_BUFFER_MB, STAGING_WINDOW_BYTES_DEFAULT, TRANSFER_LANES

from ..platform.recorded import load

GOOD = {"torch": "2.10.0", "vllm": "0.23.0", "vllm-ascend": "0.23.0", "torch_npu": "2.10.0.post4"}
CONFIG = {"kv_connector": "LMCacheNPUConnector", "kv_role": "kv_both",
          "kv_connector_module_path": "lmcache_npu.integration.vllm"}


def verdicts(checks) -> dict[str, str]:
    return {c.name: c.verdict for c in checks}


def test_versions_of_a_supported_ascend_stack_pass() -> None:
    assert set(verdicts(doctor.check_versions(GOOD, "npu")).values()) == {OK}


@pytest.mark.parametrize("change,name", [
    ({"vllm": "0.22.1"}, "vllm"), ({"vllm-ascend": "0.18.0"}, "vllm-ascend"), ({"torch_npu": "2.9.0.post1"}, "torch_npu"),
    ({"vllm-ascend": None}, "vllm-ascend"), ({"torch": None}, "torch"), ({"vllm": None}, "vllm"),
])
def test_each_broken_version_is_blocking_and_named(change: dict, name: str) -> None:
    assert verdicts(doctor.check_versions({**GOOD, **change}, "npu"))[name] == FAIL


def test_an_unreadable_vllm_ascend_version_is_a_mismatch_not_a_crash() -> None:
    assert verdicts(doctor.check_versions({**GOOD, "vllm-ascend": "main"}, "npu"))["vllm-ascend"] == FAIL


def test_ascend_packages_are_not_needed_off_ascend() -> None:
    got = verdicts(doctor.check_versions({"torch": "2.13.0+cpu", "vllm": "0.32.0"}, "cpu"))
    assert got["vllm-ascend"] == SKIP and got["torch_npu"] == SKIP and got["vllm"] == OK


def test_python_range() -> None:
    assert doctor.check_python((3, 11, 7)).verdict == OK
    assert doctor.check_python((3, 9, 1)).verdict == FAIL
    assert doctor.check_python((3, 10, 14)).verdict == FAIL  # StrEnum: the package needs 3.11
    assert doctor.check_python((3, 13, 0)).verdict == WARN


def test_cann_and_soc(tmp_path: Path) -> None:
    (tmp_path / "aarch64-linux").mkdir()
    (tmp_path / "aarch64-linux" / "version.cfg").write_text("version=9.1.0\n")
    board = "Chip Type : Ascend\nChip Name : 910B3\n"
    got = doctor.check_cann({"ASCEND_HOME_PATH": str(tmp_path)}, "npu", lambda: board)
    assert [c.verdict for c in got] == [OK, OK] and "9.1.0" in got[0].detail
    assert "Ascend910B3 (npu-smi)" in got[1].detail
    mcu = doctor.check_cann({"SOC_VERSION": "ascend910b1"}, "npu", lambda: load("board_mcu.txt"))
    assert "ascend910b1 (SOC_VERSION)" in mcu[1].detail  # a report naming no SoC is not credited with one
    missing = doctor.check_cann({"ASCEND_HOME_PATH": str(tmp_path / "no")}, "npu", lambda: None)
    assert [c.verdict for c in missing] == [FAIL, FAIL] or missing[0].detail.startswith("CANN at /usr/local")


@pytest.mark.parametrize("soc,version,verdict", [
    ("310P3", "0.23.0", FAIL), ("ascend310p1", "0.23.0rc1", FAIL), ("310P3", "0.25.1rc1", FAIL),
    ("310P3", "0.20.2rc1", FAIL), ("310P3", None, FAIL),  # every release read refuses; none installed cannot serve
    ("310P3", "0.26.0", WARN), ("310P3", "1.0.0", WARN),  # newer than any release read: unknown
    ("910B3", "0.23.0", OK), ("Ascend910_9392", "0.23.0", OK), ("910B1", None, OK),  # A2 / A3
    ("", "0.23.0", SKIP),
])
def test_310p_kv_transfer_verdicts(soc: str, version, verdict: str) -> None:
    check = doctor.check_310p_kv_transfer(soc, version)
    assert check.verdict == verdict
    if verdict in (FAIL, WARN):  # vllm-ascend's own reason, and what 310P can do instead
        assert doctor.REASON_310P in check.detail and "lmcache-npu bench --soc 310p" in check.fix
        assert "kernels-only" in check.fix
    if verdict == OK:
        assert doctor.REASON_310P not in check.detail and not check.fix


def test_the_soc_for_the_310p_check_comes_from_npu_smi_before_soc_version() -> None:
    assert doctor.soc_name({"SOC_VERSION": "ascend910b1"}, load("board_310p3.txt")) == "Ascend310P3"
    assert doctor.soc_name({"SOC_VERSION": "ascend310p1"}, None) == "ascend310p1"
    assert doctor.soc_name({}, "no chip line here") == ""
    assert doctor.is_310p("310P3") and doctor.is_310p("ascend310p1") and not doctor.is_310p("910B3")


@pytest.mark.parametrize("board,soc", [("board_a3_9392.txt", "Ascend910_9392"), ("board_a2_910b4.txt", "Ascend910B4"),
                                       ("board_a5_950pr.txt", "Ascend950PR_9599")])
def test_the_soc_is_named_by_the_rule_setup_py_builds_with(board: str, soc: str) -> None:
    """One rule (platform/npu_smi.py): on A3 the chip name alone ("Ascend910") would be a SoC CANN refuses."""
    assert doctor.soc_name({}, load(board)) == soc


def test_native_modules() -> None:
    none = doctor.check_native_modules(lambda name: None, "npu")
    assert verdicts(none) == {"module _emu": FAIL, "module _npu": FAIL, "module _cuda": SKIP}
    built = doctor.check_native_modules(lambda name: object(), "cuda")
    assert set(verdicts(built).values()) == {OK}


def test_devices() -> None:
    assert verdicts(doctor.check_devices({"npu": [], "cuda": []}, "cpu")) == {"devices": WARN}
    for name, words in (("host", "memcpy"), ("emu", "emulator"), ("torch", "torch indexing")):
        detail = doctor.check_devices({"npu": [], "cuda": []}, "cpu", cpu_backend=lambda n=name: n)[0].detail
        assert f"'auto' picks the {name} backend" in detail and words in detail, detail
    assert verdicts(doctor.check_devices({"npu": [], "cuda": []}, "npu")) == {"devices": FAIL}
    assert verdicts(doctor.check_devices({"npu": [("Ascend910B3", 60 << 30, 64 << 30)], "cuda": []}, "npu")) == \
        {"npu:0": OK}


def test_locked_memory() -> None:
    infinity = resource.RLIM_INFINITY
    assert doctor.check_memlock(8 << 30, (infinity, infinity), False, True).verdict == OK
    small = doctor.check_memlock(8 << 30, (8 << 20, 8 << 20), False, True)
    assert small.verdict == FAIL and "--ulimit memlock=-1" in small.fix and "--cap-add IPC_LOCK" in small.fix
    assert doctor.check_memlock(8 << 30, (8 << 20, 8 << 20), True, True).verdict == OK  # CAP_IPC_LOCK
    assert doctor.check_memlock(8 << 30, (8 << 20, 8 << 20), False, False).verdict == SKIP


DOCKER_DEFAULT_CAPS = "Name:\tpython\nCapEff:\t00000000a80425fb\n"  # root in `docker run` without --cap-add


def test_root_without_cap_ipc_lock_cannot_lock_beyond_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel asks RLIMIT_MEMLOCK or CAP_IPC_LOCK, never the uid (mm/mlock.c): uid 0 in a default container with
    a 64 MiB limit fails both memlock checks (the old rule, "root may lock anything", said OK)."""
    reads = {"/proc/self/status": DOCKER_DEFAULT_CAPS}
    monkeypatch.setattr(doctor, "_read", lambda path: reads.get(path, ""))
    monkeypatch.setattr(doctor.os, "geteuid", lambda: 0)
    monkeypatch.setattr(doctor.resource, "getrlimit", lambda which: (64 << 20, 64 << 20))
    monkeypatch.setattr(doctor, "probe_ascend_host",
                        lambda environ: AscendHostFacts("Ascend910B1", (24, 1), "24.1.rc1", "5.15.0", 64 << 20))
    checks = {c.name: c for c in doctor.run_doctor(doctor.DoctorOptions(device="npu"), environ={})}
    assert checks["locked memory"].verdict == FAIL and "CAP_IPC_LOCK" in checks["locked memory"].detail
    assert "CAP_IPC_LOCK" in checks["host memory"].detail and "memlock=-1" in checks["host memory"].fix
    # the control: the same root with --cap-add IPC_LOCK (bit 14 set) may lock the arena
    reads["/proc/self/status"] = "CapEff:\t00000000a80465fb\n"
    checks = {c.name: c for c in doctor.run_doctor(doctor.DoctorOptions(device="npu"), environ={})}
    assert checks["locked memory"].verdict == OK and "CAP_IPC_LOCK" not in checks["host memory"].detail


def test_hugepages() -> None:
    meminfo = "HugePages_Total:       0\nHugePages_Free:        0\nHugepagesize:       2048 kB\n"
    assert doctor.check_hugepages(meminfo, "always [madvise] never").verdict == OK
    assert doctor.check_hugepages(meminfo, "always madvise [never]").verdict == WARN
    kunpeng = doctor.check_hugepages(meminfo, "always madvise [never]", 64 << 10, 512 << 20)  # a 64 KiB-page kernel
    assert "base pages 64 KiB (getconf PAGESIZE), THP size 512 MiB" in kunpeng.detail and "64 KiB pages" in kunpeng.fix


def test_disk(tmp_path: Path) -> None:
    mounts = f"/dev/nvme0n1 / ext4 rw 0 0\ntmpfs {tmp_path} tmpfs rw 0 0\n"
    assert doctor.check_disk(None, 0, mounts).verdict == SKIP
    assert doctor.check_disk(str(tmp_path / "kv"), 1 << 20, "/dev/sda / ext4 rw 0 0\n").verdict == OK
    assert doctor.check_disk(str(tmp_path / "kv"), 1 << 20, mounts).verdict == WARN  # tmpfs
    assert doctor.check_disk(str(tmp_path), 1 << 60, "").verdict == FAIL  # more than the disk has
    (tmp_path / "file").write_text("x")
    assert doctor.check_disk(str(tmp_path / "file"), 1 << 20, "").verdict == FAIL
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        assert doctor.check_disk(str(ro), 1 << 20, "").verdict == FAIL


def test_mooncake_reachable_and_not() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        up = doctor.check_mooncake({"master": f"127.0.0.1:{port}", "metadata": f"127.0.0.1:{port}"}, timeout=1)
        assert [c.verdict for c in up] == [OK, OK]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    down = doctor.check_mooncake({"master": f"127.0.0.1:{closed}",
                                  "metadata": f"http://127.0.0.1:{closed}/metadata"}, timeout=1)
    assert [c.verdict for c in down] == [FAIL, FAIL]
    assert doctor.check_mooncake(None)[0].verdict == SKIP


def test_kv_transfer_config() -> None:
    good, config = doctor.check_kv_transfer_config(json.dumps({**CONFIG, "kv_connector_extra_config":
                                                               {"cpu_bytes": "1GiB"}}), {})
    assert [c.verdict for c in good] == [OK, OK] and config.store.cpu_bytes == 1 << 30
    wrong_class, _ = doctor.check_kv_transfer_config(json.dumps({**CONFIG, "kv_connector": "LMCacheConnectorV1"}), {})
    assert wrong_class[0].verdict == FAIL and "LMCacheConnectorV1" in wrong_class[0].detail
    bad_key, config = doctor.check_kv_transfer_config(json.dumps({**CONFIG, "kv_connector_extra_config":
                                                                  {"cpu_byte": "1GiB"}}), {})
    assert bad_key[-1].verdict == FAIL and "cpu_byte" in bad_key[-1].detail and config is None
    assert doctor.check_kv_transfer_config("{not json", {})[0][0].verdict == FAIL


def test_model_layout(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="layout discovery builds vLLM's spec classes")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                "hidden_size": 4096}))
    check = doctor.check_model(str(path), "npu", None)
    assert check.verdict == OK and "16.00 MiB" in check.detail, check.detail  # llama3-8b: 16 MiB per 128-token chunk
    path.write_text(json.dumps({"num_hidden_layers": 2}))
    assert doctor.check_model(str(path), "npu", None).verdict == FAIL


A2 = AscendHostFacts("Ascend910B1", (25, 0), "25.0.rc1.1", "5.15.0-91-generic", 64 << 20)
GiB = 1 << 30


def test_host_memory_prints_the_facts_and_the_chain() -> None:
    check = doctor.check_host_memory(A2, "auto", "npu", 8 * GiB, False)
    assert check.verdict == OK
    assert "driver 25.0.rc1.1" in check.detail and "kernel 5.15.0-91-generic" in check.detail
    assert "SoC Ascend910B1" in check.detail
    assert "aclrtHostRegister -> aclrtMallocHost -> halHostRegister" in check.detail


def test_host_memory_off_an_npu_is_a_skip_that_still_says_the_facts() -> None:
    check = doctor.check_host_memory(A2, "auto", "cpu", 8 * GiB, False)
    assert check.verdict == SKIP and "driver 25.0.rc1.1" in check.detail


def test_host_memory_fails_when_the_requested_method_cannot_work() -> None:
    p310 = AscendHostFacts("Ascend310P3", (25, 0), "25.0.rc1.1", "5.15.0", None)
    check = doctor.check_host_memory(p310, "aclrtHostRegister", "npu", 8 * GiB, False)
    assert check.verdict == FAIL and "310P" in check.detail and "npu_host_memory to 'auto'" in check.fix
    assert "aclrtMallocHost" in check.fix  # what auto would do here
    assert doctor.check_host_memory(p310, "auto", "npu", 8 * GiB, False).verdict == OK  # the control


def test_host_memory_refuses_an_unknown_method_naming_the_key() -> None:
    check = doctor.check_host_memory(A2, "pinned", "npu", 8 * GiB, False)
    assert check.verdict == FAIL and "npu_host_memory" in check.detail and "aclrtMallocHost" in check.detail


@pytest.mark.parametrize("memlock,cap,verdict", [
    (8 << 20, False, FAIL),  # halHostRegister alone, and it cannot lock the arena (root or not)
    (None, False, OK), (16 * GiB, False, OK),  # the limit allows it
    (8 << 20, True, OK),  # CAP_IPC_LOCK
])
def test_hal_register_needs_mlock(memlock, cap: bool, verdict: str) -> None:
    old = AscendHostFacts("Ascend910B1", (24, 1), "24.1.rc1", "5.15.0", memlock)
    check = doctor.check_host_memory(old, "halHostRegister", "npu", 8 * GiB, cap)
    assert check.verdict == verdict
    assert ("CAP_IPC_LOCK" in check.detail) == (verdict == FAIL)


def test_a_fallback_that_cannot_lock_is_said_but_does_not_block() -> None:
    old = AscendHostFacts("Ascend910B1", (24, 1), "24.1.rc1", "5.15.0", 8 << 20)
    check = doctor.check_host_memory(old, "auto", "npu", 8 * GiB, False)
    assert check.verdict == OK and "only that fallback would fail" in check.detail and "IPC_LOCK" in check.fix


WINDOW_MIB = STAGING_WINDOW_BYTES_DEFAULT >> 20


def test_device_memory_is_an_estimate_with_its_parts_and_the_fix() -> None:
    check = doctor.check_device_memory("npu", 64 * GiB, "auto", {}, 1, "auto", "auto")
    total = TRANSFER_LANES * (WINDOW_MIB + 1)
    assert check.verdict == OK and check.detail.startswith("estimate per NPU")
    assert f"{total} MiB = {TRANSFER_LANES} lanes x {WINDOW_MIB} MiB staging window" in check.detail
    assert "HCCL" not in check.detail  # TP 1: no share exchange
    assert f"lower gpu_memory_utilization by {total / 1024:.2f} GiB" in check.fix
    assert "backend_options.staging_bytes" in check.fix and "of the 64 GiB card" in check.detail


@pytest.mark.parametrize("tp,share,exchange,hccl", [
    (4, "auto", "auto", True), (2, "auto", "device", True),
    (1, "auto", "auto", False), (4, "off", "auto", False), (4, "auto", "host", False),  # the controls
])
def test_the_share_exchange_adds_one_hccl_communicator(tp: int, share: str, exchange: str, hccl: bool) -> None:
    check = doctor.check_device_memory("npu", None, "auto", {}, tp, share, exchange)
    total = TRANSFER_LANES * (WINDOW_MIB + 1) + (2 * HCCL_SHARE_BUFFER_MB if hccl else 0)
    assert f"{total} MiB =" in check.detail and ("HCCL" in check.detail) == hccl


def test_a_configured_staging_window_counts_only_for_the_npu_backend() -> None:
    small = doctor.check_device_memory("npu", None, "npu", {"staging_bytes": "16MiB"}, 1, "auto", "auto")
    assert f"{TRANSFER_LANES * 17} MiB = {TRANSFER_LANES} lanes x 16 MiB" in small.detail
    ints = doctor.check_device_memory("npu", None, "npu", {"staging_bytes": 32 << 20}, 1, "auto", "auto")
    assert f"{TRANSFER_LANES} lanes x 32 MiB" in ints.detail
    other = doctor.check_device_memory("npu", None, "auto", {"staging_bytes": "16MiB"}, 1, "auto", "auto")
    assert f"{TRANSFER_LANES} lanes x {WINDOW_MIB} MiB" in other.detail  # the control
    bad = doctor.check_device_memory("npu", None, "npu", {"staging_bytes": "lots"}, 1, "auto", "auto")
    assert bad.verdict == FAIL and "backend_options.staging_bytes" in bad.detail


def test_device_memory_off_an_npu_is_a_skip() -> None:
    assert doctor.check_device_memory("cuda", 80 * GiB, "auto", {}, 4, "auto", "auto").verdict == SKIP


def test_settings_come_from_the_checked_config_else_from_the_raw_extra_config() -> None:
    text = json.dumps({**CONFIG, "kv_connector_extra_config": {"backend": "npu", "npu_host_memory": "aclrtMallocHost",
                                                               "backend_options": {"staging_bytes": "8MiB"}}})
    extra = doctor.extra_config(text)
    assert doctor._setting(None, extra, "npu_host_memory", "auto") == "aclrtMallocHost"
    assert doctor._setting(None, extra, "tp_share", "auto") == "auto"
    assert doctor.extra_config("{not json") == {} and doctor.extra_config(None) == {}
    _, config = doctor.check_kv_transfer_config(json.dumps({**CONFIG, "kv_connector_extra_config":
                                                            {"tp_share": "off"}}), {})
    assert doctor._setting(config, {"tp_share": "auto"}, "tp_share", "auto") == "off"  # the checked config wins


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_NPU_")}
    return subprocess.run([sys.executable, "-m", "lmcache_npu.tools.cli", "doctor", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def test_the_command_here_says_there_is_no_npu() -> None:
    result = _cli("--json")
    assert result.returncode == 0, result.stdout + result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["devices"]["verdict"] == WARN and "no NPU or GPU" in checks["devices"]["detail"]
    from lmcache_npu.ops.backend import backend_for_device

    assert f"'auto' picks the {backend_for_device('cpu')} backend" in checks["devices"]["detail"]
    assert checks["host memory"]["verdict"] == SKIP and "npu_host_memory:" in checks["host memory"]["detail"]
    assert checks["device memory"]["verdict"] == SKIP
    assert checks["module _emu"]["verdict"] == OK
    npu = _cli("--device", "npu")
    assert npu.returncode == 1 and "no NPU is visible" in npu.stdout


def test_the_model_identity_check_names_the_weights_or_the_fix(tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    from lmcache_npu.config import load_config

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    persistent = load_config({"disk_path": str(tmp_path / "kv"), "disk_bytes": "1GiB"}, environ={})
    arena = load_config({}, environ={})
    unnamed = doctor.check_weights(str(tmp_path), persistent)
    assert unnamed.verdict == FAIL and "model_fingerprint" in unnamed.fix
    assert doctor.check_weights(str(tmp_path), arena).verdict == WARN
    node = load_config({"node_cache": "/run/lmcache-npu/node.sock"}, environ={})  # persistent and shared, too
    assert doctor.check_weights(str(tmp_path), node).verdict == FAIL
    save_file({"w": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    named = doctor.check_weights(str(tmp_path), persistent)
    assert named.verdict == OK and "weights sha256:" in named.detail
    save_file({"w": torch.ones(4) * 2}, str(tmp_path / "model.safetensors"))
    assert doctor.check_weights(str(tmp_path), persistent).detail != named.detail  # the content, not the path
    by_name = load_config({"disk_path": str(tmp_path / "kv"), "disk_bytes": "1GiB", "model_fingerprint": "v1-release"},
                          environ={})
    assert doctor.check_weights(None, by_name).verdict == OK
    assert doctor.check_weights(None, persistent).verdict == SKIP


def test_the_npu_module_is_checked_against_the_soc_it_was_built_for(tmp_path: Path) -> None:
    """F8: the SoC _npu records (read from its bytes, no import) against this host's; another kernel arch fails
    naming both, A2 and A3 share one kernel."""
    module = tmp_path / "_npu.so"
    module.write_bytes(b"\x7fELF...\x00LMCACHE_NPU_BUILT_SOC=ascend910b1\x00...")

    class Spec:
        origin = str(module)

    assert doctor.check_npu_module(Spec(), "npu", "Ascend910_9392").verdict == OK
    wrong = doctor.check_npu_module(Spec(), "npu", "Ascend310P3")
    assert wrong.verdict == FAIL and "ascend910b1" in wrong.detail and "Ascend310P3" in wrong.detail
    assert "SOC_VERSION=ascend310p3" in wrong.fix
    module.write_bytes(b"\x7fELF without a tag")
    assert "does not record its SoC" in doctor.check_npu_module(Spec(), "npu", "Ascend310P3").detail


def test_doctor_says_the_cost_models_policy_and_seeds() -> None:
    from lmcache_npu.tools.cost_report import cost_model_summary

    assert "arena->device 0.2 ms + 50 GB/s" in cost_model_summary("cost-model", "cuda")
    assert "disk->arena 2 ms + 1 GB/s" in cost_model_summary("cost-model", "cpu")
    assert "every hit is claimed" in cost_model_summary("load-all", "cpu")
    checks = {c.name: c for c in doctor.run_doctor(doctor.DoctorOptions(device="cpu"), environ={})}
    assert "Seeds until measured on cpu" in checks["cost model"].detail
