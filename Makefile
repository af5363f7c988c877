# The user-facing verbs of the distribution. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PYTHONPATH := $(CURDIR)/build:$(CURDIR)/tools:$(CURDIR)/overlays/graphpersist
export PYTHONDONTWRITEBYTECODE := 1

ENGINE ?= all
VERSION ?=
DIST ?= dist
INSTALL_VENV ?= .venv-dist
PYTEST_ARGS ?=
# pytest-xdist workers (`-n`): one per core, at least 4 (many tests wait on subprocesses, so more workers than
# cores keep the cores busy); JOBS=0 runs in one process.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 4); echo $$(( n > 4 ? n : 4 )))
# pytest keeps its compiled test modules (and Python its bytecode) outside the tree, so each worker does not
# compile every test module again (about 2 s of CPU each); the rest of the Makefile writes no bytecode.
TEST_ENV := PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(CURDIR)/.work/pycache
OFFLINE ?=
FINISH ?=
REBASE_ARGS ?=
# Offline bundles for a GPU host: BUNDLE_HOST holds each engine's <engine>.args (options) and <engine>.lock (every
# wheel by name, version and sha256) and the host's pip freeze. ENGINE=all means every engine with an .args file there.
BUNDLE_HOST ?= recipes/gpu-host
FREEZE ?= $(BUNDLE_HOST)/pip-freeze.txt
BUNDLE_ARGS ?=
BUNDLE_ENGINES = $(if $(filter all,$(ENGINE)),$(patsubst $(BUNDLE_HOST)/%.args,%,$(wildcard $(BUNDLE_HOST)/*.args)),$(ENGINE))
# One engine's bundle can need another package we build (SGLang's needs deep_ep), so the bundle verbs build every
# engine into DIST; `gpdist build` replaces only our own wheels there.
BUNDLE_BUILD = $(PY) -m gpdist build --engine all --out $(DIST) $(if $(filter 1,$(OFFLINE)),--offline)
BUNDLE_CMD = $(PY) -m gptools bundle --dist $(DIST) --host-freeze $(FREEZE)

.PHONY: help setup build install test test-fast test-upstream check lint rebase edit export bundle bundle-lock gpu-test prove clean

help: ## list the verbs
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'

$(VENV)/.ready: requirements-dev.txt
	@echo "setup: creating $(VENV) with the pinned developer tools"
	$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed (tomllib)")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --require-hashes -r requirements-dev.txt
	@touch $@

setup: $(VENV)/.ready ## create .venv with the pinned tools (pytest, ruff, pre-commit, vermin)

build: setup ## fetch + verify pinned upstream, patch, overlay, stamp, write dist/ (OFFLINE=1: cache only)
	$(PY) -m gpdist build --engine $(ENGINE) --out $(DIST) $(if $(filter 1,$(OFFLINE)),--offline)

# Not `install: build`: it installs what dist/ holds (and says `make build` when that is nothing), so that a test can
# run it against wheels other workers read at the same time.
install: setup ## dist/'s runtime wheel into INSTALL_VENV=.venv-dist: the `graphpersist` command (ENGINE=vllm: + vLLM)
	$(PY) -m gptools install --dist $(DIST) --venv $(INSTALL_VENV) --python $(PYTHON) $(if $(filter-out all,$(ENGINE)),--engine $(ENGINE))

# --dist loadfile: a file's tests share one worker, so a module's fixtures (a warm vLLM interpreter, a fake server)
# are set up once, not once per worker.
test: build ## build, then run the CPU test-suite (what CI runs; it includes test-upstream)
	$(TEST_ENV) GP_DIST_DIR=$(abspath $(DIST)) $(PY) -m pytest -n $(JOBS) --dist loadfile $(PYTEST_ARGS)

test-upstream: build ## vLLM's own tests of what we patch: same outcomes on our wheel (persistence off) and upstream's
	$(TEST_ENV) GP_DIST_DIR=$(abspath $(DIST)) $(PY) -m pytest tests/cpu/test_upstream_vllm.py -rA $(PYTEST_ARGS)

# No build and no network: tests marked network (downloads, dist/), slow or gpu are deselected, and pytest's summary
# says how many ("N deselected"; under xdist, its summaries section). The index URL points nowhere so that a fetch
# that slipped through fails at once.
test-fast: setup ## the CPU tests for the edit loop: no build, no network, no slow or GPU tests (1-3 min on 2 cores)
	$(TEST_ENV) GP_INDEX_URL=http://127.0.0.1:9/test-fast-uses-no-network $(PY) -m pytest -m "not network and not slow and not gpu" \
	  -p no:cacheprovider -n $(JOBS) --dist loadfile $(PYTEST_ARGS)

check: setup ## ruff, series lint, Python floor, zero-fuzz dry run, hooked functions, import loops, name resolution, function lengths
	$(VENV)/bin/pre-commit run --all-files
	$(PY) -m gptools apply --engine $(ENGINE) --dry-run
	$(PY) -m gptools hooks --engine $(ENGINE)
	$(PY) -m gptools imports
	$(PY) -m gptools names
	$(PY) -m gptools funclen

lint: check ## the same as make check

rebase: setup ## make rebase ENGINE=vllm VERSION=0.33.0 [FINISH=1]: re-apply the series on a new upstream, report
	@test -n "$(VERSION)" || { echo "usage: make rebase ENGINE=<vllm|sglang|deep_ep> VERSION=<new upstream version> [FINISH=1]"; exit 2; }
	$(PY) -m gptools rebase --engine $(ENGINE) --version $(VERSION) $(if $(FINISH),--finish) $(REBASE_ARGS)

edit: setup ## make edit ENGINE=vllm: materialize upstream + series as a git work tree to edit
	$(PY) -m gptools edit --engine $(ENGINE)

export: setup ## make export ENGINE=vllm: write the edited work tree back to patches/<engine>/
	$(PY) -m gptools export --engine $(ENGINE)

# From the committed lock: exactly its files (cached by sha256; OFFLINE=1: cache only), never a resolution.
bundle: setup ## make bundle [ENGINE=vllm|sglang]: offline bundle into .bundle/ from the committed <engine>.lock
	$(BUNDLE_BUILD)
	$(foreach e,$(BUNDLE_ENGINES),$(BUNDLE_CMD) @$(BUNDLE_HOST)/$(e).args --lock $(BUNDLE_HOST)/$(e).lock \
	  $(if $(filter 1,$(OFFLINE)),--offline) $(BUNDLE_ARGS) &&) true

bundle-lock: setup ## make bundle-lock ENGINE=vllm: resolve against the index again, rewrite <engine>.lock
	$(BUNDLE_BUILD)
	$(foreach e,$(BUNDLE_ENGINES),$(BUNDLE_CMD) @$(BUNDLE_HOST)/$(e).args --write-lock $(BUNDLE_HOST)/$(e).lock \
	  $(BUNDLE_ARGS) &&) true

gpu-test: ## GPU tests with the host's own python3 + torch (on the GPU host; no .venv, no network there)
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
	  $(PYTHON) -m pytest -m gpu tests/gpu -p no:cacheprovider -rA $(PYTEST_ARGS)

prove: ## make prove RECIPE=runtime-single-gpu: run a recipe's proof and write its report
	@test -n "$(RECIPE)" || { echo "usage: make prove RECIPE=<name under recipes/>"; exit 2; }
	$(MAKE) -C recipes/$(RECIPE) prove

clean: ## remove build outputs (the download cache outside the repo stays)
	rm -rf dist .work .bundle
