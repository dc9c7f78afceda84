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
	$(PY) -m pip install --quiet --no-compile $(TORCH_INDEX) "$(TORCH_SPEC)"
	# pin the torch just installed, so no dependency (torchmetrics, transformers) replaces it
	$(PY) -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
		> $(VENV)/constraints.txt
	$(PY) -m pip install --quiet --no-compile -c $(VENV)/constraints.txt -e ".[dev]"
	# what pip would have byte-compiled one file at a time (torch's and transformers' 14,000
	# modules: a minute of a 2-core machine's install), compiled on every core; like pip,
	# it passes over the few files that are not for this Python (a test of torch's)
	$(PY) -c "import compileall, sys; compileall.compile_dir(sys.argv[1], quiet=2, workers=0)" \
		$(VENV)/lib
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# the suite starts about 600 Python processes, each of which would compile the project's own
# modules again from source where the environment holds PYTHONDONTWRITEBYTECODE=1 (up to
# 0.18 s of CPU each): the suite writes them to __pycache__ once (git-ignored), then reads them
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
