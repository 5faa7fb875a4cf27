# One image for the webhook (`gpushard serve`), the node agent (`gpushard agent`) and the
# command line. Build: docker build -t gpushard:dev .   (or: make image)
#
# Offline, for air-gapped machines: a folder of wheels made where there is network
# (make wheelhouse), handed over as the build context named `wheels`:
#   docker build --build-context wheels=build/wheelhouse -t gpushard:dev .
# (podman build takes the same flag). A named build context takes the place of the stage of
# the same name, so the build stage below, with its apt-get and pip, is never run. There is no
# `# syntax=` line on purpose: BuildKit would fetch that frontend from Docker Hub, which an
# offline build cannot; the frontend built into Docker 23 and later has RUN --mount and named
# build contexts.
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

# --- wheels: what the final stage installs: the build stage's, or the `wheels` build context --
FROM scratch AS wheels
COPY --from=build /wheels /

# --- final: a virtual environment with the wheels, nothing else ----------------------------
FROM ${PYTHON_IMAGE}
# The package's version (webhook/__init__.py), which make image passes; "dev" for a build by hand.
ARG VERSION=dev
LABEL org.opencontainers.image.title="gpushard" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.description="Fractional GPUs on Kubernetes: one pod, one physical card" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV VIRTUAL_ENV=/opt/gpushard \
    PATH=/opt/gpushard/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The wheels are bind-mounted, not copied: they never become a layer. --no-index: the final
# stage installs exactly the wheels it is given, never from the network. pip compiles the
# bytecode now, because the pods run with a read-only root filesystem. python3, not python:
# every Python base image has python3, not every one has `python` (Debian's own has not).
RUN --mount=type=bind,from=wheels,target=/wheels \
    python3 -m venv "$VIRTUAL_ENV" \
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
