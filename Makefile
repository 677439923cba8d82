# specdec developer entry points. Each target sets itself up from nothing: it creates the venv
# if missing, installs the pinned torch (a CUDA 13.0 build: the CUDA kernels compile even on a
# machine without a GPU) and builds the extension in place.
#
# Another torch of the supported range (README, "Install"): `make test TORCH_VERSION=2.13.0` sets
# up .venv-2.13.0 the same way, from nothing, and installs specdec there as a user would
# (`pip install --no-build-isolation .`, not in place: one source tree, one extension per torch).
# `make matrix` runs the kernel, op and decoder tests for each release of TORCH_MATRIX.
PYTHON ?= python3
TORCH_PINNED := 2.14.1
TORCH_VERSION ?= $(TORCH_PINNED)
TORCH_MATRIX ?= 2.13.0 2.15.0
ifeq ($(TORCH_VERSION),$(TORCH_PINNED))
VENV ?= .venv
else
VENV ?= .venv-$(TORCH_VERSION)
endif
MAX_JOBS ?= 2
BIN := $(VENV)/bin
DEPS_STAMP := $(VENV)/.specdec-deps
INSTALL_STAMP := $(VENV)/.specdec-installed
BUILD_STAMP := $(VENV)/.specdec-built
SOURCES := setup.py $(shell find csrc build_support -type f -not -name '*.pyc' 2>/dev/null)
# torch.compile's kernels (C++ on a CPU: some ten seconds of compiling per graph, and the tests
# compile a few hundred graphs) are kept outside the tree, one cache per torch release, so that a
# fresh clone's tests (CI's) reuse what earlier runs compiled, as the wheel cache does for torch.
INDUCTOR_CACHE ?= $(HOME)/.cache/specdec/inductor-$(TORCH_VERSION)
# The Triton kernels run on CPU tensors through Triton's interpreter when there is no GPU.
TEST_ENV := TORCHINDUCTOR_CACHE_DIR=$${TORCHINDUCTOR_CACHE_DIR:-$(INDUCTOR_CACHE)} TRITON_INTERPRET=$${TRITON_INTERPRET:-$$($(BIN)/python -c 'import torch; print(0 if torch.cuda.is_available() else 1)')}

DOCS_STAMP := $(VENV)/.specdec-docs

.PHONY: demo test test-kernels test-hf-newest matrix serve bench results docs build clean lint

# The main job: every decoder on the embedded default family, one table (a few minutes on 2 CPU
# cores); image grids and MuLo-SD's acceptance/island maps as PNGs in out/. The kernel demo that
# stood here is `python -m specdec.demo`.
DEMO_IMAGES ?= 30
demo: $(BUILD_STAMP)
	$(BIN)/python -m specdec.cli compare --num-images $(DEMO_IMAGES) --seed 0 --json out/compare.json --out-dir out

# The suite on TEST_WORKERS processes (pytest-xdist; the tests of a file stay in one process, with
# its module fixtures: most decoder tests run one thread, and two processes use both cores), then
# the tests marked `isolated` alone (tests/serve's Ray cluster, whose start waits on processes of
# its own).
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadfile
test: $(BUILD_STAMP)
	$(TEST_RUN) -q $(PARALLEL) -m "not isolated" $(TESTS_AT)tests
	$(TEST_RUN) -q -m isolated $(TESTS_AT)tests/serve

# The embedded family behind an OpenAI-compatible image endpoint on http://127.0.0.1:8000, MuLo-SD by
# default (docs/serving.md); more flags in SERVE_FLAGS, e.g. SERVE_FLAGS="--method ssd --concurrency 16".
SERVE_FLAGS ?=
serve: $(BUILD_STAMP)
	$(BIN)/python -m specdec.cli serve $(SERVE_FLAGS)

# The kernel, op and decoder tests: what CI runs for each torch of the matrix (a few minutes).
KERNEL_TESTS ?= tests/kernels/test_torch_versions.py tests/kernels/test_cuda_toolkit.py \
	tests/kernels/test_build.py tests/kernels/test_dispatch.py tests/kernels/test_pool_probs.py \
	tests/kernels/test_sample_residual.py tests/kernels/test_verify_grid.py \
	tests/kernels/test_tree_attention.py tests/decoding/test_decoding_methods.py \
	tests/decoding/test_decoding_ssd.py tests/decoding/test_scheduler.py
# The Triton machine-code checks (no spills, 128-bit loads) hold for the pinned torch's Triton;
# another Triton release lowers the same kernels differently, so the matrix leaves them out (and
# the compiled scheduler check, minutes of compiling, runs with the pinned torch only, as does the
# sweep of seeds and arrivals, which checks the scheduler's logic, not the torch release).
KERNEL_TESTS_DESELECT ?= tests/kernels/test_build.py::test_triton_kernels_lower_to_sm90a \
	tests/kernels/test_build.py::test_triton_pooling_kernels_use_128bit_loads \
	tests/decoding/test_scheduler.py::test_a_compiled_scheduler_gives_the_eager_tokens \
	tests/decoding/test_scheduler.py::test_a_sweep_of_seeds_and_concurrencies_gives_each_image_its_decode_alone
