"""What the dynamic loader will see in a built library: RUNPATH, NEEDED resolution, undefined symbols.

Each check returns a CheckResult (passed, one-line summary, details) instead of raising, so the tool can print a
table and the tests can assert on the failure a negative control must produce.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# Symbols the C/C++ runtime provides; they are looked up in the real system libraries, never guessed by name.
SYSTEM_LIBRARY_PREFIXES = ("libc.so", "libstdc++.so", "libgcc_s.so", "libm.so", "libdl.so", "libpthread.so",
                           "ld-linux")
PYTHON_C_API = re.compile(r"^_?Py")  # provided by the interpreter that imports the module


@dataclass
class CheckResult:
    name: str
    passed: bool
    summary: str
    details: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "passed": self.passed, "summary": self.summary, "details": self.details}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> "CheckResult":
        details = data["details"]
        assert isinstance(details, list)
        return cls(str(data["name"]), bool(data["passed"]), str(data["summary"]), [str(d) for d in details])


@dataclass(frozen=True)
class DynamicSection:
    needed: tuple[str, ...]
    runpath: tuple[str, ...]
    rpath: tuple[str, ...]


def dynamic_section(library: Path) -> DynamicSection:
    out = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    runpath = re.findall(r"\(RUNPATH\)\s+Library runpath: \[([^\]]*)\]", out)
    rpath = re.findall(r"\(RPATH\)\s+Library rpath: \[([^\]]*)\]", out)
    split = lambda entries: tuple(p for e in entries for p in e.split(":") if p)  # noqa: E731
    return DynamicSection(tuple(needed), split(runpath), split(rpath))


def check_search_path(library: Path, required: list[str]) -> CheckResult:
    """The library's RUNPATH (or legacy RPATH) holds each required entry literally (e.g. `$ORIGIN`)."""
    section = dynamic_section(library)
    entries = section.runpath or section.rpath
    tag = "RUNPATH" if section.runpath else "RPATH" if section.rpath else "no RUNPATH/RPATH"
    missing = [r for r in required if r not in entries]
    shown = ":".join(entries) if entries else "-"
    if missing:
        return CheckResult(f"runpath {library.name}", False, f"{tag} [{shown}] lacks {', '.join(missing)}",
                           [f"readelf -d {library}: {tag} [{shown}]"])
    return CheckResult(f"runpath {library.name}", True, f"{tag} [{shown}]")


def check_no_search_path(library: Path) -> CheckResult:
    """The library has no RUNPATH or RPATH at all. For the AscendC kernel library: CANN's ascendc_library re-links it
    from link.txt without a shell, so any RUNPATH CMake gives it arrives shell-quoted, e.g. the literal "\\$ORIGIN"."""
    section = dynamic_section(library)
    tag = "RUNPATH" if section.runpath else "RPATH" if section.rpath else ""
    if not tag:
        return CheckResult(f"runpath {library.name}", True, "no RUNPATH/RPATH (needs none)")
    entries = section.runpath or section.rpath
    shown = ":".join(entries)
    garbled = any(c in shown for c in "\"'\\")  # shell quoting only a shell would have removed
    why = "garbled by CANN's re-link of link.txt without a shell; " if garbled else ""
    return CheckResult(f"runpath {library.name}", False, f"{tag} [{shown}]: {why}the kernel library must have none",
                       [f"readelf -d {library}: {tag} [{shown}]"])


def ldd_map(library: Path, ld_library_path: list[Path]) -> dict[str, str | None]:
    """soname -> resolved path (None: not found), as the loader resolves them with this LD_LIBRARY_PATH."""
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join(str(p) for p in ld_library_path)}
    out = subprocess.run(["ldd", str(library)], capture_output=True, text=True, env=env).stdout
    resolved: dict[str, str | None] = {}
    for line in out.splitlines():
        match = re.match(r"\s*(\S+) => (not found|(\S+))", line)
        if match:
            resolved[match.group(1)] = None if match.group(2) == "not found" else match.group(3)
        elif match := re.match(r"\s*(/\S+) \(0x", line):  # the dynamic loader itself, named by its path
            resolved[Path(match.group(1)).name] = match.group(1)
    return resolved


