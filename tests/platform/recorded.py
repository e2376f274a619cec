"""The recorded (and, where said so, reconstructed) npu-smi and driver files under data/, read the way the tools
read them: each file's leading `#` lines say where it comes from and are dropped here."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def load(name: str) -> str:
    """The file's content without its provenance comment."""
    return "\n".join(line for line in (DATA / name).read_text().splitlines() if not line.startswith("#")) + "\n"
