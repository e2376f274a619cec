"""Tier results are typed (`Failure`) and render the same reason text completions and logs always carried; the
`TierStore` protocol tells a tier from something that is not one."""

from __future__ import annotations

import pytest

from lmcache_npu.store.tier import OK, Failure, TierCounters, TierResult, TierStore

# every kind, with the text the serving path wrote before results were typed
REASONS = {
    Failure.MISS: (TierResult.fail(Failure.MISS), "miss"),
    Failure.CORRUPT: (TierResult.fail(Failure.CORRUPT, "length"), "corrupt: length"),
    Failure.UNTRUSTED: (TierResult.fail(Failure.UNTRUSTED, "symlink"), "untrusted: symlink"),
    Failure.IO: (TierResult.fail(Failure.IO, "Input/output error"), "io: Input/output error"),
    Failure.DISK_FULL: (TierResult.fail(Failure.DISK_FULL), "disk full"),
    Failure.CLOSED: (TierResult.fail(Failure.CLOSED), "closed"),
    Failure.QUEUE_FULL: (TierResult.fail(Failure.QUEUE_FULL), "queue full"),
    Failure.CAPACITY: (TierResult.fail(Failure.CAPACITY), "capacity"),
    Failure.CANCELLED: (TierResult.fail(Failure.CANCELLED), "cancelled"),
    Failure.SUPERSEDED: (TierResult.fail(Failure.SUPERSEDED), "superseded"),
    Failure.UNAVAILABLE: (TierResult.fail(Failure.UNAVAILABLE), "unavailable"),
    Failure.PUT: (TierResult.fail(Failure.PUT, "name exists with other contents"),
                  "put: name exists with other contents"),
    Failure.PUT_ERROR: (TierResult.fail(Failure.PUT_ERROR, "-600"), "put error -600"),
    Failure.GET_ERROR: (TierResult.fail(Failure.GET_ERROR, "-900"), "get error -900"),
    Failure.REJECTED: (TierResult.fail(Failure.REJECTED, "digest"), "rejected: digest"),
    Failure.ERROR: (TierResult.fail(Failure.ERROR, "boom"), "error: boom"),
    Failure.DEVICE: (TierResult.fail(Failure.DEVICE, "no block window for this command"),
                     "device: no block window for this command"),
    Failure.SHARE: (TierResult.fail(Failure.SHARE, "peer gone"), "share: peer gone"),
    Failure.NO_DISK_TIER: (TierResult.fail(Failure.NO_DISK_TIER), "no disk tier"),
    Failure.NO_REMOTE_TIER: (TierResult.fail(Failure.NO_REMOTE_TIER), "no remote tier"),
    Failure.NO_DEVICE_MOVER: (TierResult.fail(Failure.NO_DEVICE_MOVER), "no device mover"),
    Failure.UNKNOWN_COMMAND: (TierResult.fail(Failure.UNKNOWN_COMMAND, "Frobnicate"), "unknown command Frobnicate"),
}


def test_every_failure_kind_has_its_reason_text_pinned() -> None:
    assert set(REASONS) == set(Failure)


@pytest.mark.parametrize("kind", list(Failure))
def test_the_reason_renders_the_text_of_before(kind: Failure) -> None:
    result, text = REASONS[kind]
    assert result.reason == text and not result.ok and result.kind is kind
    # negative control: another detail renders another text
    assert TierResult.fail(kind, "other").reason != text


def test_ok_has_no_kind_and_no_reason() -> None:
    assert OK.ok and OK.kind is None and OK.reason == "" and OK == TierResult(True)


@pytest.mark.parametrize("ok, kind", [(True, Failure.MISS), (False, None), (False, "miss")])
def test_a_result_whose_ok_and_kind_disagree_is_refused(ok: bool, kind: object) -> None:
    with pytest.raises(ValueError):
        TierResult(ok, kind)  # type: ignore[arg-type]


def test_a_producer_still_passing_text_is_refused_at_once() -> None:
    with pytest.raises(ValueError):
        TierResult.fail("miss")  # type: ignore[arg-type]


def test_the_store_protocol_needs_counters_and_close() -> None:
    class CountersOnly:
        counters = TierCounters()

    class CloseOnly:
        def close(self) -> None: ...

    class Both(CountersOnly, CloseOnly):
        pass

    assert isinstance(Both(), TierStore)
    assert not isinstance(CountersOnly(), TierStore) and not isinstance(CloseOnly(), TierStore)
    assert not isinstance(object(), TierStore)
