"""Rules the device suites keep, checked on x86 by reading their source (each rule with a negative control on a
made-up snippet):

* every hypothesis test under tests/npu and tests/cuda sets `deadline=None` in its own `@settings` (finding T3: a
  first example on a card carries the kernel binary's load; the `ci` profile of tests/conftest.py sets it too, but a
  run with another profile, or without the root conftest, must not turn that into DeadlineExceeded);
* an NPU fixture that catches `BackendUnavailable` calls `skip_or_fail`, never `pytest.skip` (finding T1);
* whatever asks for the npu backend makes the device current first (`select_device`, finding R1).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
SUITES = ("npu", "cuda")
# hypothesis tests allowed without deadline=None (none: every one sets it; a new offender fails at once)
KNOWN_WITHOUT_DEADLINE: frozenset[str] = frozenset()


def _name(node: ast.expr) -> str:
    """`given`, `hypothesis.given`, `settings(...)` -> the called or named function's last part."""
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _sets_no_deadline(decorator: ast.expr) -> bool:
    return isinstance(decorator, ast.Call) and any(
        k.arg == "deadline" and isinstance(k.value, ast.Constant) and k.value.value is None
        for k in decorator.keywords)


def hypothesis_without_deadline(source: str) -> list[str]:
    """Functions whose `@given` has no `@settings(deadline=None)`, or with a `@settings` that does not set it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = [_name(d) for d in node.decorator_list]
        settings = [d for d in node.decorator_list if _name(d) == "settings"]
        if ("given" in names or settings) and not any(_sets_no_deadline(d) for d in settings):
            found.append(node.name)
    return found


def _suite_files(suite: str) -> list[Path]:
    return sorted((TESTS / suite).glob("*.py"))


def test_the_lint_finds_a_missing_deadline() -> None:  # negative and positive controls of the lint itself
    bad = ("from hypothesis import given, settings\n@settings(max_examples=9)\n@given(x=1)\ndef test_a(x): pass\n"
           "@given(x=1)\ndef test_b(x): pass\n@hypothesis.settings(deadline=200)\n@hypothesis.given(x=1)\n"
           "def test_c(x): pass\n")
    good = "@settings(max_examples=9, deadline=None)\n@given(x=1)\ndef test_a(x): pass\ndef test_plain(): pass\n"
    assert hypothesis_without_deadline(bad) == ["test_a", "test_b", "test_c"]
    assert hypothesis_without_deadline(good) == []


@pytest.mark.parametrize("suite", SUITES)
def test_every_hypothesis_test_of_the_device_suites_sets_deadline_none(suite: str) -> None:
    found = {f"{suite}/{path.name}::{name}" for path in _suite_files(suite)
             for name in hypothesis_without_deadline(path.read_text())}
    known = {k for k in KNOWN_WITHOUT_DEADLINE if k.startswith(f"{suite}/")}
    assert not found - known, f"add deadline=None to @settings of: {sorted(found - known)}"
    assert not known - found, f"fixed, delete from KNOWN_WITHOUT_DEADLINE: {sorted(known - found)}"


def _handlers_of(tree: ast.AST, exception: str) -> list[ast.ExceptHandler]:
    return [h for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler) and h.type is not None
            and _name(h.type) == exception]


def skips_on_backend_unavailable(source: str) -> list[int]:
    """Lines where an `except BackendUnavailable` handler calls pytest.skip instead of skip_or_fail."""
    return [call.lineno for handler in _handlers_of(ast.parse(source), "BackendUnavailable")
            for call in ast.walk(handler) if isinstance(call, ast.Call) and _name(call) == "skip"]


def get_backend_before_select_device(source: str) -> list[str]:
    """Functions that call get_backend("npu") with no select_device call on an earlier line of the same function."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        calls = [c for c in ast.walk(node) if isinstance(c, ast.Call)]
        selects = [c.lineno for c in calls if _name(c) == "select_device"]
        for c in calls:
            is_npu = _name(c) == "get_backend" and c.args and isinstance(c.args[0], ast.Constant) \
                and c.args[0].value == "npu"
            if is_npu and not any(line < c.lineno for line in selects):
                found.append(node.name)
    return found


def test_the_fixture_lints_find_what_they_look_for() -> None:  # controls for the two lints below
    skipping = ("def f():\n    try:\n        return get_backend('npu')\n    except BackendUnavailable as e:\n"
                "        pytest.skip(str(e))\n")
    assert skips_on_backend_unavailable(skipping) == [5]
    assert skips_on_backend_unavailable(skipping.replace("pytest.skip", "skip_or_fail")) == []
    assert get_backend_before_select_device(skipping) == ["f"]
    assert get_backend_before_select_device(skipping.replace("    try:", "    select_device(0)\n    try:")) == []


@pytest.mark.parametrize("path", _suite_files("npu"), ids=lambda p: p.name)
def test_npu_fixtures_fail_on_a_card_and_select_the_device_first(path: Path) -> None:
    source = path.read_text()
    assert skips_on_backend_unavailable(source) == [], f"{path.name}: use skip_or_fail, not pytest.skip"
    assert get_backend_before_select_device(source) == [], f"{path.name}: call select_device(0) before get_backend"
