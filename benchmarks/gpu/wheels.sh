#!/usr/bin/env bash
# Wheels the GPU machine lacks (it cannot reach a package index): pydantic for zerodp's config, and
# DeepSpeed for the deepspeed2 rows, built here as a pure-Python wheel (DS_BUILD_OPS=0: its ops are
# JIT-built there, with the nvcc and ninja the machine has). Writes them to .whl/ in the repo root,
# which git ignores and the device tool carries (carry: [".whl"]). Python 3.12, x86-64 (KINDS.md).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .whl && mkdir .whl
plat=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .whl pydantic pydantic-core annotated-types typing-inspection hjson
# pydantic pins the exact pydantic-core it needs: fetch that one if the latest differs.
need=$(unzip -p .whl/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
if ! ls .whl/pydantic_core-"$need"-* >/dev/null 2>&1; then
    rm -f .whl/pydantic_core-*
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plat[@]}" -d .whl "pydantic-core==$need"
fi
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" deepspeed
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl "$tmp"/deepspeed-*.tar.gz
rm -rf "$tmp"
ls -la .whl
