# syntax=docker/dockerfile:1
# One image for the webhook (`gpushard serve`), the node agent (`gpushard agent`) and the
# command line. Build: docker build -t gpushard:dev .
#
# The base is pinned by tag. For builds that never change under you, pin it by digest as
# well: look the digest up with
#   docker buildx imagetools inspect python:3.11.11-slim-bookworm
# and build with --build-arg PYTHON_IMAGE=python:3.11.11-slim-bookworm@sha256:<digest>
# (or write the digest here).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# --- build: the gpushard wheel and wheels of all its dependencies ---------------------------
FROM ${PYTHON_IMAGE} AS build
# Compilers only here, for a dependency that has no binary wheel for the target platform;
# none of them reaches the final image.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml setup.cfg README.md ./
COPY webhook ./webhook
RUN pip wheel --no-deps --wheel-dir /wheels . \
 && pip wheel --wheel-dir /wheels "$(ls /wheels/gpushard-*.whl)[agent]"

# --- final: a virtual environment with the wheels, nothing else ----------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpushard" \
      org.opencontainers.image.description="Fractional GPUs on Kubernetes: one pod, one physical card" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV VIRTUAL_ENV=/opt/gpushard \
    PATH=/opt/gpushard/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The wheels are bind-mounted from the build stage, not copied: they never become a layer.
# --no-index: the final stage installs exactly what the build stage resolved. pip compiles
# the bytecode now, because the pods run with a read-only root filesystem.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m venv "$VIRTUAL_ENV" \
 && "$VIRTUAL_ENV/bin/pip" install --no-cache-dir --no-index --find-links /wheels "gpushard[agent]" \
 && "$VIRTUAL_ENV/bin/pip" uninstall -y pip \
 && gpushard --version
# A numeric user, so that Kubernetes' runAsNonRoot can check it without /etc/passwd.
# The agent's DaemonSet runs it as root instead (runAsUser: 0): the kubelet's
# device-plugin folder belongs to root.
USER 65532:65532
WORKDIR /tmp
ENTRYPOINT ["gpushard"]
CMD ["--help"]
