#!/bin/sh
# Build the interposer (and the CPU test library) with gcc against the CUDA headers only; libcuda is
# dlopen'ed at run time, so this builds on machines without a driver.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/build}
cuda=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$out"
flags="-O2 -fPIC -shared -Wall -Wextra -Wno-unused-parameter -fvisibility=hidden"
srcs="gp_state.c gp_lookup.c gp_mem.c gp_ipc_hooks.c gp_image_hooks.c gp_control.c gp_graph.c gp_core.c gp_ipc.c"
set --
for s in $srcs; do set -- "$@" "$here/$s"; done
gcc $flags -I"$cuda/include" -o "$out/libgpinterpose.so" "$@" -ldl -lpthread
gcc -O2 -fPIC -shared -Wall -Wextra -fvisibility=default -o "$out/libgpcore_test.so" "$here/gp_core.c" "$here/gp_ipc.c"
echo "$out/libgpinterpose.so"
