# Two commands: `make test` and `make demo`. Both create .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest tests

demo: $(STAMP)
	$(BIN)/replayquant formats

clean:
	rm -rf $(VENV)
