# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench bench-gpu stress lint typecheck clean

# The demo needs only zerostall, torch and matplotlib; the test suite needs the dev extra too
# (jax, lightning, transformers, trl, ...), which takes minutes more to install.
DEMO_STAMP := $(VENV)/.demo-installed

$(DEMO_STAMP): pyproject.toml setup.py src/zerostall/_memcopy.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check "torch==2.13.0"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[torch]" "matplotlib>=3.8"
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e ".[torch,dev]"
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples gputests
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -p no:cacheprovider tests

# The CPU suite (docs/performance.md): results in benchmarks/results/, figures appended to
# benchmarks/reference/history.csv.
bench: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e ".[bench]"
	$(PY) benchmarks/run.py

# One GPU: overlapped vs blocking staging vs DCP async_save vs torch.save on a >= 4 GB bf16
# transformer loop (benchmarks/gpu.py), then loads onto the GPU (benchmarks/gpu_restore.py); says
# so and exits 0 where there is no CUDA device. Figures appended to benchmarks/reference/history.csv.
bench-gpu: $(STAMP)
	rm -f benchmarks/results/gpu.json benchmarks/results/gpu_restore.json
	$(PY) benchmarks/gpu.py --out benchmarks/results/gpu.json
	$(PY) benchmarks/gpu_restore.py --out benchmarks/results/gpu_restore.json
	$(PY) -m benchmarks.history gpu benchmarks/results/gpu.json benchmarks/results/gpu_restore.json

stress: $(STAMP)
	ZEROSTALL_STRESS=1 $(PY) -m pytest -q -p no:cacheprovider tests -k "crash or stress"

typecheck: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples gputests
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
