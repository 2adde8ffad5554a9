# rmb-relay: the two commands are `make run` and `make test`; everything else supports them.
# All installs are idempotent: a stamp file or a `command -v` check guards each one.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
LISTEN ?= 127.0.0.1:8080
# Release build by default: tests and benchmarks exercise the same code users run.
MATURIN_FLAGS ?= --release
# every Rust file, in the layer folders too (rust/codec/, rust/dialects/...)
RUST_SOURCES := $(shell find rust -name "*.rs") Cargo.toml Cargo.lock
PY_STAMP := $(VENV)/.deps-stamp
BUILD_STAMP := $(VENV)/.build-stamp
PROTO_OUT := tests/_proto
# the envelope classes the SDK and rmb-peer use at run time: generated into the package and
# committed, so every install path (`pip install .`, an sdist, a wheel) has them without protoc;
# `make proto` regenerates them after an edit of proto/ (tests/test_install_proto.py checks)
PROTO_PKG := python/rmb_relay/_proto
PROTO_SRC := proto/types.proto proto/peer.proto

# Profile-guided build (PGO=1, the default of `make wheel` and `make bench`; every other target,
# `make run` and `make test` among them, builds a plain release core unless PGO=1 is given, so a
# first `make run` serves without waiting for the training): the core is built
# instrumented, trained by bench/pgo_train.py (the benchmarks' own load, ~1.5 min), and built
# again with the profile. Hot paths laid out together cost less where it matters, with cold
# caches at a request per wakeup (bench/pgo_train.py says what was measured). Without rustup's
# llvm-tools (added here when rustup can fetch them: its dist server is not one of every machine's
# registries) the build goes on without a profile, and says so. Debian's llvm-profdata cannot
# stand in: the profile's format follows rustc's own LLVM.
PGO ?= $(if $(filter wheel bench,$(MAKECMDGOALS)),1,0)
PGO_DIR := target/pgo
PGO_PROFILE := $(PGO_DIR)/merged.profdata
PGO_TRAINING := bench/pgo_train.py bench/scenarios.py bench/tunnel.py bench/singyeong.py
LLVM_PROFDATA = ls $$(rustc --print sysroot)/lib/rustlib/*/bin/llvm-profdata 2>/dev/null | head -1
# the profile-using build's flags and its own target dir (clippy and cargo test keep theirs: a
# change of RUSTFLAGS would rebuild everything in a shared one, both ways), when there is one
# (an empty profile stands for "no llvm-profdata here", so that make does not retry every time)
PGO_ENV = if [ "$(PGO)" = 1 ] && [ -s $(PGO_PROFILE) ]; then \
	  export RUSTFLAGS="-Cprofile-use=$(abspath $(PGO_PROFILE))" CARGO_TARGET_DIR=$(abspath target/pgo-use); \
	else echo "build: a plain release build (no PGO profile)"; fi;

SBD_TESTER := .tools/sbd-tester/bin/sbd-o-bahn-server-tester-bin
# the tester's build cache lives outside the clone, so a fresh clone on the same machine rebuilds in seconds
SBD_TESTER_TARGET ?= $(HOME)/.cache/rmb-relay/sbd-tester-target

.PHONY: run test lint cargo-test pytest build dev wheel bench system-deps clean build-profiling proto sbd-conformance fuzz fuzz-sockets

run: $(BUILD_STAMP) ## start the relay on embedded defaults (no Redis, no chain)
	$(BIN)/rmb-relay -l $(LISTEN)

# pytest last, so its summary line closes the output
test: system-deps $(BUILD_STAMP) proto lint cargo-test sbd-conformance pytest ## everything CI runs

system-deps: ## redis-server, tmux (rmb-relay top's test), iproute2 (the fault lab's namespaces) and a Java runtime for PySpark (Debian packages), only when missing
	@need=""; \
	command -v redis-server >/dev/null || need="$$need redis-server"; \
	command -v tmux >/dev/null || need="$$need tmux"; \
	command -v ip >/dev/null || need="$$need iproute2"; \
	command -v java >/dev/null || need="$$need openjdk-17-jre-headless"; \
	if [ -n "$$need" ]; then \
	  echo "installing:$$need"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$need; \
	fi

$(PY_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q maturin
	$(PY) -m pip install -q $$($(PY) -c 'import tomllib;d=tomllib.load(open("pyproject.toml","rb"))["project"];print(" ".join(repr(x) for x in d["dependencies"]+d["optional-dependencies"]["dev"]))' | tr -d "'")
	touch $@

$(BUILD_STAMP): $(PY_STAMP) $(RUST_SOURCES) $(PROTO_PKG)/types_pb2.py $(if $(filter 1,$(PGO)),$(PGO_PROFILE))
	$(PGO_ENV) VIRTUAL_ENV=$(abspath $(VENV)) $(BIN)/maturin develop -q $(MATURIN_FLAGS)
	$(PY) -c 'import rmb_relay._core'
	touch $@

build: $(BUILD_STAMP) ## build the extension into the venv (profile-guided unless PGO=0)

# the instrumented core, staged beside a copy of the package so that only the training loads it
# (the baseline relays of the training import the tests' protobuf classes: PROTO_OUT)
$(PGO_PROFILE): $(PY_STAMP) $(RUST_SOURCES) $(PROTO_PKG)/types_pb2.py $(PROTO_OUT)/types_pb2.py $(PGO_TRAINING)
	@if [ -z "$$($(LLVM_PROFDATA))" ] && command -v rustup >/dev/null; then \
	  timeout 180 rustup component add llvm-tools || echo "pgo: rustup could not add llvm-tools"; \
	fi
	@if [ -z "$$($(LLVM_PROFDATA))" ]; then \
	  echo "pgo: llvm-profdata not found (rustup component add llvm-tools): building without a profile"; \
	  mkdir -p $(PGO_DIR) && : > $@; exit 0; \
	fi; \
	set -e; rm -rf $(PGO_DIR); mkdir -p $(PGO_DIR)/python; \
	RUSTFLAGS="-Cprofile-generate=$(abspath $(PGO_DIR))/raw" CARGO_TARGET_DIR=$(abspath target/pgo-gen) \
	  cargo build -q --release --features extension-module --lib; \
	cp -r python/rmb_relay $(PGO_DIR)/python/; \
	cp target/pgo-gen/release/lib_core.so $(PGO_DIR)/python/rmb_relay/_core.abi3.so; \
	PYTHONPATH=$(abspath $(PGO_DIR))/python RMB_BENCH_RESULTS=$(abspath $(PGO_DIR))/results \
	  $(PY) -m bench.pgo_train; \
	$$($(LLVM_PROFDATA)) merge -o $@ $(PGO_DIR)/raw

build-profiling: $(PY_STAMP) ## release build with debug symbols, for py-spy/perf
	VIRTUAL_ENV=$(abspath $(VENV)) $(BIN)/maturin develop --profile profiling
	rm -f $(BUILD_STAMP)

proto: $(PROTO_PKG)/types_pb2.py $(PROTO_OUT)/types_pb2.py ## protobuf classes: the package's (SDK, rmb-peer) and the tests' reference copy

$(PROTO_PKG)/types_pb2.py: $(PROTO_SRC) $(PY_STAMP)
	mkdir -p $(PROTO_PKG)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=$(PROTO_PKG) --pyi_out=$(PROTO_PKG) $(PROTO_SRC)
	printf '"""Envelope classes generated from proto/ by `make proto` (committed: every install path has them)."""\n' > $(PROTO_PKG)/__init__.py

$(PROTO_OUT)/types_pb2.py: $(PROTO_SRC) $(PY_STAMP)
	mkdir -p $(PROTO_OUT)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=$(PROTO_OUT) $(PROTO_SRC)
	touch $(PROTO_OUT)/__init__.py

lint: $(BUILD_STAMP) proto
	$(BIN)/ruff check python tests bench
	$(BIN)/ruff format --check python tests bench
	$(BIN)/mypy --strict python/rmb_relay
	$(BIN)/python -m mypy.stubtest rmb_relay._core --ignore-missing-stub --allowlist stubtest-allowlist.txt 2>&1 | tail -20; exit $${PIPESTATUS[0]}
	cargo fmt --check
	cargo clippy --all-targets -q -- -D warnings

cargo-test:
	cargo test -q

pytest: $(BUILD_STAMP) proto
	$(BIN)/pytest -q --durations=30

bench: $(BUILD_STAMP) proto ## micro benchmarks with ratios against pure-Python baselines
	$(BIN)/pytest bench -q --benchmark-enable --benchmark-columns=min,mean,ops -p no:randomly

# --locked pins the crate's own Cargo.lock; should that ever stop resolving, fall back to a fresh
# resolution (and say so) rather than leave the suite unbuilt
$(SBD_TESTER):
	CARGO_TARGET_DIR=$(SBD_TESTER_TARGET) cargo install -q sbd-o-bahn-server-tester --version 0.4.0 --locked --root .tools/sbd-tester \
	  || { echo "sbd tester: --locked failed to resolve; installing with a fresh resolution" >&2; \
	       CARGO_TARGET_DIR=$(SBD_TESTER_TARGET) cargo install -q sbd-o-bahn-server-tester --version 0.4.0 --root .tools/sbd-tester; }

sbd-conformance: $(SBD_TESTER) $(BUILD_STAMP) ## the public SBD conformance suite against our relay
	@timeout 600 $(SBD_TESTER) $(abspath $(PY)) -u -m rmb_relay.commands.sbd_obahn \
	  >.tools/sbd-conformance.out 2>.tools/sbd-conformance.log; status=$$?; \
	  sed -n '/TEST RESULTS/,$$p' .tools/sbd-conformance.out; \
	  [ $$status = 0 ] || { echo "SBD conformance failed ($$status); see .tools/sbd-conformance.{out,log}"; exit $$status; }

wheel: $(PY_STAMP) $(PROTO_PKG)/types_pb2.py $(if $(filter 1,$(PGO)),$(PGO_PROFILE)) ## release wheel into dist/ (profile-guided unless PGO=0)
	$(PGO_ENV) $(BIN)/maturin build --release -o dist

clean:
	rm -rf target dist $(VENV) $(PROTO_OUT)

# ---- fuzzing (issue 9): `make test` runs a short pass of every target (cargo test runs the Rust
# targets over their seed corpus and mutations, pytest the socket fuzzer with 60 examples each);
# `make fuzz` runs them for real. New inputs go to fuzz/work/, never into the committed corpus.
FUZZ_TARGETS := http_request ws_frames rmb_envelope sg_frame http_response
FUZZ_RUNS ?= 10000000
FUZZ_EXAMPLES ?= 20000

fuzz: $(BUILD_STAMP) proto ## cargo fuzz each Rust target for FUZZ_RUNS inputs, then the socket fuzzer
	command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
	for target in $(FUZZ_TARGETS); do \
	  mkdir -p fuzz/work/$$target && \
	  cargo +nightly fuzz run $$target $(CURDIR)/fuzz/work/$$target $(CURDIR)/fuzz/corpus/$$target \
	    -- -runs=$(FUZZ_RUNS) -print_final_stats=1 || exit 1; \
	done
	$(MAKE) fuzz-sockets

# 4 tests x FUZZ_EXAMPLES examples against one relay process, in chunks of 25,000 (Hypothesis
# restarts, the relay does not); 250000 (1,000,000 inputs) takes about half an hour
fuzz-sockets: $(BUILD_STAMP) proto ## the socket fuzzer alone, FUZZ_EXAMPLES examples per test
	mkdir -p fuzz/work
	RMB_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) RMB_FUZZ_REPORT=fuzz/work/sockets.txt \
	  $(PY) -m pytest tests/test_fuzz_sockets.py -q -p no:randomly --timeout=0 \
	  --hypothesis-show-statistics
