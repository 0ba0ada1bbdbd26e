#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Compiles cudapool's C++ allocator class (python/cudapool/csrc), and the
# benchmark's build of it (bench/torch_allocator_bench.cpp), against
# PyTorch 2.11.0 and against the newest torch on the package index, on a
# machine without a GPU: the torch wheels are downloaded (no dependencies),
# only their headers and the four libraries the class links are unpacked,
# and the CUDA headers come from NVIDIA's pip packages. Nothing imports
# torch. Needs lib/libcudapool.so (make lib), python3 with pip, g++, nm.
#
#   .ci/torch_ext_compile.sh [VERSION ...]     default: 2.11.0 newest
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WORK=${TORCH_EXT_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/cudapool-torch-ext.XXXXXX")}
trap 'rm -rf "$WORK"' EXIT
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.11.0 newest)
PIP=(python3 -m pip download --quiet --no-deps --only-binary=:all: --disable-pip-version-check)

# CUDA runtime headers (cuda_runtime_api.h) and crt/host_config.h.
"${PIP[@]}" -d "$WORK/cuda" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*"
for w in "$WORK"/cuda/*.whl; do python3 -m zipfile -e "$w" "$WORK/cuda/x"; done
CUDA_INC=$(dirname "$(find "$WORK/cuda/x" -name cuda_runtime_api.h | head -n 1)")
echo "CUDA headers: $CUDA_INC"

status=0
for v in "${versions[@]}"; do
    spec="torch==$v"
    [ "$v" = newest ] && spec=torch
    d="$WORK/torch-$v"
    mkdir -p "$d"
    "${PIP[@]}" -d "$d" "$spec"
    whl=$(ls "$d"/torch-*.whl)
    python3 - "$whl" "$d/x" <<'PYEOF'
import sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
libs = {"libc10.so", "libc10_cuda.so", "libtorch_cuda.so", "libtorch_cpu.so"}
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith("torch/include/") or n == "torch/version.py" or (n.startswith("torch/lib/") and n.rsplit("/", 1)[1] in libs):
            z.extract(n, dest)
PYEOF
    rm -f "$whl"
    got=$(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$d/x/torch/version.py")
    echo "== torch $got ($spec)"
    # The shipped class, then the benchmark's build of it (bench/bench_ext.py).
    for build in shipped bench; do
        so="$d/cudapool_torch_$build.so"
        if [ $build = shipped ]; then
            cmd=(python3 -c "import sys; sys.path.insert(0, 'python'); from cudapool._ext import main; sys.exit(main(sys.argv[1:]))")
        else
            cmd=(python3 bench/bench_ext.py)
        fi
        if "${cmd[@]}" --torch-dir "$d/x/torch" --cuda-include "$CUDA_INC" --library "$ROOT/lib/libcudapool.so" --out "$so"; then
            # Every cudapool_* the class calls must exist in libcudapool.so.
            missing=$(comm -23 <(nm -D --undefined-only "$so" | awk '{print $2}' | grep '^cudapool_' | sort) \
                               <(nm -D --defined-only lib/libcudapool.so | awk '{print $3}' | sort))
            if [ -n "$missing" ]; then echo "FAIL: symbols missing from libcudapool.so: $missing"; status=1; else
                echo "ok    $build class compiled against torch $got; every cudapool_* it calls is exported"; fi
        else
            echo "FAIL: the $build C++ allocator class does not compile against torch $got"; status=1
        fi
    done
    rm -rf "$d"
done
exit $status
