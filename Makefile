# recserve: `make demo` runs the main job, `make test` runs the tests.
# Both create/refresh one virtualenv (.venv) from the fully pinned requirements.lock.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# fbgemm's CPU build here; the CUDA build on machines with a working NVIDIA driver ("auto";
# "cpu" / "cuda" force one). scripts/install.sh decides, for make and the Dockerfile alike.
FBGEMM_VARIANT ?= auto
PACKAGES := recserve embedding_server ranker cascade generation
PYTEST_ARGS ?=

.PHONY: venv demo test unit integration typecheck protos redis browser bench-scheduler bench-sharding bench-lookup bench-rank bench-recall clean

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml scripts/install.sh
	@# Debian strips ensurepip from its python3; python3-venv brings it back.
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); echo 'installing python3-venv (Debian) for the virtualenv'; apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null && $(PYTHON) -m venv $(VENV); } || { echo 'cannot create .venv: install python3-venv (apt-get install python3-venv)'; exit 1; }
	@# The one install (the Dockerfile runs the same script): the lock, fbgemm, torchrec --no-deps, recserve.
	sh scripts/install.sh $(BIN)/python $(FBGEMM_VARIANT) editable
	@touch $@

demo: $(STAMP)
	$(BIN)/recserve demo

typecheck: $(STAMP)
	$(BIN)/mypy $(PACKAGES)

# pytest exits 5 when it collects no tests; make treats any non-zero exit as failure.
# `browser`: the status page's test drives Debian's headless Chromium.
test: $(STAMP) typecheck browser
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests

unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

integration: $(STAMP) browser
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/integration

# Regenerate the committed gRPC stubs (package recserve.v1) from protos/.
protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/recserve/v1/*.proto

# redis-server from Debian, for the lookup benchmark's Redis contender.
redis:
	@command -v redis-server >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; } || echo "redis-server could not be installed; the benchmark reports null Redis fields with the reason"

# Debian's chromium + chromium-driver, for the status page's headless-browser test
# (nothing may download a browser build). Without them that test fails and says why.
browser:
	@{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } || echo "chromium / chromium-driver could not be installed; the status-page browser test will fail"

bench-scheduler: $(STAMP)
	$(BIN)/recserve bench scheduler

bench-sharding: $(STAMP)
	$(BIN)/recserve bench sharding

bench-lookup: $(STAMP) redis
	$(BIN)/recserve bench lookup

bench-rank: $(STAMP)
	$(BIN)/recserve bench rank

# 1M items: generating and training take most of it; `make bench-recall RECALL_ITEMS=200000` for a shorter run.
RECALL_ITEMS ?= 1000000
bench-recall: $(STAMP)
	$(BIN)/recserve bench recall --items $(RECALL_ITEMS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache build *.egg-info
