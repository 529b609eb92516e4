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

# The embedded default: the tiny Qwen3.5-architecture model trained on the KJV (replayquant/assets),
# scored on held-out books it never saw, 8K-token context, five precision pairs. Writes build/demo/.
DEMO_PAIRS := --pair s32_rs --pair sbf16 --pair f4_sr_rs --pair tp4_hi32 --pair tp4_hi16_sr
demo: $(STAMP)
	$(BIN)/replayquant kl --model tiny-qwen3.5 $(DEMO_PAIRS) \
	    --dataset "$$($(BIN)/python -m replayquant.data)" --context 8192 --docs 2 \
	    --dtype float32 --device-map cpu --out build/demo/tiny-qwen3.5_ctx8k.json

clean:
	rm -rf $(VENV)
