# The commands people type. `make demo` and `make test` work on a fresh
# machine with Python 3.11 and pip: they create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The vLLM release the differential tests run against (`make test-vllm
# VLLM=0.26.0`); 0.33.0, what CI runs, keeps the venv name .venv-vllm.
VLLM ?= 0.33.0
VLLM_VENV := $(if $(filter 0.33.0,$(VLLM)),.venv-vllm,.venv-vllm-$(VLLM))
VLLM_STAMP := $(VLLM_VENV)/.project-installed
# One release per release policy (replay.rules.coordinator.RELEASES), oldest first.
VLLM_RELEASES := 0.19.1 0.21.0 0.22.1 0.23.0 0.25.1 0.26.0 0.27.1 0.28.0 0.29.0 0.30.0 0.32.0 0.33.0 0.34.0
DEMO_TRACE := traces/demo-full-mamba-eagle.parquet

.PHONY: install demo demo-flagged test test-slow lint pytest smoke dist test-vllm test-vllm-releases test-ray bench traces clean mutants

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,record,watch]'
	touch $(STAMP)

# The first lookup the overrun flags under pre-49502, read from the results
# the demo writes: worked out before the commands that take it are shown, so
# they are shown as a user types them, values filled in.
FIRST_FLAGGED = $(BIN)/python -c "import polars as pl; \
  f = pl.read_parquet('out/demo.pre-49502.results.parquet').filter(pl.col('flags').list.contains('mamba_overrun')); \
  print(f['request_id'][0], f['seq'][0])"

demo: $(STAMP)
	@mkdir -p out
	@echo "== replay info: the bundled trace (full attention + Mamba, EAGLE, LRU store)"
	$(BIN)/replay info $(DEMO_TRACE)
	@echo
	@echo "== replay run, vLLM 0.33 semantics (the default policy): clean"
	$(BIN)/replay run $(DEMO_TRACE) -o out/demo.vllm-0.33.results.parquet
	@echo
	@echo "== replay run --policy pre-49502 (the releases before the Mamba gate; here the mirror of vLLM 0.26): the #43559 overrun is flagged"
	$(BIN)/replay run $(DEMO_TRACE) --policy pre-49502 -o out/demo.pre-49502.results.parquet --examples 2
	@echo
	@echo "== replay check, as CI runs it: exit 1 when a lookup has a corruption flag (--fail-on to choose)"
	@echo "$(BIN)/replay check out/demo.pre-49502.results.parquet --examples 1"
	@$(BIN)/replay check out/demo.pre-49502.results.parquet --examples 1 || echo "(replay check exited $$?: a corruption flag found)"
	@echo
	@set -- $$($(FIRST_FLAGGED)) && $(MAKE) --no-print-directory demo-flagged REQUEST=$$1 SEQ=$$2

# The second half of `make demo`: one flagged lookup (REQUEST at SEQ) looked into.
demo-flagged: $(STAMP)
	@echo "== replay explain: the first overrun, before #49502 ..."
	$(BIN)/replay explain $(DEMO_TRACE) --request $(REQUEST) --policy pre-49502
	@echo "== replay state: the store as that lookup saw it"
	$(BIN)/replay state $(DEMO_TRACE) --at $(SEQ) --show 2
	@echo
	@echo "== ... and with vLLM 0.33 (Mamba gets no peek margin)"
	$(BIN)/replay explain $(DEMO_TRACE) --request $(REQUEST)
	@echo "== replay diff: what #49502 changed on this trace"
	$(BIN)/replay diff $(DEMO_TRACE) --policy vllm-0.33 --policy pre-49502 --limit 3
	@echo
	$(BIN)/replay report out/demo.pre-49502.results.parquet --trace $(DEMO_TRACE) -o out/demo-report.html
	@echo "open out/demo-report.html in a browser for the charts and every flagged request"

lint: $(STAMP)
	$(BIN)/ruff check replay analysis tests benchmarks traces mutants
	$(BIN)/ruff format --check replay analysis tests benchmarks traces mutants
	$(BIN)/mypy --strict replay tests traces/build.py benchmarks mutants
	$(BIN)/lint-imports

