# make demo: set up .venv if missing, then fine-tune the embedded model (before/after figures).
# make test: set up .venv if missing, then run every test (tests/unit, tests/integration, tests/cuda).
# make soak: the long soak (meshtune bench soak), outside the test suite.
# make tiny-model: rebuild the embedded model and data in meshtune/assets (tools/make_tiny_model.py; minutes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.meshtune-installed
OPENBLAS := /usr/lib/$(shell uname -m)-linux-gnu/openblas-pthread/libblas.so.3
# Commands that import MLX in-process get the BLAS preload here rather than by re-exec.
BLAS_ENV := $(if $(wildcard $(OPENBLAS)),LD_PRELOAD=$(OPENBLAS))

.PHONY: demo test soak tiny-model setup openblas clean

demo: $(STAMP)
	$(VENV)/bin/meshtune demo

# Two tests at a time (pytest-xdist; TEST_WORKERS=1 for one), then alone the `serial` ones,
# which time a lost rank or a watchdog in seconds and must not share the cores.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BLAS_ENV) $(PY) -m pytest -q -p xdist -n $(TEST_WORKERS) --dist worksteal -m "not serial" --durations=15 tests
	$(BLAS_ENV) $(PY) -m pytest -q -m serial --durations=5 tests

# make soak: 2,000 steps on 2 ranks (memory growth) and 20 short 3-rank runs (no hang); not in `make test`.
soak: $(STAMP)
	$(BLAS_ENV) $(PY) -m meshtune.cli bench soak --steps 2000 --repeats 20

# The maintainer tools (tools/README.md); tests/integration/test_tools.py runs each briefly.
tiny-model: $(STAMP)
	$(BLAS_ENV) $(PY) tools/make_tiny_model.py --out-dir meshtune/assets

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "meshtune needs Python 3.10+; set PYTHON=python3.x")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@$(MAKE) --no-print-directory openblas
	@touch $@

# A system OpenBLAS makes MLX's Linux CPU build ~15x faster; install it where we can
# (root with apt), carry on without it anywhere else.
openblas:
	@if [ "$$(uname)" = Linux ] && [ ! -e $(OPENBLAS) ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1)) \
	     && echo "installed system OpenBLAS" || echo "could not install OpenBLAS; continuing with MLX's BLAS"; \
	  else echo "no system OpenBLAS (install libopenblas0-pthread for faster CPU runs); continuing"; fi; \
	fi

clean:
	rm -rf $(VENV) runs *.egg-info
