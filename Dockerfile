# Serving image: NVIDIA's Triton Inference Server (NGC) with the hybrid_llm backend.
#   docker build -t suffixreplay .
#   docker run --gpus all --shm-size=2g -p 8000:8000 -p 8001:8001 -p 8002:8002 suffixreplay
# See docs/deploy.md for pointing it at a real Qwen3.5 checkpoint.
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:25.10-py3
FROM ${TRITON_IMAGE}

WORKDIR /opt/suffixreplay
ENV PYTHONPATH=/opt/suffixreplay \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies first so that code changes do not reinstall them. (The image's own
# tritonserver is used; the launcher prefers it over the nvidia-pytriton wheel's.)
COPY pyproject.toml README.md ./
COPY backend/__init__.py backend/__init__.py
# hadolint ignore=DL3013
RUN pip install ".[serve,gpu]"

COPY backend backend
COPY client client
COPY engine_build engine_build
COPY plugins plugins
COPY model_repo model_repo
# The project itself; its dependencies are pinned in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install --no-deps .

EXPOSE 8000 8001 8002 9000
# The Python backend imports `backend` from the working directory and PYTHONPATH.
CMD ["tritonserver", "--model-repository", "model_repo"]
