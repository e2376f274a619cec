"""`WorkerGeometry.agree`: the ranks' handshakes give one plan, or the engine is refused with what differs."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from lmcache_npu.integration.vllm.metadata import WorkerGeometry, usable_on_every_rank


def _rank(rank: int, **changes: object) -> WorkerGeometry:
    plain = WorkerGeometry(rank, 2, enabled=True, namespace="a" * 32, layout_fingerprint=b"layout", chunk_tokens=256,
                           object_bytes=4096, num_slots=100 + rank, identity=(("weights", "w1"),))
    return dataclasses.replace(plain, **changes)


def test_agreeing_ranks_give_the_lowest_ranks_plan_with_the_fewest_slots() -> None:
    agreed = WorkerGeometry.agree([_rank(1), _rank(0)], world=2)
    assert agreed == _rank(0, num_slots=100)
    assert WorkerGeometry.agree([_rank(1, num_slots=7), _rank(0)], world=2) == _rank(0, num_slots=7)


def test_a_missing_rank_is_refused() -> None:
    with pytest.raises(ValueError, match=r"expected handshakes from ranks 0\.\.1, got \[0\]"):
        WorkerGeometry.agree([_rank(0)], world=2)


def test_a_rank_that_moves_nothing_makes_the_engine_idle_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="lmcache_npu")
    idle = WorkerGeometry(1, 2, enabled=False, reason="every group skipped")
    assert WorkerGeometry.agree([_rank(0), idle], world=2) is None
    assert "lmcache_npu is idle: every group skipped" in caplog.text


@pytest.mark.parametrize("changes, message", [
    ({"namespace": "b" * 32, "identity": (("weights", "w2"),)}, r"rank 1 runs another model identity .*weights"),
    ({"namespace": "b" * 32}, r"rank 1 runs another model identity .*the fingerprint"),
    ({"object_bytes": 8192}, r"rank 1 lays chunks out differently .*8192 B vs 4096 B"),
    ({"chunk_tokens": 512}, r"rank 1 lays chunks out differently"),
    ({"namespace": "b" * 32, "layout_fingerprint": b"other"}, r"rank 1 lays chunks out differently"),
])
def test_ranks_that_differ_are_refused_with_what_differs(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerGeometry.agree([_rank(0), _rank(1, **changes)], world=2)


def test_usable_slots_are_those_live_on_every_rank_that_reported() -> None:
    assert usable_on_every_rank({0: ((0, 4), (6, 10)), 1: ((2, 8),)}, 10) == ((2, 4), (6, 8))
    assert usable_on_every_rank({0: ((0, 20),)}, 10) == ((0, 10),)  # a range past the arena ends with it
    assert usable_on_every_rank({}, 3) == ((0, 3),)  # control: no report, every slot usable
    assert usable_on_every_rank({0: ((0, 4),), 1: ((4, 8),)}, 10) == ()
