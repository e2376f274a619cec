"""Compiles _npu's sources with -fsyntax-only, exactly as the build does, and proves which headers they used.

The commands come from the build's compile_commands.json, so the flags, defines and include order are CMake's.
`-H` lists every header opened; each one is classified, and the check fails unless the ACL headers used are
byte-identical to the real ones from the torch_npu wheel (not a stub that would accept a wrong ACL call) and the
torch_npu and torch headers come from the real packages.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from build_checks.npu_build.elf_checks import CheckResult
from build_checks.npu_build.toolchain import Toolchain

_DROP_WITH_VALUE = {"-o", "-MT", "-MF", "-MQ"}
_DROP = {"-c", "-MD", "-MMD"}
_ACL_HEADER = re.compile(r"/acl/((?:error_codes/|ops/)?[^/]+\.h)$")  # acl/*.h as CANN installs them


@dataclass(frozen=True)
class CompileCommand:
    source: Path
    arguments: tuple[str, ...]
    directory: Path


@dataclass
class HeaderUse:
    real_acl: set[Path] = field(default_factory=set)
    foreign_acl: set[Path] = field(default_factory=set)
    torch_npu: set[Path] = field(default_factory=set)
    torch: set[Path] = field(default_factory=set)
    standin: set[Path] = field(default_factory=set)


def target_compile_commands(build_dir: Path, target: str = "_npu") -> list[CompileCommand]:
    """The target's entries of compile_commands.json (CMake names each object under CMakeFiles/<target>.dir/)."""
    entries = json.loads((build_dir / "compile_commands.json").read_text())
    marker = f"CMakeFiles/{target}.dir/"
    commands = []
    for entry in entries:
        if marker in entry.get("output", "") or marker in entry.get("command", ""):
            arguments = entry.get("arguments") or shlex.split(entry["command"])
            commands.append(CompileCommand(Path(entry["file"]), tuple(arguments), Path(entry["directory"])))
    return commands


def _flags_only(command: CompileCommand) -> list[str]:
    """The compile command without -c, -o, depfile flags and the source: compiler, flags, defines, includes."""
    arguments: list[str] = []
    skip_next = False
    for arg in command.arguments:
        if skip_next:
            skip_next = False
        elif arg in _DROP_WITH_VALUE:
            skip_next = True
        elif arg not in _DROP and arg != str(command.source):
            arguments.append(arg)
    return arguments


def syntax_only_arguments(command: CompileCommand, source: Path | None = None,
                          extra: tuple[str, ...] = ()) -> list[str]:
    """The same compilation, -fsyntax-only, listing each header opened (-H); the source optionally swapped."""
    return [*_flags_only(command), *extra, "-fsyntax-only", "-H", str(source or command.source)]


def object_arguments(command: CompileCommand, source: Path, output: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """The same compilation of another source into an object file."""
    return [*_flags_only(command), *extra, "-c", str(source), "-o", str(output)]


def opened_headers(stderr: str) -> list[Path]:
    return [Path(os.path.realpath(m)) for m in re.findall(r"^\.+ (\S+)$", stderr, re.MULTILINE)]


def compile_syntax_only(command: CompileCommand, source: Path | None = None,
                        extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(syntax_only_arguments(command, source, extra), cwd=command.directory, capture_output=True,
                          text=True)


def _under(path: Path, root: Path) -> bool:
    return path.is_relative_to(root.resolve())


def classify(headers: list[Path], toolchain: Toolchain, standin: Path) -> HeaderUse:
    use = HeaderUse()
    real_acl_root = toolchain.acl_headers.resolve()
    for header in headers:
        acl = _ACL_HEADER.search(str(header))
        if acl:
            real = real_acl_root / acl.group(1)
            identical = real.is_file() and filecmp.cmp(real, header, shallow=False)
            (use.real_acl if identical else use.foreign_acl).add(header)
        elif _under(header, toolchain.torch_npu_root / "include"):
            use.torch_npu.add(header)
        elif _under(header, toolchain.torch_root / "include"):
            use.torch.add(header)
        elif _under(header, standin) or header.name.startswith("aclrtlaunch_"):
            use.standin.add(header)
    return use


def check_real_headers(commands: list[CompileCommand], toolchain: Toolchain, standin: Path) -> CheckResult:
    """Every source compiles with -fsyntax-only; the ACL headers it opens are the real ones, byte for byte."""
    if not commands:
        return CheckResult("real-header compile", False, "no _npu sources in compile_commands.json")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(compile_syntax_only, commands))
    failures, use = [], HeaderUse()
    for command, result in zip(commands, results):
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if not line.startswith(".")]
            failures.append(f"{command.source.name}: " + "\n".join(errors[-25:]))
        found = classify(opened_headers(result.stderr), toolchain, standin)
        for name in ("real_acl", "foreign_acl", "torch_npu", "torch", "standin"):
            getattr(use, name).update(getattr(found, name))
    details = [f"sources: {', '.join(c.source.name for c in commands)}",
               f"real ACL headers: {', '.join(sorted(p.name for p in use.real_acl)) or '-'}",
               f"torch_npu headers: {len(use.torch_npu)}, torch headers: {len(use.torch)}",
               f"stand-in headers: {', '.join(sorted(p.name for p in use.standin)) or '-'}"]
    if failures:
        return CheckResult("real-header compile", False, f"{len(failures)} source(s) do not compile",
                           failures + details)
    if use.foreign_acl:
        return CheckResult("real-header compile", False, "ACL headers that are not the real ones were used",
                           [f"not real: {p}" for p in sorted(use.foreign_acl)] + details)
    if not use.real_acl:
        return CheckResult("real-header compile", False, "no source opened acl/*.h: nothing was checked", details)
    return CheckResult("real-header compile", True,
                       f"{len(commands)} sources; {len(use.real_acl)} real ACL, {len(use.torch_npu)} torch_npu, "
                       f"{len(use.torch)} torch headers", details)
