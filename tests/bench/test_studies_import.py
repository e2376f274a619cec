"""Every study under tools/bench/studies imports on a CPU machine (they run by hand, so an import that rotted after
a move would otherwise be found only on the next GPU session)."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil

import pytest

import lmcache_npu.tools.bench.studies as studies

NAMES = sorted(info.name for info in pkgutil.iter_modules(studies.__path__))


def test_the_studies_are_found() -> None:
    assert {"cuda_matrix", "policy_sim", "chunk_size_cost"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_study_imports(name: str) -> None:
    try:
        importlib.import_module(f"{studies.__name__}.{name}")
    except ModuleNotFoundError as exc:  # a study of the connector needs vLLM: the GPU host has none, CI has it
        if exc.name != "vllm" or importlib.util.find_spec("vllm") is not None:
            raise
        pytest.skip(f"study {name} needs vLLM, which is not installed here")
