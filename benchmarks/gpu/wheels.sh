#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what the GPU machine lacks, for benchmarks/gpu/run.sh:
# keras, namex and optree as CPython 3.12 manylinux x86_64 wheels, this project as a
# wheel, .whl/source.json (the commit the wheel was built from) and, unless --no-data,
# the shared CIFAR-10 subset in .whl/data/cifar-10-batches-py (18 MB). Run it here,
# then carry ".whl" with the device call. The machine there has Python 3.12, jax with
# CUDA, torch, numpy, absl-py, rich, h5py, ml-dtypes, packaging and matplotlib.
#
#   bash benchmarks/gpu/wheels.sh [--no-data]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
data=1
[ "${1:-}" = "--no-data" ] && data=0

# The versions this checkout is tested with (its .venv), else these.
version() {
    "$python" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || echo "$2"
}
keras=$(version keras 3.15.1)
namex=$(version namex 0.1.0)
optree=$(version optree 0.20.0)

rm -rf .whl
mkdir -p .whl
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    "keras==$keras" "namex==$namex" "optree==$optree"
had_build=$([ -e build ] && echo 1 || echo 0)
"$python" -m pip wheel -q --no-deps --no-build-isolation -w .whl . >/dev/null
[ "$had_build" = 1 ] || rm -rf build

commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
dirty=$([ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && echo true || echo false)
printf '{"commit": "%s", "dirty": %s, "built": "%s"}\n' "$commit" "$dirty" \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > .whl/source.json

if [ "$data" = 1 ] && [ -f ../shared/data/cifar-10-batches-py/data_batch_1 ]; then
    mkdir -p .whl/data
    cp -r ../shared/data/cifar-10-batches-py .whl/data/
    chmod -R u+w .whl/data
fi

# keras's own needs, which the GPU machine must already have.
echo "keras $keras needs (the GPU machine has absl-py, numpy, rich, h5py, ml-dtypes, packaging):"
"$python" -m zipfile -e .whl/keras-*.whl /tmp/keras-wheel-meta >/dev/null 2>&1 || true
grep -h '^Requires-Dist' /tmp/keras-wheel-meta/keras-*.dist-info/METADATA | grep -v extra \
    | sed 's/^/  /' || true
rm -rf /tmp/keras-wheel-meta
ls -l .whl
du -sh .whl
size=$(du -sm .whl | cut -f1)
if [ "$size" -gt 60 ]; then
    echo "wheels.sh: .whl is $size MiB: over what one device call can carry" >&2
    exit 1
fi
