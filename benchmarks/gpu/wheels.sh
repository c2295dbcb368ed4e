#!/usr/bin/env bash
# The wheels the GPU machine lacks, made here (it cannot reach a package index) into .whl/ in the repo
# root, which git ignores and the device tool carries (carry: [".whl"]); check.sh installs them there.
# For its Python 3.12 on x86-64 manylinux (device KINDS.md: torch 2.11 + CUDA, numpy, safetensors, rich,
# tqdm, einops, msgpack, ninja, psutil, py-cpuinfo, nvidia-ml-py are in its image; pydantic is not):
#   - zerodp's config: pydantic with its pydantic-core, annotated-types, typing-inspection, at the
#     versions installed here (the ones the tests ran with), and typing-extensions, of which pydantic
#     needs a newer one than the image may have (a newer one serves every older user);
#   - the deepspeed row: DeepSpeed 0.19.8 built here as a pure-Python wheel (DS_BUILD_OPS=0: its ops are
#     JIT-built there, with the nvcc and ninja the machine has) and hjson, the one need of it the image lacks.
# Usage: bash benchmarks/gpu/wheels.sh [--no-deepspeed]
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PYTHON:-python3}
rm -rf .whl && mkdir .whl
here() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pins=()
for name in pydantic pydantic-core annotated-types typing-inspection typing-extensions; do
    pins+=("$name==$(here "$name")")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}" hjson==3.1.0
# pydantic pins the exact pydantic-core it needs: a mismatch here would fail its import there.
need=$(unzip -p .whl/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
ls .whl/pydantic_core-"$need"-* >/dev/null || { echo "pydantic needs pydantic-core $need; got $(ls .whl)"; exit 1; }
if [[ ${1:-} != --no-deepspeed ]]; then
    tmp=$(mktemp -d)
    "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$tmp" deepspeed==0.19.8
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$tmp"/deepspeed-*.tar.gz
    rm -rf "$tmp"
fi
ls -la .whl && du -sh .whl
