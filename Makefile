# Set-up and the two main commands. Each target creates .venv when missing.
# TORCH pins the tested torch (a CPU build from this machine's disk); override
# with `make test TORCH=torch==2.x` or TORCH=torch for your platform's default.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
export OMP_WAIT_POLICY ?= PASSIVE
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_DISABLE_PROGRESS_BARS ?= 1
export NO_MKDOCS_2_WARNING ?= 1
# The docs (docs/, mkdocs.yml) build first: a broken link or heading fails the run.
DOCS := $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

.PHONY: run test test-all bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	# serve: the server tests; cuda: xFormers, whose CPU reference path the attention tests check
	$(PY) -m pip install -q -e ".[test,serve,cuda]"
	# The C kernels, compiled now rather than by the first run (cached per ISA;
	# without a compiler encdec runs torch's paths, so set-up goes on).
	$(VENV)/bin/encdec build-kernels || echo "C kernels not built: encdec runs torch's paths"
	touch $@

run: $(VENV)/.installed
	$(PY) examples/demo.py

# The default run leaves out the tests marked slow (each 15-75 s: the long-form,
# multilingual and reduced-precision Whisper comparisons, the packaging and load
# tests); test-all runs every test.
test: $(VENV)/.installed
	$(DOCS)
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -q -p no:cacheprovider -rs -m "not slow"

test-all: $(VENV)/.installed
	$(DOCS)
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -q -p no:cacheprovider -rs

bench: $(VENV)/.installed
	$(PY) -m benchmarks.bart_bench
	$(PY) -m benchmarks.whisper_bench

clean:
	rm -rf $(VENV) build site *.egg-info
