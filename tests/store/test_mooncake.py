"""The Mooncake tier: against a real mooncake_master inside a loopback-only network namespace (round trip, two
instances sharing chunks, master killed mid-run), and its config rules and circuit breaker without one."""

import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from lmcache_npu.store.mooncake import MooncakeConfig, MooncakeTier
from lmcache_npu.store.mooncake_local import netns_available, run_in_loopback_netns

ROOT = Path(__file__).resolve().parents[2]


def _real_mooncake_reason() -> str:
    if importlib.util.find_spec("mooncake") is None:
        return "the Mooncake client is not installed (make setup installs mooncake-transfer-engine-non-cuda)"
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as exc:
        return f"the Mooncake client does not load here ({exc}; make setup installs libibverbs1 librdmacm1)"
    ok, why = netns_available()
    return "" if ok else f"no loopback-only network namespace for mooncake_master: {why}"


needs_master = pytest.mark.skipif(bool(_real_mooncake_reason()), reason=_real_mooncake_reason() or "ok")


def _scenario(name: str, timeout: float = 240) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOG_minloglevel="2")
    done = run_in_loopback_netns([sys.executable, "-m", "tests.store.mooncake_scenarios", name], env=env,
                                 timeout=timeout)
    assert done.returncode == 0, f"scenario {name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_master
def test_round_trip_of_500_chunks_zero_copy_and_copy_path():
    found = _scenario("roundtrip")
    assert found["chunks"] == 500 and found["healthy"]


@needs_master
def test_a_second_instance_reads_what_the_first_stored():
    assert _scenario("share") == {"shared": 100, "reader": {"read": 100}}


@needs_master
def test_master_killed_mid_run_turns_into_misses_and_counters():
    found = _scenario("master_killed")
    assert found["counters"]["puts"] == 20 and found["counters"]["unavailable"] >= 1


MASTER = {"master": "10.0.0.5:50051", "metadata": "http://10.0.0.5:8080/metadata"}


def test_config_takes_sizes_and_refuses_bad_values_by_name():
    config = MooncakeConfig.from_dict({**MASTER, "global_segment_bytes": "4GiB", "protocol": "rdma"})
    assert config.global_segment_bytes == 4 << 30 and config.protocol == "rdma"
    cases = [({**MASTER, "masterr": "x"}, "unknown mooncake config key\\(s\\) 'masterr'; valid keys: master, "),
             ({"master": "10.0.0.5:50051"}, "mooncake config needs metadata"),
             ({**MASTER, "master": "10.0.0.5"}, "mooncake.master must be host:port"),
             ({**MASTER, "master": "10.0.0.5:99999"}, "mooncake.master must be host:port"),
             ({**MASTER, "global_segment_bytes": -1}, "mooncake.global_segment_bytes: a size cannot be negative"),
             ({**MASTER, "protocol": "udp"}, "mooncake.protocol must be one of tcp, rdma, ascend"),
             ({**MASTER, "timeout_s": 0}, "mooncake.timeout_s must be seconds"),
             ({**MASTER, "metadata": ""}, "mooncake.metadata must name the metadata server")]
    for values, message in cases:
        with pytest.raises(ValueError, match=message):
            MooncakeConfig.from_dict(values)


def test_store_config_checks_its_mooncake_object():
    from lmcache_npu.store.config import StoreConfig

    with pytest.raises(ValueError, match="mooncake.protocol must be one of"):
        StoreConfig.from_dict({"mooncake": {**MASTER, "protocol": "udp"}})
    assert StoreConfig.from_dict({"mooncake": MASTER}).mooncake_config().master == "10.0.0.5:50051"


class FakeStore:
    """Mooncake's client API over a dict; `hang` blocks every call until released, `codes` overrides results."""

    def __init__(self, objects: dict) -> None:
        self.objects = objects
        self.hang = threading.Event()
        self.release = threading.Event()
        self.setup_code = 0
        self.calls = 0

    def _maybe_hang(self) -> None:
        self.calls += 1
        if self.hang.is_set():
            self.release.wait(30)

    def setup(self, *args) -> int:
        return self.setup_code

    def register_buffer(self, address: int, size: int) -> int:
        return 0

    def batch_put_from(self, names, addresses, sizes):
        self._maybe_hang()
        import ctypes

        for name, address, size in zip(names, addresses, sizes):
            self.objects[name] = ctypes.string_at(address, size)
        return [0] * len(names)

    def batch_get_into(self, names, addresses, sizes):
        self._maybe_hang()
        import ctypes

        codes = []
        for name, address, size in zip(names, addresses, sizes):
            data = self.objects.get(name)
            if data is None:
                codes.append(-704)
            elif len(data) > size:
                codes.append(-600)
            else:
                ctypes.memmove(address, data, len(data))
                codes.append(len(data))
        return codes

    def batch_is_exist(self, names):
        self._maybe_hang()
        return [1 if n in self.objects else 0 for n in names]

    def put(self, name, data):
        self.objects[name] = bytes(data)
        return 0

    def get(self, name):
        return self.objects.get(name, b"")

    def batch_remove(self, names):
        return [0 if self.objects.pop(n, None) is not None else -704 for n in names]

    def close(self) -> int:
        return 0


def _tier(store: FakeStore, **overrides) -> MooncakeTier:
    values = {**MASTER, "local_hostname": "127.0.0.1", "timeout_s": 0.3, "retry_after_s": 0.5, **overrides}
    return MooncakeTier(MooncakeConfig.from_dict(values), store_factory=lambda: store)


