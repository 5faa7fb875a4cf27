# The interface a newcomer uses: make demo, make test, make bench, make lint.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint bench fuzz certs proto image kind clean

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
	$(PY) -m ruff check webhook tests bench examples

bench: $(STAMP)
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

fuzz: $(STAMP)
	GPUSHARD_FUZZ_EXAMPLES=$${GPUSHARD_FUZZ_EXAMPLES:-20000} $(PY) -m pytest -q -p no:cacheprovider \
		--timeout 3600 tests/admission/test_fuzz.py

certs: $(STAMP)
	$(VENV)/bin/gpushard certs --out certs

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I webhook/agent/proto --python_out=webhook/agent/proto \
		--grpc_python_out=webhook/agent/proto webhook/agent/proto/deviceplugin.proto
	sed -i 's/^import deviceplugin_pb2/from webhook.agent.proto import deviceplugin_pb2/' \
		webhook/agent/proto/deviceplugin_pb2_grpc.py
	$(PY) -m grpc_tools.protoc -I webhook/agent/proto --python_out=webhook/agent/proto \
		--grpc_python_out=webhook/agent/proto webhook/agent/proto/podresources.proto
	sed -i 's/^import podresources_pb2/from webhook.agent.proto import podresources_pb2/' \
		webhook/agent/proto/podresources_pb2_grpc.py

image:
	docker build -t gpushard:dev .

kind:
	bash examples/kind/run.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .demo build *.egg-info
