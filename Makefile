# Two commands do everything on a clean clone: `make demo` and `make test`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test fuzz bench bench-hybrid install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,highs]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m autopar.cli.main demo

test: $(STAMP)
	$(PY) -m pytest -q tests

# Many more random models than `make test` runs (tests/runtime/test_fuzz.py; ~10 min on 2 cores).
fuzz: $(STAMP)
	AUTOPAR_FUZZ_CASES=$${AUTOPAR_FUZZ_CASES:-600} AUTOPAR_FUZZ_REPORT=$${AUTOPAR_FUZZ_REPORT:-fuzz-report.json} \
		$(PY) -m pytest -q -s tests/runtime/test_fuzz.py

# The benchmarks plot with matplotlib (the optional extra "bench").
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/run_all.py

# Every hand-written tp x pp x dp layout, checked exact and timed (~12 min on 2 cores).
bench-hybrid: $(BENCH_STAMP)
	$(PY) benchmarks/hybrid.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
