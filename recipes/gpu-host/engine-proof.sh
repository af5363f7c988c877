#!/usr/bin/env bash
# Runs an engine recipe's proof ON the GPU host, from the repository copy the device tool provides.
#   RECIPE=vllm-qwen3-8b-tp2 RUNS=save,load bash recipes/gpu-host/engine-proof.sh
# Installs the bundle from $BUNDLE_DIR (default /root/gpbundle, every part appended there by earlier calls) into
# $SITE once, then runs `python -m gptools.prove` into $PROOF_OUT (kept on the host between chained calls, so a
# later call can run the remaining runs and re-check all of them) and copies the report and the graphpersist lines
# of each run's log to $OUT. REFRESH=1 (debugging only) copies the repository's overlays over the installed ones
# first, so a Python-only change needs no new bundle; a committed report must come from a bundle of its commit.
set -uo pipefail
SITE=${SITE:-/root/gpsite}
BUNDLE_DIR=${BUNDLE_DIR:-/root/gpbundle}
PROOF_OUT=${PROOF_OUT:-/root/proof-${RECIPE:?set RECIPE}}
OUT=${OUT:-/tmp/engine-proof}
if [[ ! -d $SITE/graphpersist ]]; then
  echo "engine-proof: installing the bundle from $BUNDLE_DIR into $SITE"
  bash "$BUNDLE_DIR/install.sh" --target "$SITE" -- --no-compile 2>&1 | tail -3 || exit 1
fi
if [[ ${REFRESH:-0} == 1 ]]; then
  echo "engine-proof: REFRESH=1: overlays copied over the installed ones (not for committed reports)"
  for engine in vllm sglang; do
    [[ -d $SITE/$engine ]] && cp overlays/$engine/$engine/graphpersist_*.py "$SITE/$engine/"
  done
  cp -r overlays/graphpersist/graphpersist/. "$SITE/graphpersist/"
fi
export PYTHONPATH=$SITE:$PWD/tools
echo "engine-proof: $(date -u +%FT%TZ) recipe $RECIPE runs ${RUNS:-all} -> $PROOF_OUT"
timeout "${LIMIT:-580}" python3 -m gptools.prove "recipes/$RECIPE" --out "$PROOF_OUT" ${RUNS:+--runs "$RUNS"} --keep-going
rc=$?
mkdir -p "$OUT/proof"
cp "$PROOF_OUT"/REPORT.md "$PROOF_OUT"/report.json "$PROOF_OUT"/phases.png "$OUT/proof/" 2>/dev/null
for log in "$PROOF_OUT"/*/log.txt; do
  grep -E "graphpersist|Traceback|Error|refused" "$log" | tail -40 >"$OUT/proof/$(basename "$(dirname "$log")").log-excerpt.txt"
done
exit $rc
