"""`lmcache-npu doctor` predicts every refusal the engine makes at start (issue 42): for each, a configuration the
engine refuses (the connector under vLLM 0.23's real scheduler, `engine.py`; the worker's own `engine_store_config`
for data parallelism; the node client's peer check for the socket) fails doctor's check with the engine's own message,
and a valid configuration passes both (the negative control: doctor does not fail what the engine runs)."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional

import pytest

from lmcache_npu.config import load_config
from lmcache_npu.node.client import NodeCacheUnavailable, check_service_peer
from lmcache_npu.store.secret import SECRET_ENV
from lmcache_npu.tools.doctor import check_weights
from lmcache_npu.tools.doctor_refusals import check_node_cache_socket, check_refusals
from lmcache_npu.tools.doctor_verdict import FAIL, OK, SKIP, WARN

SEED = "20261127"
SECRET = "a-store-secret-of-enough-bytes"
MOONCAKE = {"master": "127.0.0.1:9", "metadata": "http://127.0.0.1:9/metadata"}  # nothing listens: refused before


@pytest.fixture
def engine_refusal(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """Starts an engine (tests/integration/engine.py) with an extra config under an environment; returns the message
    of the ValueError it refused to start with ("" when it started). vLLM's NONE_HASH is put back afterwards."""
    from .engine import Engine, EngineSpec, engines_closed_after

    def start(env: dict[str, str], model_dir: Optional[str] = None, **extra_config: Any) -> str:
        for name in ("PYTHONHASHSEED", SECRET_ENV):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        try:
            engines.append(Engine(EngineSpec(extra_config=extra_config, model_dir=model_dir)))
        except ValueError as exc:
            return str(exc)
        return ""

    with engines_closed_after() as engines:
        yield start


def doctor_failures(env: dict[str, str], **options: Any) -> list[str]:
    extra = options.pop("extra")
    checks = check_refusals(load_config(extra, env), env, **options)
    return [c.detail for c in checks if c.verdict == FAIL]


def private_dir(tmp_path: Path, name: str, mode: int = 0o700) -> str:
    path = tmp_path / name
    path.mkdir()
    os.chmod(path, mode)
    return str(path)


def secret_file(tmp_path: Path, mode: int) -> str:
    path = tmp_path / "secret"
    path.write_text(SECRET)
    os.chmod(path, mode)
    return str(path)


