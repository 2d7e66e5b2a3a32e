# Set-up and everyday commands. `make test` and `make serve` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
MODEL_REPO ?= model_repo

.PHONY: install test lint serve openai clean model model-nemotron-h lm-eval-venv

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
# HTTP_PORT, GRPC_PORT, METRICS_PORT say otherwise; Ctrl-C stops it. SERVE_ARGS: more
# tritonserver flags, e.g. SERVE_ARGS="--log-verbose=1 --exit-timeout-secs=10".
SERVE_ARGS ?=
serve: $(STAMP)
	$(PY) -m backend.triton.launcher --model-repository $(MODEL_REPO) -- $(SERVE_ARGS)

# The OpenAI-compatible frontend (/v1/completions, /v1/chat/completions) on OPENAI_PORT (9000),
# in front of the server `make serve` started (its gRPC port: GRPC_PORT, 8001).
OPENAI_PORT ?= 9000
GRPC_PORT ?= 8001
OPENAI_ARGS ?=  # more frontend flags, e.g. --reasoning-parser qwen3 --tool-call-parser qwen
openai: $(STAMP)
	$(PY) -m backend.openai_api --triton-url 127.0.0.1:$(GRPC_PORT) \
	  --model-repository $(MODEL_REPO) --port $(OPENAI_PORT) $(OPENAI_ARGS)

# Retrains the default model from scratch (about 46 minutes on 2 cores; MODEL_CARD.md):
# stage 1 forms the retrieval circuit on short key-value stores with many questions, stage 2
# mixes library text in and grows the contexts to 4K. Then the evaluation and the replay
# calibration, both written into the model directory.
MODEL_DIR ?= $(MODEL_REPO)/hybrid_llm/1/tiny_qwen3_5
TRAIN := $(PY) -m engine_build.train_tiny --lr 1e-3 --warmup 20 --tasks kv \
	--text-weight 0
STAGE1 := --steps 400 --task-fraction 1 --task-context 40:120 --extra-queries 15 \
	--answer-weight 1 --phases 0:160 --eval-every 50 --eval-context 128 --max-corpus-bytes 2000000
STAGE2 := --steps 1300 --task-fraction 0.5 --tasks kv,kv,kv,needle --task-context 40:4000 \
	--extra-queries 31 --answer-weight 4 --phases "0:256,0.15:512,0.4:1024,0.7:2048,0.9:4096" \
	--eval-every 100 --eval-context 1024 --seed 1
model: $(STAMP)
	$(TRAIN) --out runs/model_stage1 --work-dir runs/model_stage1_work $(STAGE1)
	$(TRAIN) --init-from runs/model_stage1 --out $(MODEL_DIR) --work-dir runs/model_stage2_work \
	  $(STAGE2)
	$(PY) -m engine_build.evaluate --model $(MODEL_DIR)
	$(PY) -m engine_build.calibrate --model $(MODEL_DIR)

# The second family's tiny model (Nemotron-H: Mamba2 + attention + MLP layers), the same
# two-stage recipe with Mamba's log-uniform dt initialisation (MODEL_CARD.md beside it).
NH_DIR ?= $(MODEL_REPO)/hybrid_llm/1/tiny_nemotron_h
model-nemotron-h: $(STAMP)
	$(TRAIN) --family nemotron_h --dt-init log-uniform --out runs/nh_stage1 \
	  --work-dir runs/nh_stage1_work $(STAGE1)
	$(TRAIN) --init-from runs/nh_stage1 --out $(NH_DIR) --work-dir runs/nh_stage2_work $(STAGE2)
	$(PY) -m engine_build.evaluate --model $(NH_DIR)
	$(PY) -m engine_build.calibrate --model $(NH_DIR) --anchors-per-page 4 16

# lm-evaluation-harness in an environment of its own (it wants numpy 2; the server's
# nvidia-pytriton keeps numpy 1): `$(PY) -m client.bench.lm_eval_check` drives it.
EVAL_VENV ?= .venv-eval
lm-eval-venv: $(EVAL_VENV)/bin/lm_eval
$(EVAL_VENV)/bin/lm_eval:
	$(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/pip install --quiet "torch==2.13.0"
	$(EVAL_VENV)/bin/pip install --quiet "lm-eval[api]>=0.4.9" "transformers>=5.0,<6"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
