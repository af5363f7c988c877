#!/usr/bin/env bash
# The install proof, run ON the GPU host once every part of the vLLM bundle is in $BUNDLE_DIR (see README.md).
# Checks: the bundle verifies; a corrupted part and a missing part are refused; install.sh installs into a --target
# folder; vLLM and graphpersist import from there. Writes proof.txt and proof.json to $OUT. Exit 1 if a check failed.
set -uo pipefail
B=${BUNDLE_DIR:-/root/gpbundle}
SITE=${SITE:-/root/gpsite}
OUT=${OUT:-/tmp/gpbundle-proof}
W=$(mktemp -d /tmp/gpbundle-proof.XXXXXX)  # per-step outputs; only proof.txt and proof.json go to $OUT
mkdir -p "$OUT"
LOG=$OUT/proof.txt
: >"$LOG"
declare -a RESULTS=()
log() { echo "$*" | tee -a "$LOG"; }
record() { RESULTS+=("$1|$2|$3"); log "[$2] $1 ($3 s)"; }
now() { date +%s.%N; }
dt() { python3 -c "print(f'{$2-$1:.1f}')"; }

log "# host: $(hostname) $(python3 -c 'import platform,sys; print(sys.version.split()[0], platform.platform())')"
log "# gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
log "# date: $(date -u +%FT%TZ)"
log "# parts: $(cd "$B" && ls -l *.part* | awk '{print $5, $9}' | tr '\n' ' ')"

t=$(now); bash "$B/install.sh" --verify-only >>"$LOG" 2>&1; rc=$?
record "bundle verifies (install.sh --verify-only)" "$([[ $rc == 0 ]] && echo pass || echo FAIL)" "$(dt "$t" "$(now)")"

# A corrupted part: copy one part, flip one byte, link the others.
BAD=/tmp/gpbundle-bad; rm -rf "$BAD"; mkdir -p "$BAD"
cp "$B/install.sh" "$BAD/"
for p in "$B"/*.part*; do ln -s "$p" "$BAD/$(basename "$p")"; done
victim=$(cd "$B" && ls *.part* | sed -n 2p); [[ -n "$victim" ]] || victim=$(cd "$B" && ls *.part* | head -1)
rm "$BAD/$victim"; cp "$B/$victim" "$BAD/$victim"
python3 -c "import sys; f=open(sys.argv[1],'r+b'); f.seek(12345); b=f.read(1); f.seek(12345); f.write(bytes([b[0]^1]))" "$BAD/$victim"
t=$(now); bash "$BAD/install.sh" --target /tmp/gpbundle-bad-site >"$W/corrupt.out" 2>&1; rc=$?
cat "$W/corrupt.out" >>"$LOG"
ok=$([[ $rc == 1 ]] && grep -q "part $victim is CORRUPTED" "$W/corrupt.out" && [[ ! -e /tmp/gpbundle-bad-site ]] && echo pass || echo FAIL)
record "corrupted part $victim refused (rc=$rc, nothing installed)" "$ok" "$(dt "$t" "$(now)")"

last=$(cd "$B" && ls *.part* | tail -1); rm "$BAD/$last"
t=$(now); bash "$BAD/install.sh" --verify-only >"$W/missing.out" 2>&1; rc=$?
cat "$W/missing.out" >>"$LOG"
ok=$([[ $rc == 1 ]] && grep -q "part $last is MISSING" "$W/missing.out" && echo pass || echo FAIL)
record "missing part $last refused (rc=$rc)" "$ok" "$(dt "$t" "$(now)")"
rm -rf "$BAD"

rm -rf "$SITE"
t=$(now); bash "$B/install.sh" --target "$SITE" -- --no-compile >"$W/install.out" 2>&1; rc=$?
cat "$W/install.out" >>"$LOG"
record "install.sh --target $SITE (rc=$rc)" "$([[ $rc == 0 ]] && echo pass || echo FAIL)" "$(dt "$t" "$(now)")"

export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
t=$(now)
python3 -c "import vllm; print(vllm.__version__)" >"$W/import.out" 2>"$W/import.err"; rc=$?
log "\$ python3 -c \"import vllm; print(vllm.__version__)\""; cat "$W/import.out" | tee -a "$LOG"
tail -5 "$W/import.err" >>"$LOG"
ok=$([[ $rc == 0 ]] && grep -Eq '^0\.26\.0(\+gp\.1)?$' "$W/import.out" && echo pass || echo FAIL)
record "import vllm (version $(tail -1 "$W/import.out"))" "$ok" "$(dt "$t" "$(now)")"

t=$(now)
python3 - >"$W/import2.out" 2>"$W/import2.err" <<'EOF'
import importlib.metadata as md
import graphpersist
import vllm
from vllm import LLM
print("importlib.metadata vllm:", md.version("vllm"))
print("graphpersist:", md.version("graphpersist"), graphpersist.__file__)
print("vllm from:", vllm.__file__)
print("LLM:", LLM)
EOF
rc=$?
cat "$W/import2.out" | tee -a "$LOG"; tail -5 "$W/import2.err" >>"$LOG"
ok=$([[ $rc == 0 ]] && grep -q "importlib.metadata vllm: 0.26.0+gp.1" "$W/import2.out" && echo pass || echo FAIL)
record "import graphpersist; from vllm import LLM; metadata says 0.26.0+gp.1" "$ok" "$(dt "$t" "$(now)")"

# Informational (not checks): flashinfer imports; what pip check says about the recorded exclusions.
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1 | tee -a "$LOG"
log "\$ python3 -m pip check (informational: excluded/accepted requirements show up here)"
python3 -m pip check 2>&1 | head -40 | tee -a "$LOG"

python3 - "$OUT/proof.json" "${RESULTS[@]}" <<'EOF'
import json, sys
rows = [dict(zip(("check", "result", "seconds"), r.split("|"))) for r in sys.argv[2:]]
json.dump(rows, open(sys.argv[1], "w"), indent=1)
EOF
failed=$(printf '%s\n' "${RESULTS[@]}" | grep -c '|FAIL|')
log "# $((${#RESULTS[@]} - failed))/${#RESULTS[@]} checks passed"
[[ $failed == 0 ]]
