"""The NPU suite's skip-or-fail rule (tests/npu/marks.py), driven on x86 with fakes and with real shared objects that
do not load: a card host with a broken `_npu` must fail, a host without a card must skip (finding T1)."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any, Optional

import pytest

import lmcache_npu

from .marks import FAIL, NPU_MODULE, RUN, SKIP, enforce, npu_module_status, skip_or_fail, status

EXT = sysconfig.get_config_var("EXT_SUFFIX")
_ABSENT = object()


def specs(*present: str):
    """A find_spec that finds only the named modules."""
    return lambda name: object() if name in present else None


def importer(error: Optional[BaseException] = None, calls: Optional[list] = None):
    def import_module(name: str) -> Any:
        if calls is not None:
            calls.append(name)
        if error is not None:
            raise error
        return object()
    return import_module


def test_no_torch_npu_skips_with_the_reason_and_imports_nothing() -> None:
    calls: list = []
    verdict, reason = npu_module_status(specs(NPU_MODULE), importer(calls=calls), lambda: True)
    assert verdict == SKIP and "no torch_npu" in reason and calls == []


def test_no_visible_card_skips_with_the_reason_and_imports_nothing() -> None:
    calls: list = []
    verdict, reason = npu_module_status(specs("torch_npu", NPU_MODULE), importer(calls=calls), lambda: False)
    assert verdict == SKIP and "no Ascend NPU is visible" in reason and calls == []


def test_a_card_without_the_module_fails() -> None:
    verdict, reason = npu_module_status(specs("torch_npu"), importer(), lambda: True)
    assert verdict == FAIL and "is not built" in reason


def test_a_card_with_a_module_that_does_not_load_fails_with_the_import_error() -> None:
    error = ImportError("liblmcache_npu_kernels.so: cannot open shared object file: No such file or directory")
    verdict, reason = npu_module_status(specs("torch_npu", NPU_MODULE), importer(error), lambda: True)
    assert verdict == FAIL and "liblmcache_npu_kernels.so: cannot open shared object file" in reason
    assert "ImportError" in reason


def test_a_card_with_a_loading_module_runs() -> None:  # the negative control of the two above
    calls: list = []
    assert npu_module_status(specs("torch_npu", NPU_MODULE), importer(calls=calls), lambda: True) == (RUN, "")
    assert calls == [NPU_MODULE]


def test_this_machine_without_torch_npu_skips() -> None:
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here: the verdict depends on the card")
    assert status()[0] == SKIP


def test_enforce_and_skip_or_fail() -> None:
    with pytest.raises(pytest.skip.Exception, match="no card"):
        enforce(SKIP, "no card")
    with pytest.raises(pytest.fail.Exception, match="broken"):
        enforce(FAIL, "broken")
    enforce(RUN, "")  # runs on
    with pytest.raises(pytest.fail.Exception, match="npu backend is unavailable: no runtime"):
        skip_or_fail("no runtime", visible=lambda: True)
    with pytest.raises(pytest.skip.Exception, match="no runtime"):
        skip_or_fail("no runtime", visible=lambda: False)


def _compile(source: str, out: Path, *flags: str) -> None:
    c = out.with_suffix(".c")
    c.write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(c), *flags], check=True, capture_output=True)


@pytest.fixture
def package_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory searched first for `lmcache_npu.<name>` (where `import lmcache_npu._npu` looks), nothing cached."""
    monkeypatch.setattr(lmcache_npu, "__path__", [str(tmp_path), *lmcache_npu.__path__])
    monkeypatch.delitem(sys.modules, NPU_MODULE, raising=False)  # restored (if it was there) after the test
    attribute = lmcache_npu.__dict__.get("_npu", _ABSENT)
    yield tmp_path
    sys.modules.pop(NPU_MODULE, None)  # a module loaded from tmp_path must not outlive the test
    if attribute is _ABSENT:
        lmcache_npu.__dict__.pop("_npu", None)
    else:
        lmcache_npu._npu = attribute  # type: ignore[attr-defined]


def _real_status() -> tuple[str, str]:
    """The real find_spec and import, on a machine that pretends to have torch_npu and a card."""
    find_spec = lambda name: object() if name == "torch_npu" else importlib.util.find_spec(name)  # noqa: E731
    return npu_module_status(find_spec, importlib.import_module, lambda: True)


@pytest.mark.skipif(EXT is None, reason="no extension suffix")
def test_an_so_that_is_no_python_module_is_found_but_fails(package_dir: Path) -> None:
    _compile("int lmcache_npu_not_a_module(void) { return 1; }\n", package_dir / f"_npu{EXT}")
    assert importlib.util.find_spec(NPU_MODULE) is not None  # what the old mark looked at: "present"
    verdict, reason = _real_status()
    assert verdict == FAIL and "does not load" in reason and "PyInit__npu" in reason, reason


@pytest.mark.skipif(EXT is None, reason="no extension suffix")
def test_an_so_with_a_missing_needed_library_fails_naming_it(package_dir: Path, tmp_path: Path) -> None:
    libs = tmp_path / "libs"
    libs.mkdir()
    _compile("int lmcache_npu_gone(void) { return 2; }\n", libs / "liblmcache_npu_gone.so")
    _compile("int lmcache_npu_gone(void);\nint f(void) { return lmcache_npu_gone(); }\n", package_dir / f"_npu{EXT}",
             f"-L{libs}", "-llmcache_npu_gone")
    (libs / "liblmcache_npu_gone.so").unlink()  # B1: the library next to _npu is not found at load time
    verdict, reason = _real_status()
    assert verdict == FAIL and "liblmcache_npu_gone.so" in reason, reason


def test_a_module_that_loads_in_the_same_place_runs(package_dir: Path) -> None:  # negative control of the two above
    (package_dir / "_npu.py").write_text("LOADED = True\n")
    assert _real_status() == (RUN, "")


FAKE_TORCH_NPU = '''"""A stand-in torch_npu that reports one visible card and nothing else (tests/npu/test_marks.py)."""
import torch


class _Npu:
    is_available = staticmethod(lambda: True)
    device_count = staticmethod(lambda: 1)
    set_device = staticmethod(lambda index: None)


torch.npu = _Npu()
'''


def _run_suite(tmp_path: Path, fake_card: bool) -> subprocess.CompletedProcess[str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    if fake_card:
        (tmp_path / "torch_npu").mkdir()
        (tmp_path / "torch_npu" / "__init__.py").write_text(FAKE_TORCH_NPU)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    files = ["tests/npu/test_staging_npu.py", "tests/npu/test_conformance_npu.py"]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rsE", *files],
                          cwd=TESTS_ROOT, env=env, capture_output=True, text=True, timeout=300)


TESTS_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None or importlib.util.find_spec(NPU_MODULE)
                    is not None, reason="needs a machine without torch_npu and without lmcache_npu._npu")
def test_the_suite_errors_on_a_card_without_npu_and_skips_without_a_card(tmp_path: Path) -> None:
    card = _run_suite(tmp_path, fake_card=True)
    assert card.returncode == 1 and "2 errors" in card.stdout and "skipped" not in card.stdout, card.stdout
    assert "lmcache_npu._npu is not built" in card.stdout, card.stdout
    no_card = _run_suite(tmp_path / "none", fake_card=False)  # the control: this machine as it is
    assert no_card.returncode == 0 and "2 skipped" in no_card.stdout and "no torch_npu" in no_card.stdout, \
        no_card.stdout
