# The interface a newcomer uses: make demo, make test, make bench, make lint.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint bench fuzz certs proto image kind clean gpu-check gpu-wheels

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[agent,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check webhook tests bench examples docs

bench: $(STAMP)
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

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
	for p in dra pluginregistration; do \
		$(PY) -m grpc_tools.protoc -I webhook/agent/proto --python_out=webhook/agent/proto \
			--grpc_python_out=webhook/agent/proto webhook/agent/proto/$$p.proto && \
		sed -i "s/^import $${p}_pb2/from webhook.agent.proto import $${p}_pb2/" \
			webhook/agent/proto/$${p}_pb2_grpc.py || exit 1; \
	done

# The container engine: docker, else podman; IMAGE=registry.example.com/gpushard:0.1.0 to name it.
IMAGE ?= gpushard:dev
ENGINE ?= $(shell command -v docker 2>/dev/null || command -v podman 2>/dev/null)

image:
	@if [ -z "$(ENGINE)" ]; then \
		echo "gpushard: make image needs docker or podman (neither is on PATH); or set ENGINE=/path/to/engine" >&2; \
		exit 1; \
	fi
	$(ENGINE) build -t $(IMAGE) .

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
	rm -rf $(VENV) .pytest_cache .ruff_cache .demo build *.egg-info
