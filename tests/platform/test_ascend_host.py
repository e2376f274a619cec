"""An Ascend host's facts and the host-memory registration chain they give (lmcache_npu/platform/ascend_host.py):
every rule, its boundary as the negative control, and readers that return junk."""

from __future__ import annotations

import resource
from dataclasses import replace
from typing import Optional, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.platform.ascend_host import (
    AUTO_ORDER,
    AscendHostFacts,
    NpuHostMethod,
    can_lock,
    cap_ipc_lock,
    driver_dir,
    host_memory_chain,
    kernel_version,
    parse_driver_version,
    probe_ascend_host,
)

from .recorded import load

HR, MH, HAL = NpuHostMethod.HOST_REGISTER, NpuHostMethod.MALLOC_HOST, NpuHostMethod.HAL_REGISTER
GOOD = AscendHostFacts(soc="Ascend910B1", driver_version=(25, 0), driver_version_text="25.0.rc1.1",
                       kernel_release="5.15.0-91-generic", memlock_bytes=None)


def reasons(chain) -> dict:
    return dict(chain.skipped)


def test_a_new_driver_on_a_new_kernel_tries_everything_in_order() -> None:
    chain = host_memory_chain(GOOD)
    assert chain.methods == (HR, MH, HAL) and chain.skipped == () and chain.notes == ()
    assert chain.describe() == "npu_host_memory: aclrtHostRegister -> aclrtMallocHost -> halHostRegister"


@pytest.mark.parametrize("soc", ["Ascend310P3", "ascend310p1", "310P3"])
def test_310p_allocates_with_acl_only(soc: str) -> None:
    chain = host_memory_chain(replace(GOOD, soc=soc))
    assert chain.methods == (MH,)
    assert "310P" in reasons(chain)[HR] and "unsupported" in reasons(chain)[HR]
    assert "never registers host memory on 310" in reasons(chain)[HAL]


@pytest.mark.parametrize("soc", ["Ascend910_9392", "Ascend910B4", "Ascend950PR_9599"])
def test_a2_a3_a5_keep_every_method(soc: str) -> None:  # the control of the 310P rule
    assert host_memory_chain(replace(GOOD, soc=soc)).methods == (HR, MH, HAL)


@pytest.mark.parametrize("release", ["5.10.0-60.18.0.50.oe2203.aarch64", "4.19.90-52.22.v2207.ky10.aarch64",
                                     "5.4.0-150-generic", "3.10.0-1160.el7.x86_64"])
def test_kernels_up_to_5_10_allocate_with_acl_only(release: str) -> None:
    chain = host_memory_chain(replace(GOOD, kernel_release=release))
    assert chain.methods == (MH,)
    assert "<= 5.10" in reasons(chain)[HR] and "causes exceptions" in reasons(chain)[HAL]


@pytest.mark.parametrize("release", ["5.11.0", "5.15.0-91-generic", "6.6.0-28.0.0.34.oe2403.aarch64", "10.0.0"])
def test_kernels_after_5_10_keep_every_method(release: str) -> None:  # the boundary's other side
    assert host_memory_chain(replace(GOOD, kernel_release=release)).methods == (HR, MH, HAL)


@pytest.mark.parametrize("version,text", [((24, 1), "24.1.rc1"), ((23, 0, 5), "23.0.5"), ((24, 1, 0), "24.1.0")])
def test_drivers_older_than_25_fall_back_to_malloc_host_then_hal(version: tuple, text: str) -> None:
    chain = host_memory_chain(replace(GOOD, driver_version=version, driver_version_text=text))
    assert chain.methods == (MH, HAL)
    assert f"driver {text} < 25" in reasons(chain)[HR]


def test_driver_25_keeps_host_register() -> None:  # the boundary's other side
    assert host_memory_chain(replace(GOOD, driver_version=(25,), driver_version_text="25")).methods[0] is HR


def test_an_unknown_driver_keeps_the_full_order_and_says_so() -> None:
    chain = host_memory_chain(replace(GOOD, driver_version=None, driver_version_text=None))
    assert chain.methods == (HR, MH, HAL) and "driver version unknown" in chain.describe()


def test_unknown_facts_are_notes_not_rules() -> None:
    chain = host_memory_chain(AscendHostFacts(None, None, None, "", None))
    assert chain.methods == AUTO_ORDER
    assert len(chain.notes) == 3 and any("SoC unknown" in n for n in chain.notes)


