#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the copy vendored in llama-cpp-python's sdist (PyPI), for
# `mlxgate bench --spawn llama-server` (make bench). Not run by CI: it compiles for minutes.
#
#   benches/build_llama_server.sh [--avx2-only] [LLAMA_CPP_PYTHON_VERSION]
#       ->  benches/.cache/bin/llama-server (or llama-server-avx2)
#
# CPU only, native instructions (-DGGML_NATIVE=ON), OpenMP threads; cmake comes from PyPI.
# --avx2-only builds for AVX2, FMA and F16C without AVX-512 (what many users' x86 CPUs have), to
# set against `MLXGATE_NO_AVX512=1 mlxgate serve` on a machine that has AVX-512.
set -euo pipefail
flavour=native
if [ "${1:-}" = "--avx2-only" ]; then
    flavour=avx2
    shift
fi
version=${1:-0.3.16}
here=$(cd "$(dirname "$0")" && pwd)
work=$here/.cache/llama-build
bin=$here/.cache/bin
uv=$here/../.tools/bin/uv
mkdir -p "$work" "$bin"
[ -x "$uv" ] || make -C "$here/.." .tools/bin/uv
cd "$work"
if [ ! -d "llama_cpp_python-$version" ]; then
    # The sdist itself, from PyPI's simple index, checked against the hash the index gives
    # (pip download would build the sdist's build dependencies, cmake among them, from source).
    python3 - "$version" <<'PY'
import hashlib, re, sys, urllib.request as request
name = f"llama_cpp_python-{sys.argv[1]}.tar.gz"
index = request.urlopen("https://pypi.org/simple/llama-cpp-python/").read().decode()
url, sha256 = re.search(rf'href="([^"#]*/{re.escape(name)})#sha256=([0-9a-f]+)"', index).groups()
data = request.urlopen(url).read()
assert hashlib.sha256(data).hexdigest() == sha256, f"{name}: sha256 mismatch"
open(name, "wb").write(data)
PY
    tar xzf "llama_cpp_python-$version.tar.gz"
fi
source=$work/llama_cpp_python-$version/vendor/llama.cpp
if [ "$flavour" = avx2 ]; then
    build=build-avx2 name=llama-server-avx2
    instructions=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
        -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF)
else
    build=build name=llama-server instructions=(-DGGML_NATIVE=ON)
fi
"$uv" run --no-project --with cmake cmake -S "$source" -B "$build" -DCMAKE_BUILD_TYPE=Release \
    "${instructions[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
"$uv" run --no-project --with cmake cmake --build "$build" --target llama-server -j "$(nproc)"
cp "$build/bin/llama-server" "$bin/$name"
"$bin/$name" --version 2>&1 | head -2
echo "built $bin/$name: LLAMA_SERVER=$bin/$name mlxgate bench --spawn llama-server"
