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
from lmcache_npu.store.tier import OK, Failure, TierResult, TierStore
from lmcache_npu.tools.mooncake_local import netns_available, run_in_loopback_netns

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
    done = run_in_loopback_netns([sys.executable, "-m", "tests.store.mooncake_tier_scenarios", name], env=env,
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


@needs_master
def test_the_local_master_listens_on_loopback_only():
    listening = _scenario("loopback")["listening"]
    addresses = [tuple(a) for sockets in listening.values() for a in sockets]
    assert len(addresses) >= 3, listening  # RPC, metrics/admin, HTTP metadata: a check that sees none proves nothing
    assert [a for a in addresses if a[0] != "127.0.0.1"] == [], listening


def test_listening_addresses_notices_a_wildcard_bind():
    """Negative control for the check above: a socket bound to 0.0.0.0 is reported as such."""
    import socket

    from lmcache_npu.tools.mooncake_local import listening_addresses

    with socket.socket() as wild, socket.socket() as loop:
        wild.bind(("0.0.0.0", 0))
        wild.listen()
        loop.bind(("127.0.0.1", 0))
        loop.listen()
        found = listening_addresses(os.getpid())
        ports = wild.getsockname()[1], loop.getsockname()[1]
    assert ("0.0.0.0", ports[0]) in found and ("127.0.0.1", ports[1]) in found


@needs_master
def test_an_overwritten_object_is_rejected_and_a_put_repairs_it_while_a_valid_one_is_kept():
    found = _scenario("envelope")
    assert found["after_forgery"] == ["", "rejected: magic", "", ""] and found["reader_rejected"] == 1
    # negative control: verification switched off, the same promotion "succeeds" with the forged bytes
    assert found["control_ok"] and found["control_delivers_forged_bytes"]
    assert found["put_replaced_invalid"] == 1 and found["repaired"]
    assert found["put_existing"] == 1 and found["other_wrote"] == 0 and found["first_copy_kept"]


@needs_master
def test_zero_copy_off_registers_only_the_bounce_buffer_and_round_trips_byte_for_byte():
    found = _scenario("bounce")
    assert len(found["registered"]) == 1 and found["registered"][0][1] == found["bounce_bytes"]
    start, size = found["arena"]
    assert not start <= found["registered"][0][0] < start + size  # the arena itself is not registered
    assert found["wrong"] == [] and found["zero_copy_ops"] == 0 and found["bounce_ops"] >= 80
    # the forged bytes land in the slot, are checked there and rejected: the promotion never reports them loadable
    assert found["forged"] == "rejected: magic" and not found["forged_slot_verifies"]


@needs_master
def test_a_peer_rewriting_the_bounce_buffer_never_gets_unverified_bytes_loaded():
    """Issue 31, finding N1: another transfer-engine client rewrites the registered bounce buffer in a loop while
    thousands of gets run (a store secret set); no get that reports ok leaves a slot that does not verify."""
    found = _scenario("bounce_race")
    assert found["gets"] >= 2048 and found["peer_writes"] > 1000, found
    assert found["unverified_ok"] == 0, found
    assert found["ok"] > 0, found  # the check is not vacuous: most gets still succeed


@needs_master
def test_the_old_check_then_copy_order_loads_unverified_bytes_under_the_same_peer():
    """Negative control of the test above: checking inside the bounce buffer and copying afterwards lets the peer's
    writes through, and the same count sees them."""
    found = _scenario("bounce_race_old_order")
    assert found["unverified_ok"] > 0, found


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


def test_a_mooncake_tier_is_secure_by_default(tmp_path):
    """Issue 31: no store secret refuses a Mooncake tier unless mooncake.trusted_network says so (workers and the
    scheduler alike), and zero_copy, off by default, needs that same statement."""
    from lmcache_npu.store.config import StoreConfig
    from lmcache_npu.store.factory import scheduler_mooncake_client, store_sealer

    default = MooncakeConfig.from_dict(MASTER)
    assert default.zero_copy is False and default.trusted_network is False
    with pytest.raises(ValueError, match="mooncake.zero_copy: true .* needs mooncake.trusted_network: true"):
        MooncakeConfig.from_dict({**MASTER, "zero_copy": True})
    assert MooncakeConfig.from_dict({**MASTER, "zero_copy": True, "trusted_network": True}).zero_copy
    bare = StoreConfig.from_dict({"mooncake": MASTER})
    for start in (lambda: store_sealer(bare, {}), lambda: scheduler_mooncake_client(bare, {})):
        with pytest.raises(ValueError, match="no store secret .*mooncake.secret_file .*mooncake.trusted_network: true"):
            start()
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    assert store_sealer(StoreConfig.from_dict({"mooncake": {**MASTER, "secret_file": str(secret)}}), {}).keyed
    assert store_sealer(bare, {"LMCACHE_NPU_SECRET": "s" * 32}).keyed
    trusted = StoreConfig.from_dict({"mooncake": {**MASTER, "trusted_network": True}})
    assert not store_sealer(trusted, {}).keyed  # the operator's statement: digests only, no refusal


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
        self.registered: list[tuple[int, int]] = []
        self.removed: list[str] = []
        self.puts: list[str] = []
        self.refuse_removal = False

    def _maybe_hang(self) -> None:
        self.calls += 1
        if self.hang.is_set():
            self.release.wait(30)

    def setup(self, *args) -> int:
        return self.setup_code

    def register_buffer(self, address: int, size: int) -> int:
        self.registered.append((address, size))
        return 0

    def batch_put_from(self, names, addresses, sizes):
        self._maybe_hang()
        import ctypes

        codes = []
        for name, address, size in zip(names, addresses, sizes):
            if name in self.objects:  # as the real client: an existing name is kept, and the put "succeeds"
                codes.append(0)
                continue
            self.objects[name] = ctypes.string_at(address, size)
            self.puts.append(name)
            codes.append(0)
        return codes

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
        if name not in self.objects:
            self.objects[name] = bytes(data)
            self.puts.append(name)
        return 0

    def get(self, name):
        return self.objects.get(name, b"")

    def batch_remove(self, names, force=False):
        self.removed.extend(names)
        if self.refuse_removal:
            return [-706] * len(names)
        return [0 if self.objects.pop(n, None) is not None else -704 for n in names]

    def close(self) -> int:
        return 0


def _tier(store: FakeStore, **overrides) -> MooncakeTier:
    """Zero-copy unless a test says otherwise (these tests are about the client's calls, not the trust defaults)."""
    values = {**MASTER, "local_hostname": "127.0.0.1", "timeout_s": 0.3, "retry_after_s": 0.5, "zero_copy": True,
              "trusted_network": True, **overrides}
    return MooncakeTier(MooncakeConfig.from_dict(values), store_factory=lambda: store)


def test_the_mooncake_tier_is_a_tier_store():
    tier = _tier(FakeStore({}))
    assert isinstance(tier, TierStore)
    tier.close()


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

        def batch_is_exist(self, names):
            return [1 if n in self.objects else 0 for n in names]

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
    from lmcache_npu.tools.mooncake_local import free_port

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


def _sealed_chunk(key, seed: int, sealer=None) -> np.ndarray:
    from lmcache_npu.store.envelope import ENVELOPE_BYTES, Sealer, seal

    data = np.random.default_rng(seed).integers(0, 256, 1024 + ENVELOPE_BYTES, dtype=np.uint8)
    seal(data, key, 0, sealer or Sealer())
    return data


def _check_for(key):
    from lmcache_npu.store.envelope import Sealer, verify

    return lambda view: verify(view, key, 0, Sealer())


def test_a_put_over_an_invalid_object_replaces_it_and_over_a_valid_one_writes_nothing():
    from lmcache_npu.store.keys import ChunkKey

    key = ChunkKey("c" * 32, b"\x01" * 32)
    name = key.storage_name(0)
    store = FakeStore({name: b"\x00" * (1024 + 256)})  # same length, no valid envelope
    tier = _tier(store)
    ours = _sealed_chunk(key, 1)
    assert tier.put([name], [memoryview(ours)], verify=[_check_for(key)]) == [OK]
    assert store.objects[name] == ours.tobytes() and store.removed == [name]
    assert tier.counters["put_replaced_invalid"] == 1
    # another instance's valid object of this key (other bytes) counts as stored, and is not written
    theirs = _sealed_chunk(key, 2)
    assert tier.put([name], [memoryview(theirs)], verify=[_check_for(key)]) == [OK]
    assert store.objects[name] == ours.tobytes() and tier.counters["put_existing"] == 1 and store.puts == [name]
    # control: without the check only the length is compared, so an object with a bad envelope would be kept
    store.objects[name] = b"\x00" * (1024 + 256)
    assert tier.put([name], [memoryview(ours)]) == [OK] and store.objects[name] == b"\x00" * (1024 + 256)
    # an object of another length is replaced even without a check
    store.objects[name] = b"\x00" * 10
    assert tier.put([name], [memoryview(ours)]) == [OK] and store.objects[name] == ours.tobytes()
    tier.close()


def test_a_put_over_an_invalid_object_that_cannot_be_removed_fails():
    from lmcache_npu.store.keys import ChunkKey

    key = ChunkKey("c" * 32, b"\x02" * 32)
    name = key.storage_name(0)
    store = FakeStore({name: b"\x07" * (1024 + 256)})
    store.refuse_removal = True
    tier = _tier(store)
    results = tier.put([name], [memoryview(_sealed_chunk(key, 3))], verify=[_check_for(key)])
    assert results == [TierResult.fail(Failure.PUT, "name exists with other contents")]
    assert store.objects[name] == b"\x07" * (1024 + 256) and tier.counters["puts"] == 0
    tier.close()


def test_a_get_whose_check_fails_is_a_rejected_miss_checked_in_the_buffer_it_landed_in():
    from lmcache_npu.store.keys import ChunkKey

    key, other = ChunkKey("c" * 32, b"\x03" * 32), ChunkKey("c" * 32, b"\x04" * 32)
    store = FakeStore({key.storage_name(0): _sealed_chunk(other, 4).tobytes()})  # another chunk's bytes
    store.register_buffer = lambda address, size: -1  # copy path: the bytes land in the buffer, are checked there
    tier = _tier(store)
    out = np.full(1024 + 256, 0x5A, dtype=np.uint8)
    checked: list[bytes] = []

    def check(view: memoryview):  # type: ignore[no-untyped-def]
        checked.append(bytes(view))
        assert np.frombuffer(view, dtype=np.uint8).ctypes.data == out.ctypes.data, "the check must read the buffer"
        return _check_for(key)(view)

    assert tier.get_into([key.storage_name(0)], [memoryview(out)], verify=[check]) == [
        TierResult.fail(Failure.REJECTED, "key")]
    assert tier.counters["rejected"] == 1 and tier.counters["gets"] == 0 and checked == [out.tobytes()]
    # control: the right key's check accepts the same bytes and they arrive
    assert tier.get_into([key.storage_name(0)], [memoryview(out)], verify=[_check_for(other)]) == [OK]
    assert out.tobytes() == store.objects[key.storage_name(0)]
    tier.close()


def test_zero_copy_off_registers_only_a_bounce_buffer_and_splits_batches_to_fit_it():
    store = FakeStore({})
    tier = _tier(store, zero_copy=False, bounce_bytes=1 << 20)
    arena = np.zeros(6 * (400 << 10), dtype=np.uint8)
    assert not tier.register(arena.ctypes.data, arena.nbytes)
    assert [size for _, size in store.registered] == [1 << 20]
    views = [memoryview(arena[i * (400 << 10):(i + 1) * (400 << 10)]) for i in range(6)]
    for i in range(3):
        arena[i * (400 << 10):(i + 1) * (400 << 10)] = i + 1
    names = [f"n{i}" for i in range(3)]
    assert tier.put(names, views[:3]) == [OK] * 3 and tier.counters["bounce_ops"] == 3
    assert tier.get_into(names, views[3:]) == [OK] * 3
    assert [bytes(v[:1]) + bytes(v[-1:]) for v in views[3:]] == [bytes([i, i]) for i in (1, 2, 3)]
    assert tier.counters["zero_copy_ops"] == 0
    tier.close()
