# Quick start: `make demo` runs the fleet end to end; `make test` runs the test suite.
# Both create .venv with what they need on a machine that has only Python 3.11+, using the pip
# that Python's venv ships (CI proves that older pip resolves the dependencies as declared).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench charts clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fleet demo

test: $(STAMP) lint
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check fleet schedulers tests
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/fleet bench sim
	$(BIN)/fleet bench dispatch
	$(BIN)/fleet bench loops
	$(BIN)/fleet bench collect
	$(BIN)/fleet bench pipeline
	$(BIN)/fleet bench chaos

# the charts in docs/performance.md (docs/charts/*.png), from short runs
charts: $(STAMP)
	$(BIN)/fleet bench dispatch --no-overhead --scenarios saturation,fairness --fleet-jobs 300 --fair-n 40 --plot docs/charts
	$(BIN)/fleet bench loops --jobs 10 --plot docs/charts

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache .hypothesis
