# Two commands do everything on a clean clone: `make demo` and `make test`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test fuzz bench bench-hybrid bench-zoo bench-memory bench-colossalai gpu-check install clean

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

# Many more random models than `make test` runs (tests/runtime/test_fuzz.py; ~10 min on 2 cores), drawn
# afresh each run: AUTOPAR_FUZZ_SEED (default: a new one, printed and written to the report) repeats a run.
fuzz: $(STAMP)
	AUTOPAR_FUZZ_SEED=$${AUTOPAR_FUZZ_SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')} \
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

# transformers GPT-2 (the quick start), a LLaMA with 32k and a Qwen2 with 151k tokens against DDP,
# ZeRO-1, FSDP2 and torch tensor parallel, checked exact per tensor, on 4 gloo ranks (~20 min).
bench-zoo: $(BENCH_STAMP)
	$(PY) benchmarks/zoo.py

# Predicted against measured peak memory per rank (torch's MemTracker), one plan per set of ranks (~7 min).
bench-memory: $(BENCH_STAMP)
	$(PY) benchmarks/memory_fidelity.py

# Colossal-AI's own HybridParallelPlugin as a second hand-tuned baseline, checked exact and timed
# next to autopar on 4 gloo ranks (benchmarks/colossalai_bench.py; ~10 min on 2 cores). It has a
# virtualenv of its own: colossalai 0.5.0 pins torch<=2.5.1, of which no CPU build is reachable here,
# so it goes in without its dependencies next to the CPU torch, with only the packages its imports
# touch (pinned; transformers at the version its shardformer GPT-2 policy was written for), then
# autopar itself and its runtime dependencies. autopar's profiles go to /tmp/cai_cache.
CAI_VENV := .venv-colossalai
CAI_PY := $(CAI_VENV)/bin/python
CAI_STAMP := $(CAI_VENV)/.installed
CAI_DEPS := transformers==4.51.3 peft==0.13.2 accelerate==1.16.0 bitsandbytes==0.50.2 galore-torch==1.0 \
	einops==0.8.2 psutil==7.2.2

$(CAI_STAMP): pyproject.toml
	$(PYTHON) -m venv $(CAI_VENV)
	$(CAI_PY) -m pip install --quiet --upgrade pip
	$(CAI_PY) -m pip install --quiet "$(TORCH)"
	$(CAI_PY) -m pip install --quiet --no-deps colossalai==0.5.0
	$(CAI_PY) -m pip install --quiet $(CAI_DEPS)
	$(CAI_PY) -m pip install --quiet --no-deps -e .
	$(CAI_PY) -m pip install --quiet networkx "pulp>=2.7,<4" numpy highspy
	touch $(CAI_STAMP)

bench-colossalai: $(CAI_STAMP)
	AUTOPAR_CACHE_DIR=/tmp/cai_cache $(CAI_PY) benchmarks/colossalai_bench.py

# One GPU, a few minutes (benchmarks/gpu_check.py): bf16 exactness with a world of one, and the GPU
# preset's compute prices against measured op times. It runs on the machine's own python (a CUDA
# build of torch, with autopar's dependencies), from the source tree; `GPU_DEVICE=cpu` dry-runs it.
GPU_DEVICE ?= cuda
gpu-check:
	PYTHONPATH=. $(PYTHON) benchmarks/gpu_check.py --device $(GPU_DEVICE)

clean:
	rm -rf $(VENV) $(CAI_VENV) .pytest_cache .hypothesis
