#!/bin/bash
# Builds .tri/ (git-ignored) for benchmarks/calls/triton371.sh: the device image's missing packages and a newer Triton
# in under the 64 MiB a device call carries. Run here after ../shared/gpu/make_wheels.sh --extra torchao==0.18.0
# (which writes .whl/) and with fla-core's wheel in .whl/fla/:
#   site312.tar.xz   every .whl/*.whl unpacked (a wheel is a zip; xz packs the sources ~2.5x tighter)
#   fla/             fla-core's wheel, kept apart (a process sees flash-linear-attention only where asked)
#   triton371.tar.xz Triton 3.7.1 for CPython 3.12 without its binaries (ptxas, cuobjdump, nvdisasm: the image's
#                    Triton 3.6 lends its own), its profiler library and CUPTI, libtriton.so stripped (the AMD
#                    backend stays: Triton imports every backend its entry points name)
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
grep -qx '/.tri/' .git/info/exclude 2>/dev/null || echo '/.tri/' >> .git/info/exclude
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
rm -rf .tri && mkdir -p .tri/fla "$work/site" "$work/tri"
for w in .whl/*.whl; do unzip -q -o "$w" -d "$work/site"; done
tar -C "$work/site" -cf - . | xz -T2 -9 > .tri/site312.tar.xz
cp .whl/fla/*.whl .tri/fla/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_27_x86_64 \
    -d "$work" triton==3.7.1
unzip -q "$work"/triton-3.7.1-*.whl -d "$work/tri"
cd "$work/tri"
strip --strip-unneeded triton/_C/libtriton.so
rm -rf triton/backends/nvidia/bin triton/backends/nvidia/lib/cupti triton/_C/libproton.so \
    triton/instrumentation
tar -cf - triton triton-3.7.1.dist-info | xz -T2 -9 > "$root/.tri/triton371.tar.xz"
du -sh "$root"/.tri/*