def test_the_rules_combine() -> None:
    openeuler_old_driver = replace(GOOD, kernel_release="5.10.0-60.oe2203.aarch64", driver_version=(24, 1),
                                   driver_version_text="24.1.rc1")
    chain = host_memory_chain(openeuler_old_driver)
    assert chain.methods == (MH,)
    assert "<= 5.10" in reasons(chain)[HR] and "< 25" in reasons(chain)[HR]


@pytest.mark.parametrize("method", list(NpuHostMethod))
def test_a_requested_method_is_the_only_one_tried(method: NpuHostMethod) -> None:
    chain = host_memory_chain(GOOD, method.value)
    assert chain.methods == (method,)
    assert {m for m, _ in chain.skipped} == set(AUTO_ORDER) - {method}


def test_a_requested_method_the_facts_rule_out_leaves_nothing_with_the_reason() -> None:
    chain = host_memory_chain(replace(GOOD, soc="Ascend310P3"), "aclrtHostRegister")
    assert chain.methods == ()
    assert "310P" in reasons(chain)[HR]
    assert "no method" in chain.describe() and "npu_host_memory asks for aclrtHostRegister alone" in chain.describe()


@pytest.mark.parametrize("value", ["", "AUTO", "aclrthostregister", "malloc", "none", "aclrtMallocHost "])
def test_any_other_value_is_refused_naming_the_key_and_the_choices(value: str) -> None:
    with pytest.raises(ValueError) as error:
        host_memory_chain(GOOD, value)
    message = str(error.value)
    assert "npu_host_memory" in message and repr(value) in message
    assert all(m.value in message for m in NpuHostMethod) and "'auto'" in message


FACTS = st.builds(
    AscendHostFacts,
    soc=st.one_of(st.none(), st.sampled_from(["Ascend910B1", "Ascend910_9392", "Ascend310P3", "Ascend950PR_9599",
                                              "Ascend910A", "junk"])),
    driver_version=st.one_of(st.none(), st.tuples(st.integers(0, 40), st.integers(0, 9))),
    driver_version_text=st.one_of(st.none(), st.text(max_size=12)),
    kernel_release=st.one_of(st.text(max_size=20), st.from_regex(r"[3-7]\.[0-9]{1,2}\.[0-9]-[a-z0-9.]{0,12}",
                                                                 fullmatch=True)),
    memlock_bytes=st.one_of(st.none(), st.integers(0, 1 << 40)),
)


@settings(max_examples=300, deadline=None)
@given(facts=FACTS, requested=st.sampled_from(["auto", *(m.value for m in NpuHostMethod)]))
def test_every_candidate_is_tried_or_left_out_with_a_reason(facts: AscendHostFacts, requested: str) -> None:
    chain = host_memory_chain(facts, requested)
    assert list(chain.methods) == [m for m in AUTO_ORDER if m in chain.methods]  # the order never changes
    tried, left = set(chain.methods), [m for m, _ in chain.skipped]
    assert not tried & set(left) and len(left) == len(set(left)) and tried | set(left) == set(AUTO_ORDER)
    assert all(reason for _, reason in chain.skipped)
    if requested == "auto":
        assert MH in chain.methods  # ACL's own allocation is never ruled out: auto always has a method
    assert chain.describe()


@pytest.mark.parametrize("text,expected", [
    (load("driver_version_24.1.rc1.info"), ((24, 1), "24.1.rc1")),
    ("Version=25.0.rc1.1\n", ((25, 0), "25.0.rc1.1")),
    ("version=26.0.0\nInnerversion=V100R001C25\n", ((26, 0, 0), "26.0.0")),
    ("Innerversion=V100R001C15SPC006B220\nVersion=23.0.5\n", ((23, 0, 5), "23.0.5")),
    (load("smi_table_310p3_pasted.txt"), ((25, 0), "25.0.rc1.1")),  # the npu-smi header
    (load("smi_table_a3.txt"), ((26, 0), "26.0.rc2")),
    ("Version=25\n", ((25,), "25")),
])
def test_driver_versions(text: str, expected: tuple) -> None:
    assert parse_driver_version(text) == expected


@pytest.mark.parametrize("text", ["", "Version=\n", "Version=abc\n", "Version=.25\n", "ascendhal_version=7.35.19\n",
                                  "\x00\xff garbage", "Innerversion=V100R001C15\n", "compatible_version=[V1]\n"])
def test_a_bad_version_file_is_unknown(text: str) -> None:
    assert parse_driver_version(text) == (None, None)


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.text(max_size=200), st.builds("Version={}\n".format, st.text(max_size=30))))
def test_no_version_file_makes_it_raise(text: str) -> None:
    numbers, version = parse_driver_version(text)
    assert (numbers is None) == (version is None)
    assert numbers is None or (numbers and all(isinstance(n, int) for n in numbers))


