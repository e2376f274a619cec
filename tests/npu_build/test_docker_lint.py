"""The image recipes import nothing at build time and always source CANN's environment (research findings B2, B3):
`docker build` has no driver, so `import torch` (which autoloads torch_npu) or loading _npu (whose AscendC stub asks the
device for its SoC) fails or aborts there; and the vllm-ascend image sets ASCEND_HOME_PATH without the rest of
set_env.sh, so a set_env.sh guarded by it is never sourced. The Ascend image builds for the base image's own
SOC_VERSION unless a build argument names another (F13): no ENV or ARG default of ours replaces it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = [*sorted((ROOT / "docker").glob("Dockerfile.*")), ROOT / "docker" / "install.sh"]
# The CUDA image imports its own module after the build, as it always has: there is no torch_npu in it, so torch
# imports without a driver, and _cuda's libcudart loads without a GPU. Nothing else may import.
ALLOWED_IMPORTS = {("Dockerfile.cuda", "import lmcache_npu._cuda")}

_IMPORT = re.compile(r"\b(?:import\s+(?:torch|torch_npu|lmcache_npu)\b[\w.]*"
                     r"|from\s+(?:torch|torch_npu|lmcache_npu)[\w.]*\s+import\b"
                     r"|find_spec\(\s*f?[\"']lmcache_npu\.|import_module\(\s*[\"'](?:torch|lmcache_npu))")
_SOURCE = re.compile(r"(?:^|[;&|]|\bthen|\bdo|\belse)\s*(?:source|\.)\s+\S")


def code_lines(path: Path) -> list[str]:
    """The recipe's lines without comments (a shell or Dockerfile comment starts the line)."""
    return [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]


def instructions(path: Path) -> list[str]:
    """The recipe's code lines with backslash continuations joined: one entry per Dockerfile instruction."""
    joined, pending = [], ""
    for line in code_lines(path):
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
        else:
            joined.append(pending)
            pending = ""
    return [*joined, pending] if pending else joined


_SETS_SOC = re.compile(r"^(?:ENV\b.*(?:\s)SOC_VERSION(?:=|\s)|ARG\s+SOC_VERSION\s*=)")


def soc_version_overrides(path: Path) -> list[str]:
    """Instructions that replace the base image's own SOC_VERSION: an ENV setting it, or an ARG default (which
    BuildKit puts into every later RUN's environment over the base image's ENV)."""
    return [i for i in instructions(path) if _SETS_SOC.search(i)]


def build_time_imports(path: Path) -> list[str]:
    found = []
    for line in code_lines(path):
        for match in _IMPORT.finditer(line):
            if (path.name, match.group(0)) not in ALLOWED_IMPORTS:
                found.append(f"{path.name}: {line.strip()}")
    return found


def sources(line: str) -> bool:
    """A `source` or `.` statement (whatever it sources: the script sources set_env.sh through a variable)."""
    return bool(_SOURCE.search(line))


def guarded_set_env(path: Path) -> list[str]:
    """Statements that source a file under a condition on ASCEND_HOME_PATH (on the line or in an enclosing `if`):
    nothing but CANN's set_env.sh is sourced by a recipe."""
    conditions: list[str] = []
    found = []
    for line in code_lines(path):
        stripped = line.strip()
        if re.match(r"(if|elif)\b", stripped):
            conditions = conditions[:-1] if stripped.startswith("elif") else conditions
            conditions.append(stripped)
        if sources(stripped):
            guards = [*conditions, stripped]
            if any("ASCEND_HOME_PATH" in g for g in guards):
                found.append(f"{path.name}: {stripped}")
        if re.match(r"fi\b", stripped) or stripped.endswith("; fi") or stripped == "fi":
            conditions = conditions[:-1]
        elif re.match(r"if\b", stripped) and re.search(r"\bfi\s*$", stripped):
            conditions = conditions[:-1]  # a one-line if closes itself
    return found


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_no_recipe_imports_torch_or_our_modules_at_build_time(recipe: Path) -> None:
    assert not build_time_imports(recipe)


