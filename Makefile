# Two commands on a fresh machine: `make demo` and `make test` (see README).
# torch is pinned to the CPU build for development and CI; users bring their own torch>=2.6.
PY ?= python3
TORCH ?= torch==2.13.0

.PHONY: install install-test demo test test-slow test-corpus fuzz test-distributed corpus-table
install:
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .

install-test:
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"

demo: install
	$(PY) examples/seed_net.py

test: install-test
	$(PY) -m pytest -q

# Inductor compiles take 20-30 s each on CPU: a separate CI step (exit 5 = none selected is fine).
test-slow: install-test
	$(PY) -m pytest -q -m slow || [ $$? -eq 5 ]

# Hugging Face models from config (tests/corpus): every model in inference, training, training + budget.
test-corpus: install-test
	$(PY) -m pytest -q -m corpus tests/corpus

# The corpus table (models x what each pass did), written to tests/corpus/TABLE.md.
corpus-table: install-test
	$(PY) -m tests.corpus.table

# 1,000 random networks through the default pipeline; the base seed is printed (FUZZ_SEED= to replay a run).
FUZZ_COUNT ?= 1000
fuzz: install-test
	$(PY) -m tests.fuzz --count $(FUZZ_COUNT) --workers 2 $(if $(FUZZ_SEED),--seed $(FUZZ_SEED))

# DDP / FSDP2 / autocast across two gloo processes on CPU (the Inductor ones are also marked slow).
test-distributed: install-test
	$(PY) -m pytest -q -m "distributed and not slow" tests/test_distributed.py