CASES = {
    "mooncake without a secret": lambda tmp: ({"PYTHONHASHSEED": SEED}, {"mooncake": MOONCAKE}),
    "a secret file others can read": lambda tmp: (
        {"PYTHONHASHSEED": SEED}, {"mooncake": {**MOONCAKE, "secret_file": secret_file(tmp, 0o644)}}),
    "a hash seed of 0 with a disk tier": lambda tmp: (
        {"PYTHONHASHSEED": "0"}, {"disk_path": private_dir(tmp, "kv"), "disk_bytes": "64MiB"}),
    "no hash seed with a disk tier": lambda tmp: ({}, {"disk_path": private_dir(tmp, "kv"), "disk_bytes": "64MiB"}),
    "a disk directory others can write": lambda tmp: (
        {"PYTHONHASHSEED": SEED}, {"disk_path": private_dir(tmp, "kv", 0o777), "disk_bytes": "64MiB"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_what_the_engine_refuses_doctor_fails_with_the_same_message(engine_refusal, tmp_path: Path,
                                                                    case: str) -> None:
    env, extra = CASES[case](tmp_path)
    refused = engine_refusal(env, **extra)
    assert refused, f"the engine started with {case}"
    assert doctor_failures(env, extra=extra) == [refused]


def test_negative_control_a_valid_config_passes_both(engine_refusal, tmp_path: Path) -> None:
    env = {"PYTHONHASHSEED": SEED, SECRET_ENV: SECRET}
    extra = {"disk_path": private_dir(tmp_path, "kv"), "disk_bytes": "64MiB"}
    assert engine_refusal(env, **extra) == ""
    checks = check_refusals(load_config(extra, env), env)
    assert {c.name: c.verdict for c in checks} == {"store secret": OK, "block hashes": OK, "disk directory": OK,
                                                     "node cache socket": SKIP}


def _data_parallel(rank: int = 1, size: int = 2) -> SimpleNamespace:
    """What the worker's engine_store_config reads of a vLLM config."""
    return SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank=rank, data_parallel_size=size))


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_data_parallel_disk_parent_others_can_write_is_refused_by_both(tmp_path: Path, mode: int) -> None:
    from lmcache_npu.integration.vllm.worker import engine_store_config

    env = {"PYTHONHASHSEED": SEED}
    extra = {"disk_path": private_dir(tmp_path, "kv", mode), "disk_bytes": "64MiB"}
    with pytest.raises(ValueError) as refused:
        engine_store_config(load_config(extra, env), _data_parallel())
    assert doctor_failures(env, extra=extra, data_parallel_size=2) == [str(refused.value)]
    assert doctor_failures(env, extra=extra) != []  # without data parallelism the directory itself is refused


def test_negative_control_a_root_owned_parent_passes_with_data_parallelism_only(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent rule lets root own it; the directory rule (no data parallelism) does not."""
    from lmcache_npu.integration.vllm.worker import engine_store_config
    from lmcache_npu.store.disk import trust

    if os.geteuid() != 0:
        pytest.skip("needs a directory owned by root")
    env = {"PYTHONHASHSEED": SEED}
    extra = {"disk_path": private_dir(tmp_path, "kv", 0o755), "disk_bytes": "64MiB"}
    monkeypatch.setattr(trust.os, "geteuid", lambda: 4242)  # the service user is not root: the directory is root's
    engine_store_config(load_config(extra, env), _data_parallel())  # accepted by the worker
    assert doctor_failures(env, extra=extra, data_parallel_size=2) == []
    assert len(doctor_failures(env, extra=extra)) == 1


class _Peer:
    """A connected socket as check_service_peer sees it: SO_PEERCRED names the serving process's uid."""

    def __init__(self, uid: int) -> None:
        self.uid = uid

    def getsockopt(self, level: int, option: int, size: int) -> bytes:
        return struct.pack("3i", 4242, self.uid, self.uid)

    def close(self) -> None:
        pass


def test_a_node_cache_served_by_an_untrusted_user_is_refused_by_both(tmp_path: Path) -> None:
    other = 54321  # no user of this machine; the socket file is this test's, so nothing vouches for that uid
    path = tmp_path / "node.sock"
    path.touch()
    with pytest.raises(NodeCacheUnavailable) as refused:
        check_service_peer(_Peer(other), str(path))  # what the engine's attach asks of every connection
    check = check_node_cache_socket(str(path), connect=lambda p: _Peer(other))  # type: ignore[arg-type,return-value]
    assert (check.verdict, check.detail) == (FAIL, str(refused.value))


def test_negative_control_a_node_cache_of_this_user_passes_both(tmp_path: Path) -> None:
    path = str(tmp_path / "node.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    try:
        check = check_node_cache_socket(path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(path)
            check_service_peer(client, path)  # the engine trusts it too
    finally:
        server.close()
    assert check.verdict == OK, check.detail
    gone = check_node_cache_socket(str(tmp_path / "none.sock"))
    assert gone.verdict == WARN and "serves without it" in gone.detail  # the engine starts and attaches later


def test_weights_nothing_names_are_refused_by_both_with_a_tier_that_outlives_the_engine(engine_refusal,
                                                                                         tmp_path: Path) -> None:
    from .vllm_cpu import tiny_model_dir

    bare = tmp_path / "config-only"  # a model directory without weight files: nothing names its weights
    bare.mkdir()
    (bare / "config.json").write_text((Path(tiny_model_dir()) / "config.json").read_text())
    env = {"PYTHONHASHSEED": SEED}
    extra = {"disk_path": private_dir(tmp_path, "kv"), "disk_bytes": "64MiB"}
    refused = engine_refusal(env, model_dir=str(bare), **extra)
    check = check_weights(str(bare), load_config(extra, env))
    assert refused and (check.verdict, check.detail) == (FAIL, refused)
    # the negative control: the host arena alone runs such weights, and doctor only warns
    assert engine_refusal(env, model_dir=str(bare)) == ""
    assert check_weights(str(bare), load_config({}, env)).verdict == WARN
