# Two commands do all set-up on a fresh machine (Debian 12, Python 3.11, root or sudo for apt):
#   make demo   the main job (synthetic ad-like traffic, embedded defaults; `make demo-movielens`: real data)
#   make test   the whole test suite (installs redis-server, Java 17, PostgreSQL, chromium and its driver if
#               missing, and the S3 test server)
# A second run reinstalls nothing: the venv is rebuilt only when requirements.txt or pyproject.toml change, or TORCH.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# PyTorch's build (requirements.txt pins torch==2.13.0, which both meet; docs/install.md):
#   TORCH=cpu   (default) 2.13.0+cpu, from PyTorch's CPU wheel index (TORCH_CPU_INDEX), or with no index added when
#               pip's own configuration already offers that wheel (a find-links folder, as on the project's machines:
#               checked with --no-index first, so an index this machine cannot reach is never asked)
#   TORCH=cuda  PyPI's build for CUDA 13 and the nvidia-* libraries it pulls, pinned by requirements-cuda.txt
TORCH ?= cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ifeq ($(TORCH),cpu)
TORCH_ARGS = torch==2.13.0+cpu $$($(BIN)/pip install --quiet --dry-run --no-deps --no-index torch==2.13.0+cpu \
	>/dev/null 2>&1 || echo --extra-index-url $(TORCH_CPU_INDEX))
else ifeq ($(TORCH),cuda)
TORCH_ARGS = -c requirements-cuda.txt
else
$(error TORCH=$(TORCH): use TORCH=cpu or TORCH=cuda)
endif
STAMP := $(VENV)/.installed-$(TORCH)
# The tests' S3-API server (moto) lives in its own venv: see requirements-s3.txt.
S3VENV := .venv-s3
S3STAMP := $(S3VENV)/.installed
# Spark 4 runs on Java 17; another JDK on PATH (e.g. 25) is not used.
JAVA17 := $(firstword $(wildcard /usr/lib/jvm/java-17-openjdk-*))
ifneq ($(JAVA17),)
export JAVA_HOME := $(JAVA17)
endif
export PYSPARK_PYTHON := $(abspath $(BIN)/python)
export PYSPARK_DRIVER_PYTHON := $(abspath $(BIN)/python)
export SPARK_LOCAL_IP := 127.0.0.1
PYTEST_ARGS ?=
# The suite runs on 2 pytest-xdist workers, one test module each at a time (module fixtures start once); alone it
# keeps a 2-core machine about 70% idle (Spark, JVM and Airflow start-ups wait): BENCHMARKS.md "Suite durations".
TEST_WORKERS ?= 2

.PHONY: demo demo-movielens test venv sysdeps browserdeps pgdeps clean airflow

venv: $(STAMP)

$(STAMP): requirements.txt requirements-cuda.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt $(TORCH_ARGS)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	$(BIN)/pip check
	rm -f $(VENV)/.installed*
	touch $@

$(S3STAMP): requirements-s3.txt requirements.txt
	test -x $(S3VENV)/bin/python || $(PYTHON) -m venv $(S3VENV)
	$(S3VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements-s3.txt
	$(S3VENV)/bin/pip check
	touch $@

sysdeps:
	@command -v redis-server >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q redis-server; }
	@ls /usr/lib/jvm/java-17-openjdk-*/bin/java >/dev/null 2>&1 || \
		{ apt-get update -q && apt-get install -y -q openjdk-17-jre-headless; }

# The browser test's headless Chromium and its driver (the tests only; the demo needs no browser).
browserdeps:
	@{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || \
		{ apt-get update -q && apt-get install -y -q chromium chromium-driver; }

# The production-topology test's Airflow metadata DB (Debian's PostgreSQL server; the tests start their own).
pgdeps:
	@ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || \
		{ apt-get update -q && apt-get install -y -q postgresql; }

demo: $(STAMP) sysdeps
	$(BIN)/solaris demo --workdir artifacts/demo --reports reports/quick

# MovieLens-100K: real data, where pairs never recur (what SOLARIS cannot do for such a log).
demo-movielens: $(STAMP) sysdeps
	$(BIN)/solaris demo --dataset movielens --workdir artifacts/demo-movielens

test: $(STAMP) $(S3STAMP) sysdeps browserdeps pgdeps
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Airflow for real with the project's DAGs (API server + UI on 127.0.0.1:$(AIRFLOW_PORT), scheduler, ...), with
# the settings a demo's refresh ran with (its data, models, offline store; DEMO=artifacts/demo-movielens for
# MovieLens'): run `make demo` first.
AIRFLOW_PORT ?= 8080
DEMO ?= artifacts/demo
airflow: $(STAMP)
	@test -f $(DEMO)/solaris.env || { echo "no $(DEMO)/solaris.env: run make demo first"; exit 1; }
	set -a && . $(DEMO)/solaris.env && set +a && \
	$(BIN)/solaris airflow --home artifacts/airflow --port $(AIRFLOW_PORT)

clean:
	rm -rf artifacts reports/quick .pytest_cache
