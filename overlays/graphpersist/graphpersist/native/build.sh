#!/bin/sh
# Build the interposer (and the CPU test library) with gcc against the CUDA headers only; libcuda is
# dlopen'ed at run time, so this builds on machines without a driver.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/build}
cuda=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$out"
flags="-O2 -fPIC -shared -Wall -Wextra -Wno-unused-parameter -fvisibility=hidden"
gcc $flags -I"$cuda/include" -o "$out/libgpinterpose.so" "$here/interposer.c" "$here/gp_core.c" "$here/gp_ipc.c" -ldl -lpthread
gcc -O2 -fPIC -shared -Wall -Wextra -fvisibility=default -o "$out/libgpcore_test.so" "$here/gp_core.c" "$here/gp_ipc.c"
echo "$out/libgpinterpose.so"
