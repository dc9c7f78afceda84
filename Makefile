# Local virtual environment, installed once and reused. TORCH_SPEC pins the version; which
# build pip takes is the index's choice (PyPI's Linux wheel is a CUDA build): TORCH_INDEX=
# "--index-url https://download.pytorch.org/whl/cpu" (or .../cu128) picks one.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.stoker-installed
# the suite on three pytest-xdist workers: on 2 cores a third keeps them busy while a test waits
# on a timeout or a stuck rank (PYTEST_ARGS= for one process)
PYTEST_ARGS ?= -n 3

.PHONY: install train test clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_INDEX) "$(TORCH_SPEC)"
	# pin the torch just installed, so no dependency (torchmetrics, transformers) replaces it
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/constraints.txt
	$(PY) -m pip install --quiet -c $(VENV)/constraints.txt -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
