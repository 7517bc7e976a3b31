# The two commands of the README:
#   make run    installs (once) and runs the main job
#   make test   installs (once) and runs the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint

$(STAMP): pyproject.toml requirements/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/cpu.txt
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	# Mooncake's transfer engine (PD disaggregation) loads libibverbs.so.1 from Debian's libibverbs1
	@ldconfig -p | grep -q libibverbs.so.1 || apt-get install -y -q libibverbs1 >/dev/null \
		|| (apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null) \
		|| echo "warning: libibverbs1 is not installed: --disaggregation-mode will not start (apt-get install libibverbs1)"
	# sgl-kernel's C++ ops for CPU (~45 s once, cached; a failed build warns, the torch paths are used)
	$(PY) -m sglang.srt.utils.sgl_kernel
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m sglang.launch_server --model-path tiny-qwen3-next-demo --mamba-scheduler-strategy extra_buffer_lazy --host 127.0.0.1 --port 30000

test: $(STAMP)
	$(PY) test/run_suite.py --suite per-commit-cpu

lint: $(STAMP)
	$(PY) -m ruff check python test benchmark
