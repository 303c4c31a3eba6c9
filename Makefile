# mlxgate: `make serve` and `make test` are all a fresh machine needs. `make help` lists the rest.

.DEFAULT_GOAL := help
SHELL := /bin/bash

UV_VERSION := 0.13.9
TOOLS := .tools
UV := $(TOOLS)/bin/uv
VENV := .venv
PY := $(VENV)/bin/python
COMPAT_VENV := .venv-compat
HOST ?= 127.0.0.1
PORT ?= 8080
ARGS ?=

export UV_PYTHON_DOWNLOADS := never
export UV_PROJECT_ENVIRONMENT := $(VENV)

.PHONY: help
help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(UV):
	python3 -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet --disable-pip-version-check "uv==$(UV_VERSION)"

.PHONY: system-deps
system-deps: ## install the C runtime OpenBLAS needs (libgfortran5) if it is missing (Linux)
	@if [ "$$(uname)" = Linux ] && ! ldconfig -p | grep -q 'libgfortran.so.5 '; then \
		echo "installing libgfortran5 (OpenBLAS needs it)"; \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libgfortran5 >/dev/null; \
	fi

.PHONY: env
env: system-deps $(UV) ## create .venv from uv.lock and build the Rust extension into it
	$(UV) sync --locked --python python3

.PHONY: lock
lock: $(UV) ## re-resolve uv.lock after changing dependencies in pyproject.toml
	$(UV) lock --python python3

.PHONY: serve
serve: env ## serve the embedded model on http://$(HOST):$(PORT) (extra flags: ARGS="--model ...")
	$(VENV)/bin/mlxgate serve --host $(HOST) --port $(PORT) $(ARGS)

.PHONY: test
test: env ## run every Rust and Python test
	cargo test --locked
	$(VENV)/bin/pytest $(ARGS)

.PHONY: test-fast
test-fast: env ## the Rust tests and the Python tests that start no server and load no model
	cargo test --locked
	$(VENV)/bin/pytest -m "not slow" $(ARGS)

.PHONY: pip-check
pip-check: ## what a plain `pip install .` gives in a fresh venv (no uv): mlxgate and its extension import
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; set -e; \
	python3 -m venv "$$tmp/venv"; \
	"$$tmp/venv/bin/pip" install --quiet --disable-pip-version-check .; \
	cd "$$tmp" && "$$tmp/venv/bin/python" -c \
		"import mlxgate, mlxgate._native; print('pip install . imports', mlxgate.__file__)"

.PHONY: compat
compat: env ## the newest LiteLLM, OpenAI Agents, pydantic-ai, LangChain and openai against a real server
	[ -x $(COMPAT_VENV)/bin/python ] || $(UV) venv --python python3 $(COMPAT_VENV)
	$(UV) pip install --quiet --upgrade --python $(COMPAT_VENV)/bin/python -r compat/requirements.txt
	@$(UV) pip list --python $(COMPAT_VENV)/bin/python 2>/dev/null | grep -E \
		'^(openai|anthropic|litellm|openai-agents|pydantic-ai-slim|langchain-(openai|anthropic)|httpx-sse) '
	$(COMPAT_VENV)/bin/pytest compat $(ARGS)

.PHONY: lint
lint: env ## ruff, mypy, stub check and clippy
	$(VENV)/bin/ruff check python tests benches compat kernels
	$(VENV)/bin/ruff format --check python tests benches compat kernels
	$(VENV)/bin/mypy
	$(PY) -m mypy.stubtest mlxgate._native
	cargo clippy --all-targets --locked -- -D warnings
	cargo clippy --features python --locked -- -D warnings

.PHONY: bench
BENCH_OUT ?= benches/results/bench-$(shell date +%Y%m%d-%H%M%S)
bench: env ## the standard comparison: mlxgate, mlx_lm.server, llama-server, every scenario (about an hour)
	LLAMA_SERVER=$${LLAMA_SERVER:-benches/.cache/bin/llama-server} $(VENV)/bin/mlxgate bench \
		--spawn mlxgate --spawn mlx_lm --spawn llama-server --concurrency 1,2,4,8,16,32 \
		--scenarios sweep,long,hol,prefix,disconnect,agent \
		--trace benches/traces/claude-code.jsonl --sessions 2 --out $(BENCH_OUT) $(ARGS)

.PHONY: bench-micro
bench-micro: env ## the microbenchmarks (criterion and pytest-benchmark)
	cargo bench --locked
	$(VENV)/bin/pytest benches --benchmark-enable $(ARGS)

.PHONY: bench-router
bench-router: env ## one router step of 1/32/256 streams: Rust vs pure Python (pytest-benchmark)
	$(VENV)/bin/pytest benches/test_router_bench.py --benchmark-enable \
		--benchmark-columns=min,median,mean,stddev,rounds --benchmark-sort=name $(ARGS)

.PHONY: bench-stream
bench-stream: env ## 1,000 streaming clients on a fake engine: Rust router vs pure Python (events/s)
	$(PY) benches/stream_server.py $(ARGS)

.PHONY: soak
soak: env ## 30 minutes of mixed load on one server: failures, RSS, ITL drift (benches/soak.py)
	$(PY) benches/soak.py $(ARGS)

.PHONY: fuzz-tools
fuzz-tools: ## nightly Rust and cargo-fuzz, which the fuzz targets need (installed if missing)
	@rustup run nightly rustc --version >/dev/null 2>&1 || rustup toolchain install nightly --profile minimal
	@command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked

.PHONY: fuzz
FUZZ_SECONDS ?= 600
FUZZ_RUNS ?= 10000
FUZZ_TARGETS = router jsonscan stop sse
fuzz: fuzz-tools ## run each libFuzzer target (fuzz/) for FUZZ_SECONDS from its committed corpus, adding to it
	@for target in $(FUZZ_TARGETS); do \
		echo "== $$target: $(FUZZ_SECONDS) s"; \
		cargo +nightly fuzz run -O $$target fuzz/corpus/$$target -- \
			-max_total_time=$(FUZZ_SECONDS) -max_len=512 -print_final_stats=1 || exit 1; \
	done

.PHONY: fuzz-smoke
fuzz-smoke: fuzz-tools ## each fuzz target for FUZZ_RUNS inputs from its committed corpus (CI; the corpus is left as it is)
	@new=$$(mktemp -d); trap 'rm -rf "$$new"' EXIT; \
	for target in $(FUZZ_TARGETS); do \
		echo "== $$target: $(FUZZ_RUNS) runs"; \
		mkdir -p "$$new/$$target"; \
		cargo +nightly fuzz run -O $$target "$$new/$$target" fuzz/corpus/$$target -- \
			-runs=$(FUZZ_RUNS) -max_len=512 -print_final_stats=1 || exit 1; \
	done

.PHONY: fuzz-cmin
fuzz-cmin: fuzz-tools ## after a campaign: keep only the corpus inputs that reach an edge no other one does
	@for target in $(FUZZ_TARGETS); do \
		cargo +nightly fuzz cmin -O $$target fuzz/corpus/$$target -- -use_counters=0 -max_len=512 \
			|| exit 1; \
	done

.PHONY: clean
clean: ## remove build outputs and environments
	rm -rf $(VENV) $(COMPAT_VENV) $(TOOLS) target python/mlxgate/*.so
