"""The files of a checkpoint directory that enter its fingerprint, each with its kind: safetensors shards, other
weight files, and definition files (configs and modelling code). Hidden files and folders, tokenizers, sampling
defaults and READMEs never do, and neither does where the directory is: moving or renaming a checkpoint keeps its
fingerprint. A weight file of a Hugging Face cache snapshot also names the sha256 of its whole content for free."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from enum import Enum
from fnmatch import fnmatchcase
from typing import Optional, Sequence

SAFETENSORS_PATTERNS = ("*.safetensors",)
OTHER_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.gguf", "*.ckpt", "*.npz", "*.msgpack", "*.h5")
WEIGHT_PATTERNS = SAFETENSORS_PATTERNS + OTHER_WEIGHT_PATTERNS
DEFINITION_PATTERNS = ("*.json", "*.py")
# Tokenizer and sampling files: token ids are in vLLM's block hash already, sampling defaults never reach the KV.
IGNORED_DEFINITIONS = ("tokenizer*.json", "special_tokens_map.json", "vocab.json", "added_tokens.json",
                       "generation_config.json", "chat_template.json")

# a Hugging Face cache blob named by the sha256 of its content (huggingface_hub's REGEX_SHA256 for LFS ETags)
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")


class FileKind(Enum):
    """What a checkpoint file is to the fingerprint; the value is the string the digest has always fed for it."""

    SAFETENSORS = "safetensors"  # header parsed, one sample per tensor
    WEIGHTS = "weights"  # any other weight format: first and last page, whole when small
    DEFINITION = "definition"  # read whole


@dataclass(frozen=True)
class CheckpointFile:
    """One file of a checkpoint that enters its fingerprint."""

    name: str  # relative to the root, "/"-separated: the name that enters the digest
    path: str  # the path opened (symlinks followed)
    size: int
    kind: FileKind
    hub_sha256: Optional[bytes] = None  # a weight file in a Hugging Face cache snapshot: its blob's name, 32 bytes


def _matches(name: str, patterns: Sequence[str]) -> bool:
    lowered = name.lower()
    return any(fnmatchcase(lowered, p) for p in patterns)


def _kind_of(name: str) -> Optional[FileKind]:
    if _matches(name, SAFETENSORS_PATTERNS):
        return FileKind.SAFETENSORS
    if _matches(name, OTHER_WEIGHT_PATTERNS):
        return FileKind.WEIGHTS
    if _matches(name, DEFINITION_PATTERNS) and not _matches(name, IGNORED_DEFINITIONS):
        return FileKind.DEFINITION
    return None


def walk_files(root: str) -> list[tuple[str, str]]:
    """(relative name, path) of every non-hidden file under root, following symlinked files and folders once."""
    found: list[tuple[str, str]] = []
    seen: set[tuple[int, int]] = set()

    def visit(folder: str, prefix: str) -> None:
        st = os.stat(folder)
        if (st.st_dev, st.st_ino) in seen:  # a symlink loop or a folder linked twice
            return
        seen.add((st.st_dev, st.st_ino))
        with os.scandir(folder) as it:
            items = sorted(it, key=lambda e: e.name)
        for item in items:
            if item.name.startswith("."):
                continue
            if item.is_dir(follow_symlinks=True):
                visit(item.path, f"{prefix}{item.name}/")
            else:
                found.append((f"{prefix}{item.name}", item.path))

    visit(root, "")
    return found


def _hub_blob_sha256(path: str) -> Optional[bytes]:
    """The sha256 of a weight file's whole content when `path` is (or links, through more links, to) a file of a
    Hugging Face cache snapshot, `<repo>/snapshots/<revision>/<file>`, linking to `<repo>/blobs/<name>` with a
    64-hex name: huggingface_hub names a blob by its ETag, the sha256 of the content for Git LFS files (every
    safetensors or .bin weight file) and the 40-hex git blob sha1 otherwise. None for anything else (a plain file,
    a sha1 blob, a link that does not follow that layout); costs a few readlink/stat calls, no read."""
    current = path
    for _ in range(40):  # the kernel's own bound on a chain of links
        try:
            target = os.readlink(current)
        except OSError:  # not a link (EINVAL) or gone: no hub blob on this path
            return None
        blob = os.path.join(os.path.dirname(current), target)  # an absolute target replaces the join
        blobs = os.path.realpath(os.path.dirname(blob))
        repo = os.path.dirname(blobs)
        link_dir = os.path.realpath(os.path.dirname(current))
        if (os.path.basename(blobs) == "blobs" and link_dir.startswith(os.path.join(repo, "snapshots") + os.sep)
                and os.path.isdir(os.path.join(repo, "snapshots"))):
            name = os.path.basename(blob)
            return bytes.fromhex(name) if _SHA256_NAME.fullmatch(name) else None
        current = blob
    return None


def list_checkpoint_files(root: str) -> list[CheckpointFile]:
    """The weight and definition files under `root`, sorted by name; a broken symlink among them is a ValueError."""
    entries = []
    for name, path in walk_files(root):
        kind = _kind_of(os.path.basename(name))
        if kind is None:
            continue
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ValueError(f"{name} in {root} is a broken symlink; a checkpoint file it names must exist") from None
        if stat.S_ISREG(st.st_mode):
            # definition files are read whole: no digest to borrow
            hub = _hub_blob_sha256(path) if kind is not FileKind.DEFINITION else None
            entries.append(CheckpointFile(name, path, st.st_size, kind, hub))
    return sorted(entries, key=lambda e: e.name)
