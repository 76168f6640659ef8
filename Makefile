# Two entry points for a newcomer (see README.md): `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PYTHONUNBUFFERED := 1

.PHONY: setup demo test test-unit test-integration test-gpu crd k8s-binaries clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Installs the operator, the runtime (torch, CPU is fine) and the test tools.
setup: $(BIN)/python
	@echo "[setup] installing moe-operator with the runtime and test extras (torch is the large download)"
	@# large wheels over a flaky connection: more resume attempts, and the whole install retried twice
	@for i in 1 2 3; do \
	  $(BIN)/pip install -q --retries 10 --resume-retries 20 -e ".[runtime,dev]" && exit 0; \
	  echo "[setup] pip install failed (attempt $$i of 3)"; sleep 10; \
	done; exit 1

# Builds the local control plane from the Kubernetes Go modules (cached by version).
k8s-binaries: setup
	$(BIN)/moe-operator dev-cluster up --build-only

demo: setup k8s-binaries
	$(BIN)/moe-operator demo

test: setup k8s-binaries
	$(BIN)/python -m pytest tests -q --timeout=900

test-unit: setup
	$(BIN)/python -m pytest tests/unit -q

test-integration: setup k8s-binaries
	$(BIN)/python -m pytest tests/integration -q --timeout=900

# Needs an NVIDIA GPU; skipped otherwise.
test-gpu: setup
	$(BIN)/python -m pytest tests/gpu -q

crd: setup
	$(BIN)/moe-operator crd -o crds/moedeployments.yaml

clean:
	-$(BIN)/moe-operator dev-cluster down
	rm -rf $(VENV)
