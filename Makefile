# One virtual environment serves everything (the SGLang tests included). `make test` and `make serve` create it
# on first use and refresh it when pyproject.toml changes.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv test serve clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev,serve,plot]"
	$(BIN)/python -m pip install --quiet --no-deps -r requirements/sglang-nodeps.txt
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -q --timeout=900 --durations=25 tests

serve: venv
	@$(BIN)/python -m glance_server.example --host $(or $(HOST),127.0.0.1) --port $(or $(PORT),8000)
	$(BIN)/glance serve --host $(or $(HOST),127.0.0.1) --port $(or $(PORT),8000)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