# `make test` is the quick loop (about 1.5 minutes on a quiet 2-core machine,
# 2.5 under the load CI sees; it prints its time): the
# long fuzz, Hypothesis, seed-sweep and subprocess runs carry the `slow`
# marker and run in `make test-slow` (CI runs both; every test is in one of
# them, or in test-vllm / test-ray). Both spread the tests over the cores
# with pytest-xdist; PYTEST_WORKERS=0 runs them in this process.
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest -q -n $(PYTEST_WORKERS)

pytest: $(STAMP)
	$(PYTEST) -m "not vllm and not ray and not slow"

# Prints its own time: the quick loop's budget is the README's figure.
test: $(STAMP)
	@start=$$(date +%s); $(MAKE) --no-print-directory lint pytest; status=$$?; \
	  echo "make test: $$(( $$(date +%s) - start )) s (exit $$status)"; exit $$status

# Then the compiled kernels' tests again with numba's bounds checks, compiled
# afresh in a directory of their own: an index past an array is silent in
# the kernels (a block table sized by hash units overran with a long
# lookahead and corrupted the heap), an IndexError here. The KV batches'
# compiled reader and copy table too (a payload is anyone's bytes).
KERNEL_TESTS := tests/whatif tests/engine tests/rules/test_compiled_fixed_point.py \
  tests/sources/test_kv_columns.py tests/sources/test_kv_copies.py
test-slow: $(STAMP)
	$(PYTEST) -m "slow and not vllm and not ray"
	@cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	  NUMBA_BOUNDSCHECK=1 NUMBA_CACHE_DIR="$$cache" $(PYTEST) -p no:cacheprovider \
	    -m "not vllm and not ray and not slow" $(KERNEL_TESTS)

# What a user gets from `pip install .`: a fresh virtualenv without the dev
# extras (a wheel built from a copy of the checkout, not an editable install), then the
# console script on the bundled demo trace. Catches a module or data file the
# wheel leaves out and a runtime import of a dev tool. Writes only under out/.
SMOKE := out/smoke
SMOKE_BIN := $(SMOKE)/venv/bin

# The files git would ship (committed or not, never ignored ones), copied
# to $(1): a stale build/ in the checkout cannot put a deleted module in a wheel.
define shipped_files
	@mkdir -p $(1)
	git ls-files -z --cached --others --exclude-standard \
	  | xargs -0 sh -c 'for f do [ ! -e "$$f" ] || cp -P --parents "$$f" $(1); done' sh
endef

smoke:
	rm -rf $(SMOKE)
	$(call shipped_files,$(SMOKE)/src)
	$(PYTHON) -m venv $(SMOKE)/venv
	$(SMOKE_BIN)/pip install -q --upgrade pip
	$(SMOKE_BIN)/pip install -q --only-binary=:all: $(SMOKE)/src
	@! $(SMOKE_BIN)/python -c "import pytest" 2>/dev/null || { echo "smoke: pytest is installed, the dev extra leaked in"; exit 1; }
	cd $(SMOKE) && venv/bin/replay --help > help.txt
	grep -q "Usage: replay" $(SMOKE)/help.txt
	cd $(SMOKE) && venv/bin/replay --version
	cd $(SMOKE) && venv/bin/replay run $(CURDIR)/$(DEMO_TRACE) -o demo.results.parquet
	cd $(SMOKE) && venv/bin/replay check demo.results.parquet
	@# The regression corpus is package data: `replay test` with no path runs it.
	cd $(SMOKE) && venv/bin/replay test 2>/dev/null | tail -1 | grep -q "passed, 0 failed, 0 skipped"
	cd $(SMOKE) && venv/bin/python -c "from replay.format.results import read_results; from replay.format.tracedir import open_trace; \
	  frame, info = read_results('demo.results.parquet'); \
	  trace = open_trace('$(CURDIR)/$(DEMO_TRACE)').read_frame(['kind']); \
	  lookups = trace.filter(trace['kind'] == 'lookup').height; \
	  assert frame.height == lookups > 0, (frame.height, lookups); \
	  assert info['policy'] == 'vllm-0.33', info.get('policy'); \
	  print(f'smoke: {frame.height} lookups read back from demo.results.parquet')"

# The wheel a user installs without this checkout (README: Install):
# dist/cache_trace_replay-VERSION-py3-none-any.whl, built from the shipped
# files (the corpus inside), with pip's build isolation (setuptools from the
# index).
DIST_SRC := out/dist-src

