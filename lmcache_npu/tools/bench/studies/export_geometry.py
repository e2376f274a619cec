"""Writes presets as `--geometry` files, for benchmark machines without vLLM (presets are built from vLLM's spec
classes; a geometry file is not):

    python -m lmcache_npu.tools.bench.studies.export_geometry --out geometries llama3-8b deepseek-v3 deepseek-v4-flash
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lmcache_npu.tools.bench.geometry import geometry_of_plan
from lmcache_npu.tools.bench.presets import materialize_preset


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("presets", nargs="+")
    parser.add_argument("--out", type=Path, required=True, help="directory for <preset>.json")
    parser.add_argument("--device-family", default="ascend", choices=["ascend", "cuda", "cpu"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for preset in args.presets:
        m, _, _ = materialize_preset(preset, 1, torch.device("cpu"), device_family=args.device_family)
        geometry = geometry_of_plan(m.plan, preset, f"{preset} ({args.device_family}), exported from its preset")
        path = args.out / f"{preset}.json"
        path.write_text(json.dumps(geometry.to_dict(), indent=1))
        print(f"{path}: {len(m.plan.planes)} planes, {m.plan.object_bytes} B per chunk")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
