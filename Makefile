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
# tests/test_demo.py runs the same command on a short context (it reads DEMO_MODEL and DEMO_PAIRS here).
DEMO_MODEL := tiny-qwen3.5
DEMO_PAIRS := --pair s32_rs --pair sbf16 --pair f4_sr_rs --pair tp4_hi32 --pair tp4_hi16_sr
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/replayquant kl --model $(DEMO_MODEL) $(DEMO_PAIRS) \
	    --dataset "$$($(BIN)/python -m replayquant.data)" --context 8192 --docs 2 \
	    --dtype float32 --device-map cpu --out build/demo/$(DEMO_MODEL)_ctx8k.json

clean:
	rm -rf $(VENV)
