"""The store secret file (finding N6): a regular file, not a symlink, owned by the effective uid, accessible to no
one else, at most 4 KiB, never blocking on a FIFO or device; every refusal names the path, the rule and the fix, and
the secret never reaches a log or an error."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from lmcache_npu.store import secret as secret_module
from lmcache_npu.store.envelope import Sealer
from lmcache_npu.store.secret import MAX_SECRET_FILE_BYTES, SECRET_ENV, resolve_secret

SECRET = b"a-store-secret-of-enough-bytes-0123456789"


def _secret_file(path, content: bytes = SECRET + b"\n", mode: int = 0o600) -> str:
    path.write_bytes(content)
    os.chmod(path, mode)
    return str(path)


def _refused(path: str, *fragments: str) -> str:
    with pytest.raises(ValueError) as refusal:
        resolve_secret(path, {})
    text = str(refusal.value)
    assert repr(path) in text, text  # names the path
    for fragment in fragments:
        assert fragment in text, text
    assert SECRET.decode() not in text
    return text


def _in_thread(target, timeout_s: float = 10.0) -> tuple[bool, dict]:
    """Runs `target` on a daemon thread; (finished within the timeout, what it stored)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = target()
        except Exception as exc:  # noqa: BLE001 - the test inspects whatever it raised
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive(), outcome


def _release_reader(fifo: str) -> None:
    """A writer that opens and closes at once: a reader blocked in open() or read() of the FIFO gets EOF."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader is waiting


def test_a_private_regular_file_of_ours_is_accepted_and_never_logged(tmp_path, caplog):
    """The negative control: a good 0600 (or 0400) file owned by us gives its stripped bytes."""
    caplog.set_level(logging.DEBUG)
    path = _secret_file(tmp_path / "secret")
    assert os.stat(path).st_uid == os.geteuid()
    assert resolve_secret(path, {}) == SECRET
    os.chmod(path, 0o400)
    assert resolve_secret(path, {}) == SECRET
    assert f"secret: configured (from file {path})" in caplog.text
    assert SECRET.decode() not in caplog.text
    assert SECRET.decode() not in repr(Sealer(resolve_secret(path, {})))
    exact = _secret_file(tmp_path / "exact", b"s" * MAX_SECRET_FILE_BYTES)  # the cap itself is allowed
    assert resolve_secret(exact, {}) == b"s" * MAX_SECRET_FILE_BYTES


def test_a_symlink_is_refused_even_to_a_good_file(tmp_path):
    target = _secret_file(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(target)
    _refused(str(link), "is a symlink", "not at a link")
    assert resolve_secret(target, {}) == SECRET  # control: the file itself is fine


def test_a_fifo_is_refused_at_once_without_waiting_for_a_writer(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo, 0o600)
    finished, outcome = _in_thread(lambda: resolve_secret(fifo, {}))
    if not finished:
        _release_reader(fifo)
        pytest.fail("resolve_secret blocked on a FIFO")
    error = outcome.get("error")
    assert isinstance(error, ValueError), outcome
    assert repr(fifo) in str(error) and "is not a regular file (it is a FIFO)" in str(error)


def test_the_fifo_check_can_see_a_blocking_open(tmp_path):
    """Negative control for the test above: a plain open() of the same FIFO (what the old code did) blocks, and the
    harness notices and releases it."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo, 0o600)

    def plain_read() -> bytes:
        with open(fifo, "rb") as handle:
            return handle.read()

    finished, _ = _in_thread(plain_read, timeout_s=0.5)
    assert not finished, "a plain open of a FIFO with no writer returned: the FIFO test above would prove nothing"
    _release_reader(fifo)


def test_a_device_is_refused_without_reading_it():
    _refused("/dev/zero", "is not a regular file (it is a character device)")


def test_a_directory_is_refused(tmp_path):
    _refused(str(tmp_path), "is not a regular file (it is a directory)")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o620, 0o602, 0o660, 0o610])
def test_a_file_others_can_access_is_refused(tmp_path, mode):
    path = _secret_file(tmp_path / "secret", mode=mode)
    _refused(path, f"mode {mode:04o}", "group or others", f"chmod 600 {path}")


def test_a_file_owned_by_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root (chown); the uid rule is also checked, without root, "
                    "by test_the_owner_must_be_the_effective_uid")
    path = _secret_file(tmp_path / "secret")
    os.chown(path, 65534, -1)
    _refused(path, "owned by uid 65534", f"uid {os.geteuid()}", "chown")


def test_the_owner_must_be_the_effective_uid(tmp_path, monkeypatch):
    """Without root: the file is ours, so a service running as another uid (geteuid patched) must refuse it."""
    path = _secret_file(tmp_path / "secret")
    owner = os.stat(path).st_uid
    monkeypatch.setattr(secret_module.os, "geteuid", lambda: owner + 1)
    _refused(path, f"owned by uid {owner}", f"uid {owner + 1}", "chown")


def test_a_file_over_4_kib_is_refused(tmp_path):
    path = _secret_file(tmp_path / "secret", b"s" * (MAX_SECRET_FILE_BYTES + 1))
    _refused(path, f"holds {MAX_SECRET_FILE_BYTES + 1} bytes", "write only the secret")


def test_a_file_that_grows_after_its_check_is_read_no_further_than_the_cap(tmp_path, monkeypatch):
    """The read itself is capped: a file that passed fstat (patched to pass here) and holds 1 MiB is refused."""
    path = _secret_file(tmp_path / "secret", b"s" * (1 << 20))
    monkeypatch.setattr(secret_module, "_check_opened", lambda path, info: None)
    reads: list[int] = []
    real_read = os.read

    def counting_read(fd: int, size: int) -> bytes:
        reads.append(size)
        return real_read(fd, size)

    monkeypatch.setattr(secret_module.os, "read", counting_read)
    _refused(path, f"more than {MAX_SECRET_FILE_BYTES} bytes")
    assert sum(reads) <= MAX_SECRET_FILE_BYTES + 1, reads


@pytest.mark.parametrize("content", [b"", b" \n\t\n"])
def test_an_empty_file_is_refused(tmp_path, content):
    path = _secret_file(tmp_path / "secret", content)
    _refused(path, "holds 0 bytes", "at least 16")


def test_a_missing_file_is_refused_naming_it(tmp_path):
    _refused(str(tmp_path / "absent"), "cannot be read")


def test_the_variable_is_read_as_before(tmp_path):
    assert resolve_secret("", {SECRET_ENV: SECRET.decode() + "\n"}) == SECRET
    assert resolve_secret("", {}) is None
    with pytest.raises(ValueError, match=f"{SECRET_ENV} holds 3 bytes"):
        resolve_secret("", {SECRET_ENV: "abc"})
    # the file wins over the variable when both are set
    path = _secret_file(tmp_path / "secret", b"file-secret-0123456789")
    assert resolve_secret(path, {SECRET_ENV: SECRET.decode()}) == b"file-secret-0123456789"
