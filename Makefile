# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build by default (this is what CI and the demo use). On a GPU host: make install TORCH=torch==2.11.0
TORCH ?= torch==2.13.0

.PHONY: install test demo demo-down clean-runs lint

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
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

test: install
	$(PY) -m pytest -q

demo: install
	infra/demo.sh

demo-down:
	infra/prefect-down.sh

clean-runs:
	rm -rf runs
