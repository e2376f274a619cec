"""One verdict of `lmcache-npu doctor`: a check's name, ok / warn / fail / skip, what it found and the fix. Its own
module so that the doctor's groups of checks (`doctor`, `doctor_refusals`) share it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str
    detail: str
    fix: str = ""