def test_hanging_calls_time_out_open_the_circuit_and_recover():
    store = FakeStore({})
    tier = _tier(store)
    arena = np.zeros(4 * 1024, dtype=np.uint8)
    assert tier.register(arena.ctypes.data, arena.nbytes)
    views = [memoryview(arena[i * 1024:(i + 1) * 1024]) for i in range(4)]
    arena[:] = 9
    assert all(r.ok for r in tier.put(["a", "b"], views[:2]))
    store.hang.set()
    start = time.monotonic()
    assert tier.exists(["a"]) == [False]  # a call that touches no caller memory is abandoned at the deadline
    assert 0.25 < time.monotonic() - start < 1.5
    assert not tier.healthy() and tier.counters["timeouts"] == 1
    calls = store.calls
    start = time.monotonic()
    assert [r.reason for r in tier.get_into(["a"], views[2:3])] == ["unavailable"]  # circuit open: no client call
    assert time.monotonic() - start < 0.05 and store.calls == calls and tier.counters["unhealthy_skips"] == 1
    store.hang.clear()
    store.release.set()
    time.sleep(0.6)  # past retry_after_s: one probe, then service resumes
    assert tier.exists(["a", "b", "zz"]) == [True, True, False]
    assert tier.healthy()
    assert all(r.ok for r in tier.get_into(["a", "b"], views[2:]))
    assert bytes(views[2]) == b"\x09" * 1024
    tier.close()


def test_a_late_get_into_a_slot_is_waited_for_never_abandoned():
    store = FakeStore({"a": b"\x05" * 1024})
    tier = _tier(store)
    slot = np.zeros(1024, dtype=np.uint8)
    assert tier.register(slot.ctypes.data, slot.nbytes)
    store.hang.set()
    answers = []
    caller = threading.Thread(target=lambda: answers.append(tier.get_into(["a"], [memoryview(slot)])))
    caller.start()
    time.sleep(0.6)  # past the deadline: the circuit is open, yet the caller still waits for the client
    assert caller.is_alive() and not tier.healthy() and tier.counters["timeouts"] == 1
    assert tier.exists(["a"]) == [False]  # everyone else is answered at once meanwhile
    store.release.set()
    caller.join(5)
    assert [r.reason for r in answers[0]] == ["unavailable"] and tier.counters["late_calls"] == 1
    assert slot[0] == 5  # the late write landed while the slot was still this command's, not after
    tier.close()


def test_a_master_unreachable_at_start_is_retried_later():
    store = FakeStore({"x": b"1" * 16})
    store.setup_code = -1
    tier = _tier(store, retry_after_s=0.2)
    assert not tier.healthy() and tier.exists(["x"]) == [False]
    store.setup_code = 0
    time.sleep(0.3)
    assert tier.exists(["x"]) == [True] and tier.healthy()
    tier.close()


def test_unregistered_buffers_use_the_copy_path_and_lengths_are_checked():
    class CopyOnly:
        """An older client: no register_buffer / batch_put_from / batch_get_into."""

        def __init__(self) -> None:
            self.objects: dict = {}

        def setup(self, *args) -> int:
            return 0

        def put(self, name, data):
            self.objects[name] = bytes(data)
            return 0

        def get(self, name):
            return self.objects.get(name, b"")

        def close(self) -> int:
            return 0

    store = CopyOnly()
    tier = _tier(store)
    data = np.arange(256, dtype=np.uint8)
    assert not tier.register(data.ctypes.data, data.nbytes)
    assert tier.put(["k"], [memoryview(data)])[0].ok and tier.counters["copy_ops"] == 1
    out = np.zeros(256, dtype=np.uint8)
    assert tier.get_into(["k"], [memoryview(out)])[0].ok and np.array_equal(out, data)
    assert tier.get_into(["k"], [memoryview(np.zeros(100, dtype=np.uint8))])[0].reason == "corrupt: length"
    assert tier.get_into(["nope"], [memoryview(out)])[0].reason == "miss"
    tier.close()


def test_a_missing_client_package_is_a_clear_startup_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mooncake(name, *args, **kwargs):
        if name.startswith("mooncake"):
            raise ImportError("No module named 'mooncake'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mooncake)
    with pytest.raises(RuntimeError, match="pip install mooncake-transfer-engine-non-cuda"):
        MooncakeTier(MooncakeConfig.from_dict({**MASTER, "local_hostname": "127.0.0.1"}))


def test_a_refused_registration_means_copies_not_zero_copy_calls():
    store = FakeStore({})
    store.register_buffer = lambda address, size: -1
    tier = _tier(store)
    arena = np.full(2048, 3, dtype=np.uint8)
    assert not tier.register(arena.ctypes.data, arena.nbytes)
    assert tier.put(["a"], [memoryview(arena[:1024])])[0].ok
    assert tier.get_into(["a"], [memoryview(arena[1024:])])[0].ok
    assert tier.counters["copy_ops"] == 2 and tier.counters["zero_copy_ops"] == 0
    tier.close()


def test_a_master_that_refuses_connections_is_never_handed_to_the_clients_blocking_setup(monkeypatch):
    """The real client's setup retries a dead master for ~90 s without releasing the GIL: the tier probes the port
    first and opens its circuit instead."""
    from lmcache_npu.store import mooncake as mooncake_module
    from lmcache_npu.store.mooncake_local import free_port

    calls = []

    class Client:
        def setup(self, *args):
            calls.append(args)
            return 0

    monkeypatch.setattr(mooncake_module, "_default_store_factory", Client)
    tier = MooncakeTier(MooncakeConfig.from_dict({"master": f"127.0.0.1:{free_port()}", "metadata": "P2PHANDSHAKE",
                                                  "local_hostname": "127.0.0.1"}))
    assert not tier.healthy() and calls == [] and tier.counters["unavailable"] == 1
    tier.close()
