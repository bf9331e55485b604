# Two commands on a fresh machine: `make demo` and `make test` (see README).
PY ?= python3
TORCH ?= torch==2.13.0

.PHONY: install demo test test-slow
install:
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"

demo: install
	$(PY) examples/seed_net.py

test: install
	$(PY) -m pytest -q

test-slow: install
	$(PY) -m pytest -q -m slow
