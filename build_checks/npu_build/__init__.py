"""make check-npu-build: the _npu build under CANN's CMake rules, proven on x86 (docs/npu_build.md)."""
