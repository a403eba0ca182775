# One venv, CPU torch, everything from the package registry; no model downloads ever.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
# PyPI's Linux torch wheel carries CUDA (GBs): TORCH_INDEX=https://download.pytorch.org/whl/cpu gets the CPU build.
# Empty: pip's configured index (these machines' serves the CPU build).
TORCH_INDEX ?=
# The GPU kernels' CPU checks (interpreter, sm_90 compile) need triton. A CPU torch has none, so this one is put in
# (3.9.0's interpreter rejects the RoPE kernel's scalar-and-tensor mask); a CUDA torch keeps the triton it pins.
TRITON_SPEC ?= triton==3.7.0

.PHONY: demo test gpu-test proto clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	if $(BIN)/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
		$(BIN)/pip install -q "$(TRITON_SPEC)"; fi
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvtransfer-bench demo

# Two workers, a test file each at a time (its module fixtures and test order kept): the suite mostly waits on
# the server processes it starts, so two share the CI's two cores. Those decode and prefill servers are forked from
# a fork server that imported them once (tests/support/forked.py: a spawned start is ~8 s of a core, mostly imports,
# and the main run starts ~170; KVT_TEST_SPAWN=1 spawns them as before), and the tests share servers where they can.
TEST_WORKERS ?= 2
MAIN_TESTS = $(BIN)/python -m pytest -m "not gpu and not gpu2 and not churn" -q -n $(TEST_WORKERS) --dist loadfile

# Beside the main run, the Triton kernels under the interpreter (TRITON_INTERPRET must be set before triton is
# imported, so it is a run of its own; ~60 s of one core, which the main run leaves idle often enough); its output
# is printed after the main run's, and either failing fails `make test`. The main run compiles every kernel for
# sm_90 (tests/test_kernels_sm90_compile.py).
# Last, the restart-churn test alone (~30 s): each cycle must serve again after a restart (within 60 s, a bound for a
# pair that never comes back: ~1-2 s forked, more beside another test file's servers; its times are printed, not
# asserted).
test: $(STAMP)
	@log=$$(mktemp); \
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_kernels_interp.py tests/test_kernel_mutants_interp.py tests/test_sample_interp.py tests/test_triton_keys_mutants_interp.py tests/test_invariant_interp.py > $$log 2>&1 & \
	interp=$$!; \
	echo '$(MAIN_TESTS)  (and TRITON_INTERPRET=1 tests/test_kernels_interp.py tests/test_kernel_mutants_interp.py tests/test_sample_interp.py tests/test_triton_keys_mutants_interp.py tests/test_invariant_interp.py beside it)'; \
	$(MAIN_TESTS); main=$$?; \
	wait $$interp; kernels=$$?; \
	echo 'TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests/test_kernels_interp.py tests/test_kernel_mutants_interp.py tests/test_sample_interp.py tests/test_triton_keys_mutants_interp.py tests/test_invariant_interp.py:'; cat $$log; rm -f $$log; \
	test $$main -eq 0 -a $$kernels -eq 0
	$(BIN)/python -m pytest -m churn -q -s tests/test_churn.py

# On a GPU machine (its python3 with torch already there): make gpu-test
gpu-test:
	PYTHONPATH=. python3 -m pytest -m "gpu" -q

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. proto/kvtransfer.proto proto/kvdata.proto

clean:
	rm -rf $(VENV) *.egg-info