def check_needed_resolve(library: Path, ld_library_path: list[Path]) -> CheckResult:
    """Every NEEDED of the library itself resolves; what its dependencies need in turn (libtorch_npu's libhccl and
    driver libraries, libtorch's CUDA parts) is theirs, not ours, and is only listed."""
    needed = dynamic_section(library).needed
    resolved = ldd_map(library, ld_library_path)
    missing = [n for n in needed if resolved.get(n, "absent") is None]
    indirect = sorted(n for n, path in resolved.items() if path is None and n not in needed)
    details = [f"{n} => {resolved.get(n)}" for n in needed]
    if indirect:
        details.append(f"not found, needed by dependencies only (ignored): {', '.join(indirect)}")
    if missing:
        return CheckResult(f"NEEDED {library.name}", False, f"not found: {', '.join(missing)}", details)
    return CheckResult(f"NEEDED {library.name}", True, f"{len(needed)} NEEDED resolve", details)


def _nm_symbols(library: Path, *flags: str) -> list[tuple[str, str]]:
    """(type letter, name without @version) of the dynamic symbol table."""
    out = subprocess.run(["nm", "-D", *flags, str(library)], capture_output=True, text=True, check=True).stdout
    symbols = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            symbols.append((parts[-2], parts[-1].split("@", 1)[0]))
    return symbols


def defined_symbols(library: Path) -> set[str]:
    return {name for _, name in _nm_symbols(library, "--defined-only")}


def system_libraries(library: Path) -> list[Path]:
    """The C/C++ runtime libraries the library loads on this machine (from ldd, so the real ones)."""
    found = []
    for soname, path in ldd_map(library, []).items():
        if path and soname.startswith(SYSTEM_LIBRARY_PREFIXES):
            found.append(Path(path))
    return found


def demangle(names: list[str]) -> list[str]:
    if not names:
        return []
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def check_symbols_resolve(library: Path, providers: list[Path]) -> CheckResult:
    """Every undefined (strong) dynamic symbol of the library is defined by one of the providers, the C/C++ runtime,
    or is Python's C API; anything else would fail at import (or at first call, with lazy binding)."""
    undefined = sorted({name for kind, name in _nm_symbols(library, "--undefined-only") if kind == "U"})
    provided_by: dict[str, str] = {}  # symbol -> the first library that defines it
    labelled = [*((p, p.name) for p in providers), *((s, "C/C++ runtime") for s in system_libraries(library))]
    for provider, label in labelled:
        for name in defined_symbols(provider):
            provided_by.setdefault(name, label)
    for name in undefined:
        if name not in provided_by and PYTHON_C_API.match(name):
            provided_by[name] = "Python C API"
    unresolved = [name for name in undefined if name not in provided_by]
    provider_names = ", ".join(p.name for p in providers)
    if unresolved:
        shown = demangle(unresolved)
        return CheckResult(f"symbols {library.name}", False,
                           f"{len(unresolved)} undefined symbol(s) no library exports: {shown[0]}"
                           + (f" (+{len(shown) - 1} more)" if len(shown) > 1 else ""),
                           [f"unresolved: {s}" for s in shown] + [f"searched: {provider_names}"])
    counts: dict[str, int] = {}
    for name in undefined:
        counts[provided_by[name]] = counts.get(provided_by[name], 0) + 1
    by_provider = ", ".join(f"{label} {n}" for label, n in sorted(counts.items(), key=lambda item: -item[1]))
    return CheckResult(f"symbols {library.name}", True, f"{len(undefined)} undefined symbols resolve"
                       + (f": {by_provider}" if by_provider else ""), [f"searched: {provider_names}"])
