# pagedkv: `make demo` runs the main job on the default model, `make test` runs the tests.
# Both bootstrap .venv idempotently (pinned torch/executorch; torch's CPU wheel comes from the
# machine's wheel directory, see pyproject.toml).

PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: venv demo test test-fast pytest clean bench hooks

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

include toolkit/csrc/build.mk

# MODEL: a registered model name (`pagedkv models`), HF dir or .gguf; e.g. make demo MODEL=qwen2.5-coder-1.5b
MODEL ?= smollm2
demo: venv native
	$(BIN)/python -m runtime_sim.demo --model $(MODEL)

# --durations: where the time goes, in every CI log (the budget for `make test` is ~20 min on 2 cores)
pytest: venv native
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=30

test: venv native-test pytest

# the edit loop: the tests marked fast in tests/conftest.py (no cross builds, exports or sanitizers)
test-fast: venv native
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m fast

# the commit-msg check (CONTRIBUTING.md): subjects of at most 72 characters, then a blank line
hooks:
	git config core.hooksPath .githooks

clean:
	rm -rf build .hypothesis