def test_kernel_version() -> None:
    assert kernel_version("5.10.0-60.18.0.50.oe2203.aarch64") == (5, 10)
    assert kernel_version("6.6.0") == (6, 6)
    assert kernel_version("") is None and kernel_version("linux") is None


def test_driver_dir_follows_the_install_info() -> None:
    assert driver_dir(load("ascend_install.info")) == "/usr/local/Ascend/driver"
    assert driver_dir("Driver_Install_Path_Param=/opt/ascend\n") == "/opt/ascend/driver"
    assert driver_dir(None) == "/usr/local/Ascend/driver"


class Host:
    """Fake readers: files by path, npu-smi by command line."""

    def __init__(self, files: dict[str, str], smi: dict[str, str]) -> None:
        self.files, self.smi = files, smi

    def read(self, path: str) -> Optional[str]:
        return self.files.get(path)

    def run(self, command: Sequence[str]) -> Optional[str]:
        return self.smi.get(" ".join(command[1:]))


def probe(host: Host, soft: int = 64 << 20, environ: Optional[dict] = None) -> AscendHostFacts:
    return probe_ascend_host(read_file=host.read, run=host.run, release=lambda: "5.10.0-60.oe2203.aarch64",
                             getrlimit=lambda _: (soft, soft), environ=environ or {})


def test_probe_reads_the_driver_where_the_install_info_says() -> None:
    host = Host({"/etc/ascend_install.info": "Driver_Install_Path_Param=/opt/ascend\n",
                 "/opt/ascend/driver/version.info": load("driver_version_24.1.rc1.info"),
                 "/usr/local/Ascend/driver/version.info": "Version=25.0.rc1\n"},  # the control: not this one
                {"info -t board -i 0 -c 0": load("board_a3_9392.txt")})
    facts = probe(host)
    assert facts == AscendHostFacts("Ascend910_9392", (24, 1), "24.1.rc1", "5.10.0-60.oe2203.aarch64", 64 << 20)
    assert host_memory_chain(facts).methods == (MH,)


def test_probe_falls_back_to_the_npu_smi_header_and_to_soc_version() -> None:
    facts = probe(Host({"/usr/local/Ascend/driver/version.info": "Version=garbage\n"},
                       {"info": load("smi_table_310p3.txt")}), environ={"SOC_VERSION": "ascend310p1"})
    assert facts.driver_version == (25, 2, 0) and facts.soc == "ascend310p1"


def test_probe_of_a_host_without_anything_is_all_unknown_and_never_raises() -> None:
    facts = probe(Host({}, {}), soft=resource.RLIM_INFINITY)
    assert (facts.soc, facts.driver_version, facts.driver_version_text, facts.memlock_bytes) == (None,) * 4
    assert "unknown" in facts.describe() and "unlimited" in facts.describe()


@pytest.mark.parametrize("status,expected", [
    ("Name:\tpython\nCapEff:\t000001ffffffffff\n", True),  # root in a privileged container
    ("CapEff:\t0000000000004000\n", True),  # CAP_IPC_LOCK alone (docker --cap-add IPC_LOCK)
    ("CapEff:\t00000000a80425fb\n", False),  # docker's default set: no IPC_LOCK
    ("CapEff:\t0000000000000000\n", False), ("", False), ("CapEff:\tzz\n", False),
])
def test_cap_ipc_lock(status: str, expected: bool) -> None:
    assert cap_ipc_lock(status) is expected


def test_can_lock() -> None:
    assert can_lock(None, 1 << 40, False)  # unlimited
    assert can_lock(8 << 30, 8 << 30, False)
    assert not can_lock(8 << 20, 8 << 30, False)  # the control
    assert can_lock(8 << 20, 8 << 30, True)  # CAP_IPC_LOCK lifts the limit


def test_root_in_a_default_container_cannot_lock_beyond_the_limit() -> None:
    """mm/mlock.c asks RLIMIT_MEMLOCK or CAP_IPC_LOCK, not the uid: root with docker's default capabilities (no
    IPC_LOCK) and a 64 MiB limit cannot lock an 8 GiB arena (the old rule let uid 0 through)."""
    has_cap = cap_ipc_lock("Uid:\t0\t0\t0\t0\nCapEff:\t00000000a80425fb\n")
    assert not has_cap and not can_lock(64 << 20, 8 << 30, has_cap)
