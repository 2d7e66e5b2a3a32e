# Set-up and everyday commands. `make test` and `make serve` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
MODEL_REPO ?= model_repo

.PHONY: install test lint serve clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# The torch pin is installed first and on its own so that no later resolver step can
# replace it with a CUDA build.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[serve,dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# The real tritonserver on $(MODEL_REPO): 127.0.0.1 and ports 8000/8001/8002 unless BIND_ADDRESS,
# HTTP_PORT, GRPC_PORT, METRICS_PORT say otherwise; Ctrl-C stops it.
serve: $(STAMP)
	$(PY) -m backend.triton.launcher --model-repository $(MODEL_REPO)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