def test_install_script_sources_set_env_unconditionally() -> None:
    install = ROOT / "docker" / "install.sh"
    assert not guarded_set_env(install)
    assert any(sources(line.strip()) for line in code_lines(install))
    text = "\n".join(code_lines(install))
    for location in ("/usr/local/Ascend/cann/set_env.sh", "/usr/local/Ascend/ascend-toolkit/set_env.sh"):
        assert location in text  # CANN 8.5+ and the older toolkit layout


def test_install_script_builds_with_devlib_and_without_autoload() -> None:
    text = "\n".join(code_lines(ROOT / "docker" / "install.sh"))
    assert "devlib" in text and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in text
    assert "readelf -d" in text and "ldd -r" in text


def test_the_ascend_image_requires_npu_and_does_not_import_it() -> None:
    lines = "\n".join(code_lines(ROOT / "docker" / "Dockerfile.ascend"))
    assert "REQUIRE_MODULES=_npu" in lines and "import lmcache_npu._npu" not in lines


def test_the_ascend_image_builds_for_the_base_images_soc() -> None:
    dockerfile = ROOT / "docker" / "Dockerfile.ascend"
    assert not soc_version_overrides(dockerfile)
    assert "ARG SOC_VERSION" in instructions(dockerfile)  # declared without a default: --build-arg still works
    [run] = [i for i in instructions(dockerfile) if "install.sh" in i]
    assert run.startswith('RUN env ${SOC_VERSION:+SOC_VERSION="$SOC_VERSION"} '), run


@pytest.mark.parametrize("recipe, expected", [
    ("ARG SOC_VERSION=ascend910b1\nENV SOC_VERSION=${SOC_VERSION}\n",
     ["ARG SOC_VERSION=ascend910b1", "ENV SOC_VERSION=${SOC_VERSION}"]),  # the recipe before F13
    ("ENV TASK_QUEUE_ENABLE=1 \\\n    SOC_VERSION=$SOC_VERSION\n",
     ["ENV TASK_QUEUE_ENABLE=1 SOC_VERSION=$SOC_VERSION"]),  # vllm-ascend's own form, continued
    ("ENV SOC_VERSION ascend910b1\n", ["ENV SOC_VERSION ascend910b1"]),
    ("ARG SOC_VERSION\nRUN echo ${SOC_VERSION}\nENV X=${SOC_VERSION}\n", []),
])
def test_negative_control_soc_version_overrides_are_found(tmp_path: Path, recipe: str, expected: list[str]) -> None:
    path = tmp_path / "Dockerfile"
    path.write_text("FROM base\n# ENV SOC_VERSION=x in a comment is fine\n" + recipe)
    assert soc_version_overrides(path) == expected


@pytest.mark.parametrize("recipe, expected", [
    ("RUN python3 -c \"import lmcache_npu._npu\"\n", "import lmcache_npu._npu"),
    ("\"$PYTHON\" - <<'PY'\nimport torch\nPY\n", "import torch"),
    ("python3 -c 'from lmcache_npu.ops import plan'\n", "from lmcache_npu.ops import"),
    ("python3 -c 'import importlib.util as u; u.find_spec(\"lmcache_npu._npu\")'\n", "find_spec(\"lmcache_npu."),
])
def test_negative_control_imports_are_found(tmp_path: Path, recipe: str, expected: str) -> None:
    path = tmp_path / "install.sh"
    path.write_text("# import torch in a comment is fine\n" + recipe)
    [found] = build_time_imports(path)
    assert expected in found


@pytest.mark.parametrize("script", [
    'if [[ -z ${ASCEND_HOME_PATH:-} && -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]]; then\n'
    '  set +u; source /usr/local/Ascend/ascend-toolkit/set_env.sh; set -u\nfi\n',
    '[[ -n ${ASCEND_HOME_PATH:-} ]] || source /usr/local/Ascend/cann/set_env.sh\n',
    'if [ -z "$ASCEND_HOME_PATH" ]; then . /usr/local/Ascend/cann/set_env.sh; fi\n',
])
def test_negative_control_a_guarded_set_env_is_found(tmp_path: Path, script: str) -> None:
    path = tmp_path / "install.sh"
    path.write_text(script)
    assert guarded_set_env(path)
