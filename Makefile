# specdec developer entry points. Each target sets itself up from nothing: it creates the venv
# if missing, installs the pinned torch (a CUDA 13.0 build: the CUDA kernels compile even on a
# machine without a GPU) and builds the extension in place.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.14.1
MAX_JOBS ?= 2
BIN := $(VENV)/bin
DEPS_STAMP := $(VENV)/.specdec-deps
INSTALL_STAMP := $(VENV)/.specdec-installed
BUILD_STAMP := $(VENV)/.specdec-built
SOURCES := setup.py $(shell find csrc -type f 2>/dev/null)
# The Triton kernels run on CPU tensors through Triton's interpreter when there is no GPU.
TEST_ENV := TRITON_INTERPRET=$${TRITON_INTERPRET:-$$($(BIN)/python -c 'import torch; print(0 if torch.cuda.is_available() else 1)')}

DOCS_STAMP := $(VENV)/.specdec-docs

.PHONY: demo test bench results docs build clean lint

# The main job: every decoder on the embedded default family, one table (a few minutes on 2 CPU
# cores); image grids and MuLo-SD's acceptance/island maps as PNGs in out/. The kernel demo that
# stood here is `python -m specdec.demo`.
DEMO_IMAGES ?= 30
demo: $(BUILD_STAMP)
	$(BIN)/python -m specdec.cli compare --num-images $(DEMO_IMAGES) --seed 0 --json out/compare.json --out-dir out

test: $(BUILD_STAMP)
	$(TEST_ENV) $(BIN)/python -m pytest -q tests

# pyflakes and pycodestyle over the Python sources (rules in pyproject.toml, [tool.ruff]).
lint: $(DEPS_STAMP)
	$(BIN)/ruff check specdec triton_kernels tests benchmarks

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

$(DEPS_STAMP): requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install torch==$(TORCH_VERSION) -r requirements-dev.txt
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

clean:
	rm -rf build site specdec/_C*.so *.egg-info $(BUILD_STAMP) $(INSTALL_STAMP)
