"""`chunk_tokens` has one default, `DEFAULT_CHUNK_TOKENS`, in one home (`layout/discovery.py`): no other module of
`lmcache_npu` writes a size of its own as a default (an argument's, a field's, a `.get("chunk_tokens", ...)`
fallback). A default may be left out, be None or 0 (not known yet, never a size), or name the constant.
Negative control: the check finds each kind of literal default in a fake source, and passes the allowed ones."""

from __future__ import annotations

import ast
from pathlib import Path

from lmcache_npu.layout.discovery import DEFAULT_CHUNK_TOKENS, LayoutPolicy

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lmcache_npu"
HOME = PACKAGE / "layout" / "discovery.py"
KEY = "chunk_tokens"


def _own_default(value: ast.expr | None) -> bool:
    """A default that chooses a size of its own: anything but none, None, 0 or the constant's name."""
    if value is None:
        return False
    if isinstance(value, ast.Constant) and (value.value is None or value.value == 0):
        return False
    return not (isinstance(value, ast.Name) and value.id == "DEFAULT_CHUNK_TOKENS")


def own_defaults(source: str, where: str = "<source>") -> list[str]:
    """Every place in `source` that gives `chunk_tokens` a default of its own, as `where:line`."""
    found: list[int] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            positional = node.args.posonlyargs + node.args.args
            pairs = list(zip(positional[len(positional) - len(node.args.defaults):], node.args.defaults))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            found += [d.lineno for a, d in pairs if a.arg == KEY and _own_default(d)]
        elif isinstance(node, ast.ClassDef):  # dataclass fields and class attributes
            for item in node.body:
                if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                        and item.target.id == KEY and _own_default(item.value)):
                    found.append(item.lineno)
                elif isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == KEY
                                                          for t in item.targets) and _own_default(item.value):
                    found.append(item.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value == KEY
              and _own_default(node.args[1])):
            found.append(node.lineno)
    return [f"{where}:{line}" for line in sorted(found)]


def test_no_module_but_the_home_gives_chunk_tokens_a_default_of_its_own() -> None:
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != HOME
                 for hit in own_defaults(path.read_text(), str(path.relative_to(ROOT)))]
    assert offenders == [], f"chunk_tokens defaults outside {HOME.relative_to(ROOT)}: use DEFAULT_CHUNK_TOKENS"


def test_the_home_defines_the_constant_and_its_own_defaults_name_it() -> None:
    source = HOME.read_text()
    assert "\nDEFAULT_CHUNK_TOKENS = 128\n" in source and DEFAULT_CHUNK_TOKENS == 128
    assert own_defaults(source) == []
    assert LayoutPolicy().chunk_tokens == DEFAULT_CHUNK_TOKENS  # a policy built by hand gets the engine's default


def test_negative_control_literal_defaults_in_a_fake_source_are_found() -> None:
    fake = '''
from dataclasses import dataclass

@dataclass
class Policy:
    chunk_tokens: int = 256
    other: int = 7

class Plain:
    chunk_tokens = 64

def plan(groups, planes, chunk_tokens: int = 256):
    return groups

def keyword(*, chunk_tokens=512):
    return chunk_tokens

def read(data):
    return data.get("chunk_tokens", 256)
'''
    assert own_defaults(fake, "fake.py") == ["fake.py:6", "fake.py:10", "fake.py:12", "fake.py:15", "fake.py:19"]


def test_control_what_is_allowed_in_a_fake_source_is_not_found() -> None:
    fake = '''
from dataclasses import dataclass

@dataclass
class Geometry:
    chunk_tokens: int
    known: int = 0

@dataclass
class Policy:
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

def plan(groups, chunk_tokens: int, other: int = 256):
    return groups

def preset(name, chunk_tokens=None, num_blocks=8):
    return name

def status(v):
    return v.get("chunk_tokens", 0), v.get("chunk_bytes", 4096)
'''
    assert own_defaults(fake) == []


def hash_block_rules(source: str) -> list[int]:
    """Lines taking a chunk size modulo a hash block size: the rule `hash_blocks_per_chunk` keeps in one home."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            names = {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(node.right)
                     if isinstance(n, (ast.Attribute, ast.Name))}
            if any("hash_block" in n for n in names):
                found.append(node.lineno)
    return found


def test_the_hash_block_rule_has_one_home():
    home = PACKAGE / "checks.py"
    found = {str(p.relative_to(ROOT)): lines for p in PACKAGE.rglob("*.py") if p != home
             for lines in [hash_block_rules(p.read_text())] if lines}
    assert not found, f"chunk size checked against the hash block outside checks.hash_blocks_per_chunk: {found}"
    assert hash_block_rules(home.read_text())  # the scan sees the home's own check
    assert hash_block_rules("if policy.chunk_tokens % hash_block:\n    pass\n") == [1]  # negative control
