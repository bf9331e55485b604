# Two commands on a fresh machine: `make demo` and `make test` (see README).
# torch is pinned to the CPU build for development and CI; users bring their own torch>=2.6.
PY ?= python3
TORCH ?= torch==2.13.0

.PHONY: install install-test demo test test-slow
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