test-kernels: $(BUILD_STAMP)
	$(TEST_RUN) -q $(PARALLEL) $(addprefix $(TESTS_AT),$(KERNEL_TESTS)) $(addprefix --deselect=,$(KERNEL_TESTS_DESELECT))

matrix:
	set -e; for v in $(TORCH_MATRIX); do $(MAKE) --no-print-directory test-kernels TORCH_VERSION=$$v; done
	$(MAKE) --no-print-directory test-hf-newest TORCH_VERSION=$(lastword $(TORCH_MATRIX))

# pyflakes and pycodestyle over the Python sources (rules in pyproject.toml, [tool.ruff]).
lint: $(DEPS_STAMP)
	$(BIN)/ruff check specdec triton_kernels tests benchmarks build_support setup.py

bench: $(BUILD_STAMP)
	$(TEST_ENV) $(BIN)/python benchmarks/run.py

results: $(DEPS_STAMP)
	$(BIN)/python benchmarks/make_results.py

# The MkDocs site in site/, from docs/ and mkdocs.yml: a broken link, a missing page or a
# docstring reference that does not resolve fails the build. The API pages read the sources
# (griffe), so this needs neither torch nor the compiled extension, only the venv.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

$(DOCS_STAMP): requirements-docs.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -r requirements-docs.txt
	touch $@

build: $(BUILD_STAMP)

ifeq ($(TORCH_VERSION),$(TORCH_PINNED))
# The source tree on the path (`python -m`) is the package: editable install, extension in place.
TEST_RUN := $(TEST_ENV) $(BIN)/python -m pytest
TESTS_AT :=

$(DEPS_STAMP): requirements-dev.txt requirements-serve.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install torch==$(TORCH_VERSION) -r requirements-dev.txt -r requirements-serve.txt
	touch $@

# Editable install of the Python packages (specdec, and triton_kernels/ as specdec.triton_kernels).
$(INSTALL_STAMP): $(DEPS_STAMP) setup.py pyproject.toml
	SPECDEC_NO_EXT=1 $(BIN)/python -m pip install --no-build-isolation --no-deps -e .
	touch $@

# specdec._C built in place; ninja recompiles only what changed. Serialised with flock, since
# several shells may ask for a rebuild at once.
$(BUILD_STAMP): $(INSTALL_STAMP) $(SOURCES)
	flock /tmp/specdec-build.lock env MAX_JOBS=$(MAX_JOBS) $(BIN)/python setup.py -q build_ext --inplace
	touch $@
else
# The tests import the installed specdec: pytest's own script (not `python -m pytest`), started
# in the venv's folder, keeps the source tree (whose in-place extension belongs to the pinned
# torch) off sys.path, in pytest and in the interpreters the tests start (`python -c`).
TEST_RUN = export $(TEST_ENV) && cd $(VENV) && $(abspath $(BIN))/pytest --rootdir=$(CURDIR) -p no:cacheprovider
TESTS_AT := $(CURDIR)/
# Machines whose pip configuration caps torch (ours do, at the releases kept on local disk) would
# refuse the exact release asked for here: an empty constraints file lifts the cap for this venv.
VPIP := PIP_CONSTRAINT=/dev/null $(BIN)/python -m pip
# torch and its CUDA libraries (a few GB for a CUDA build) are downloaded once into a wheel cache
# outside the tree, which CI's fresh clones on the same machine reuse.
WHEELHOUSE ?= $(HOME)/.cache/specdec/wheels/torch-$(TORCH_VERSION)
# One architecture keeps the CUDA compile of these builds short (the pinned build has both);
# exported, so that the tests expect the architectures the build was given.
MATRIX_ARCHS ?= 9.0a
export TORCH_CUDA_ARCH_LIST ?= $(MATRIX_ARCHS)
PY_SOURCES := $(shell find specdec triton_kernels -name '*.py' 2>/dev/null)

$(DEPS_STAMP): requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(VPIP) download -q -d $(WHEELHOUSE) torch==$(TORCH_VERSION)
	$(VPIP) install --no-index --find-links $(WHEELHOUSE) torch==$(TORCH_VERSION)
	$(VPIP) install torch==$(TORCH_VERSION) -r requirements-dev.txt
	touch $@

$(INSTALL_STAMP): $(DEPS_STAMP)
	touch $@

# The transformers adapters on the newest transformers the package index has (the suite runs them
# on the pinned one), in the newest torch's venv of the matrix: a rename there (5.25's `cache` for
# the layers' `past_key_values`) is caught while the old name still works.
test-hf-newest: $(BUILD_STAMP)
	$(VPIP) install -q -U transformers
	$(TEST_RUN) -q $(PARALLEL) $(TESTS_AT)tests/models/hf

# What a user runs; ninja reuses the objects in build/torch-<version>/ that did not change.
$(BUILD_STAMP): $(INSTALL_STAMP) pyproject.toml $(SOURCES) $(PY_SOURCES)
	flock /tmp/specdec-build.lock env MAX_JOBS=$(MAX_JOBS) \
		$(VPIP) install -q --no-build-isolation --no-deps --force-reinstall .
	cd / && $(abspath $(BIN))/python -c 'import specdec; print("specdec built:", specdec.build_info()["extension_build"])'
	touch $@
endif

clean:
	rm -rf build site specdec/_C*.so specdec/_C_build.json *.egg-info $(BUILD_STAMP) $(INSTALL_STAMP)