dist:
	rm -rf $(DIST_SRC) dist
	$(call shipped_files,$(DIST_SRC))
	$(PYTHON) -m pip wheel -q --no-deps -w dist $(DIST_SRC)
	@rm -rf $(DIST_SRC)
	@ls dist/*.whl

# The differential tests against the real vLLM coordinators of one release,
# in a CPU virtualenv built once per release by tools/vllm-env.sh (a few
# minutes the first time). 0.33.0 runs every vLLM test; another release runs
# the lookup and the store differentials in the caches it has, against the
# policy that models it.
$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || bash tools/vllm-env.sh $(VLLM_VENV) $(VLLM)
	@echo "test-vllm: this package into $(VLLM_VENV), editable (pip's output: $(VLLM_VENV).log)"
	@$(VLLM_VENV)/bin/pip install -q -e '.[dev,record]' >> $(VLLM_VENV).log 2>&1 \
	  || { echo "test-vllm: the install failed; the last lines of $(VLLM_VENV).log:"; tail -n 20 $(VLLM_VENV).log; exit 1; }
	@touch $(VLLM_STAMP)

VLLM_TESTS := $(if $(filter 0.33.0,$(VLLM)),,tests/vllm/test_vllm_differential.py tests/vllm/test_store_rules_vllm.py)
# The newest release pinned in the corpus (besides 0.33.0, whose corpus run is
# tools/vllm-ci.sh): its expectations through that release's vLLM too.
VLLM_CORPUS := 0.34.0

# Then (for the release CI runs) the CI recipe of docs/ci.md, as a vLLM
# developer runs it on their branch (tools/vllm-ci.sh, from an empty
# directory: the shipped corpus through `replay test --junit-xml` and
# through pytest, and the drift check), with its reports in out/vllm-ci.
test-vllm: $(VLLM_STAMP)
	@echo "test-vllm: the vllm-marked tests against vLLM $(VLLM) ($(VLLM_VENV))"
	@$(VLLM_VENV)/bin/pytest -q -m vllm -p no:cacheprovider $(VLLM_TESTS)
	$(if $(VLLM_TESTS),,@echo "test-vllm: the CI recipe, tools/vllm-ci.sh $(VLLM_VENV)/bin/python")
	$(if $(VLLM_TESTS),,@REPLAY_INSTALL=0 OUT=out/vllm-ci bash tools/vllm-ci.sh $(VLLM_VENV)/bin/python)
	$(if $(filter $(VLLM),$(VLLM_CORPUS)),@echo "test-vllm: the shipped corpus through vLLM $(VLLM)'s own lookup path")
	$(if $(filter $(VLLM),$(VLLM_CORPUS)),@cd /tmp && $(CURDIR)/$(VLLM_VENV)/bin/python -m replay test --coordinator vllm)

# Every modelled release, one after the other (each venv is built once).
test-vllm-releases:
	@for v in $(VLLM_RELEASES); do \
	  echo "== vLLM $$v"; \
	  $(MAKE) --no-print-directory test-vllm VLLM=$$v || exit 1; \
	done

# The kill matrix of the corpus against one-line mutants of the installed
# vLLM's lookup path (mutants/vllm-0.33.toml), and its branch coverage of
# that path; slow (vLLM loads once, a forked process per mutant), not in CI.
mutants: $(VLLM_STAMP)
	@mkdir -p out
	$(VLLM_VENV)/bin/python -m mutants.matrix --json out/mutants.json

# The replay on a real two-node Ray cluster on this machine (the ray extra
# goes into .venv; `make test` never needs it).
RAY_STAMP := $(VENV)/.ray-installed

$(RAY_STAMP): pyproject.toml $(STAMP)
	$(BIN)/pip install -q -e '.[dev,ray]'
	touch $(RAY_STAMP)

test-ray: $(RAY_STAMP)
	$(BIN)/pytest -q -m ray -p no:cacheprovider

# The scale-out figures (serial against --workers) need the ray extra.
bench: $(RAY_STAMP)
	$(BIN)/python -m benchmarks.bench

traces: $(STAMP)
	$(BIN)/python -m traces.build

clean:
	rm -rf out bench-data .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
