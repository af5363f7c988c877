#!/bin/sh
# Build the interposer with gcc alone: no CUDA toolkit (gp_cuda.h declares the driver API it uses) and no libcuda
# (dlopen'ed at run time). Reproducible: sources are compiled by relative name from this folder, fixed flags, no
# build id, stripped, so the same sources and compiler give the same bytes (the runtime wheel ships this build).
# libdl.so.2 and libpthread.so.0 stay needed: on glibc < 2.34 dlopen & co. live there (gp_glibc.h).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/build}
mkdir -p "$out"
out=$(cd "$out" && pwd)
srcs="gp_state.c gp_lookup.c gp_mem.c gp_ipc_hooks.c gp_host.c gp_image_hooks.c gp_control.c gp_graph.c gp_core.c gp_ipc.c"
cd "$here"
# shellcheck disable=SC2086
gcc -O2 -fPIC -shared -Wall -Wextra -Wno-unused-parameter -fvisibility=hidden -g0 -ffile-prefix-map="$here"=. \
    -Wl,--build-id=none -Wl,--hash-style=gnu -s -o "$out/libgpinterpose.so" $srcs \
    -Wl,--no-as-needed -l:libdl.so.2 -l:libpthread.so.0
echo "$out/libgpinterpose.so"
