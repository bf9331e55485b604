# Two commands on a fresh machine: `make demo` and `make test` (see README).
# torch is pinned to the CPU build for development and CI; users bring their own torch>=2.6.
PY ?= python3
TORCH ?= torch==2.13.0
# Quiet installs: no version nag, no root-user warning (containers and CI run as root).
PIP = $(PY) -m pip install -q --disable-pip-version-check --root-user-action=ignore

.PHONY: install install-test install-browser demo test test-slow test-corpus fuzz test-distributed corpus-table docs-images
install:
	$(PIP) "$(TORCH)"
	$(PIP) -e ".[report]"

install-test:
	$(PIP) "$(TORCH)"
	$(PIP) -e ".[test]"

# Headless Chromium for tests/test_html.py (Debian/Ubuntu package; the test skips, saying so, without it).
install-browser:
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q --no-install-recommends chromium)

demo: install
	$(PY) examples/seed_net.py

# One pytest worker per core (the tests run torch on one thread each), each taking whole files (the corpus, one
# file: single tests); pytest-benchmark, where installed, would only warn that xdist disables it (nothing uses it).
WORKERS = -n auto -p no:benchmark

test: install-test
	$(PY) -m pytest -q $(WORKERS) --dist loadfile

# Inductor compiles take 20-30 s each on CPU: a separate CI step (exit 5 = none selected is fine).
test-slow: install-test
	$(PY) -m pytest -q -m slow || [ $$? -eq 5 ]

# The README's screenshots of `fxopt inspect --html` (seed example; 6-layer BERT and a deep MLP with a budget).
docs-images: install install-browser
	$(PY) -m fxopt inspect examples/seed_net.py:SeedNet --input-shape 8x3x32x32 --html docs/seed_net.html
	$(PY) -m fxopt inspect examples/bert_small.py:bert6 --input-shape 4x128 --dtype int64 --int-high 1000 \
		--mode training --memory-budget 0.5 --html docs/bert6_budget.html
	$(PY) -m fxopt inspect examples/deep_mlp.py:DeepMLP --input-shape 128x256 --mode training \
		--memory-budget 0.5 --html docs/deep_mlp_budget.html
	for page in seed_net bert6_budget deep_mlp_budget; do \
		chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,1900 \
			--screenshot=docs/$$page.png file://$(CURDIR)/docs/$$page.html 2>/dev/null; done

# Hugging Face models from config (tests/corpus): every model in inference, training, training + budget.
test-corpus: install-test
	$(PY) -m pytest -q $(WORKERS) --dist load -m corpus tests/corpus

# The corpus table (models x what each pass did), written to tests/corpus/TABLE.md.
corpus-table: install-test
	$(PY) -m tests.corpus.table

# 1,000 random networks through the default pipeline; the base seed is printed (FUZZ_SEED= to replay a run).
FUZZ_COUNT ?= 1000
# CI runs one fixed, replayable set; `make fuzz FUZZ_SEED=` draws the base seed from the clock.
FUZZ_SEED ?= 60060000
fuzz: install-test
	$(PY) -m tests.fuzz --count $(FUZZ_COUNT) --workers 2 $(if $(FUZZ_SEED),--seed $(FUZZ_SEED))

# DDP / FSDP2 / autocast across two gloo processes on CPU (the Inductor ones are also marked slow).
test-distributed: install-test
	$(PY) -m pytest -q -m "distributed and not slow" tests/test_distributed.py
