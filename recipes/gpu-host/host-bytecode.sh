#!/usr/bin/env bash
# Writes the bytecode the GPU host's interpreter lacks, once per host (engine-proof.sh calls it before a proof).
# The host's python3 ships some packages without bytecode and sets PYTHONDONTWRITEBYTECODE=1, so each process
# compiled them from source at every import (measured 2026-12-02: torch's 2141 modules had no .pyc; `import torch`
# took 3.3-4.0 s, 2.2 s with them, in every process an engine spawns, baseline and LOAD alike). A pip install on a
# serving host writes bytecode, so a proof measures start-up as there. compileall skips modules whose bytecode is
# current.
# HOST_BYTECODE=0 leaves the host as it is.
set -uo pipefail
MARK=${HOST_BYTECODE_MARK:-/root/.gp-host-bytecode}
if [[ ${HOST_BYTECODE:-1} != 1 ]]; then
  echo "host-bytecode: HOST_BYTECODE=${HOST_BYTECODE}: the host's packages are left without their missing bytecode"
  exit 0
fi
[[ -e $MARK ]] && exit 0
t=$SECONDS
purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || exit 1
python3 -m compileall -q -j 0 "$purelib" >/dev/null 2>&1 ||
  echo "host-bytecode: compileall could not compile some modules of $purelib (they compile at import, as before)"
touch "$MARK"
echo "host-bytecode: missing bytecode of $purelib written in $((SECONDS - t)) s"
