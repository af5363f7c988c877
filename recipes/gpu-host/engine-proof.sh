#!/usr/bin/env bash
# Runs an engine recipe's proof ON the GPU host, from the repository copy the device tool provides.
#   RECIPE=vllm-qwen3-8b-tp2 RUNS=save,load bash recipes/gpu-host/engine-proof.sh
#   RECIPE=diagnosis/vllm-qwen3-8b-tp1-startup bash recipes/gpu-host/engine-proof.sh   (a diagnosis record)
# The engine is the first word of the recipe folder's name (vllm-..., sglang-...; ENGINE= overrides it). Installs that engine's
# bundle from $BUNDLE_DIR (default /root/gpbundle-<engine>, every part appended there by earlier calls) into $SITE
# (default /root/gpsite-<engine>: a vLLM and an SGLang install live side by side on one warm host) once, then runs
# `python -m gptools.prove` into $PROOF_OUT (kept on the host between chained calls, so a later call can run the
# remaining runs and re-check all of them) and copies the report and a tarball of every run's log, stats and result
# to $OUT. STACKS=1 (diagnosis) has every Python process sample its stacks (stacksample/sitecustomize.py; read them
# with stacksample/stackview.py) into $OUT/proof/stacks.tgz; a LOAD's engine processes are left unsampled, since
# sampling can make them refuse their setup (stacksample/sitecustomize.py says why).
# Real weights: when the recipe's proof.toml uses `{real_model}` and RUNS is unset (every run) or names a run ending in
# `_real` or a repetition of one (`load_real_2`; the recipes name their real-checkpoint runs so),
# GP_REAL_MODEL=${REAL_MODEL:-/root/qwen3-8b-random} and recipes/gpu-host/real_checkpoint.py writes that checkpoint
# first (about 16 GiB, 1-3 min, once: a no-op when it is complete); the proof's time limit (LIMIT) is shortened by the
# time it took.
# REFRESH=1 (debugging only) copies the repository's overlays over the installed ones first, so a Python-only change
# needs no new bundle; a committed report must come from a bundle of its commit (or say which fix REFRESH carried).
set -uo pipefail
RECIPE=${RECIPE:?set RECIPE (a folder under recipes/)}
NAME=${RECIPE%/}
NAME=${NAME##*/}  # the folder's own name: diagnosis/vllm-qwen3-8b-tp1-race -> vllm-qwen3-8b-tp1-race
ENGINE=${ENGINE:-${NAME%%-*}}
case $ENGINE in
  vllm | sglang) ;;
  *) echo "engine-proof: cannot tell the engine of recipe $RECIPE (got '$ENGINE'): set ENGINE=vllm or ENGINE=sglang" >&2; exit 2 ;;
esac
SITE=${SITE:-/root/gpsite-$ENGINE}
BUNDLE_DIR=${BUNDLE_DIR:-/root/gpbundle-$ENGINE}
PROOF_OUT=${PROOF_OUT:-/root/proof-$NAME}
OUT=${OUT:-/tmp/engine-proof}
if [[ ! -d $SITE/graphpersist || ! -d $SITE/$ENGINE ]]; then
  echo "engine-proof: installing the $ENGINE bundle from $BUNDLE_DIR into $SITE"
  bash "$BUNDLE_DIR/install.sh" --target "$SITE" -- --no-compile 2>&1 | tail -3 || exit 1
  if [[ ! -d $SITE/$ENGINE ]]; then
    echo "engine-proof: $SITE has no $ENGINE after the install: is $BUNDLE_DIR the $ENGINE bundle (gpbundle-$ENGINE.*)?" >&2
    exit 1
  fi
  # The install skips bytecode (--no-compile, short) and the host sets PYTHONDONTWRITEBYTECODE=1, so without this every
  # process would compile every module it imports from source at each start; a normal pip install writes them.
  t=$SECONDS
  python3 -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 ||
    echo "engine-proof: compileall could not compile some files (they compile at import, as without it)"
  echo "engine-proof: bytecode of $SITE written in $((SECONDS - t)) s"
fi
bash "$(dirname "$0")/host-bytecode.sh"
if [[ ${REFRESH:-0} == 1 ]]; then
  echo "engine-proof: REFRESH=1: overlays copied over the installed ones (not for committed reports)"
  cp -r "overlays/$ENGINE/$ENGINE/." "$SITE/$ENGINE/"   # overlays are whole modules: a tree copied onto the package
  cp -r overlays/graphpersist/graphpersist/. "$SITE/graphpersist/"
fi
export PYTHONPATH=$SITE:$PWD/tools
limit=${LIMIT:-580}
if grep -q '{real_model}' "recipes/$RECIPE/proof.toml" 2>/dev/null && [[ -z ${RUNS:-} || ,$RUNS, =~ _real(_[0-9])?, ]]; then
  export GP_REAL_MODEL=${REAL_MODEL:-/root/qwen3-8b-random}
  echo "engine-proof: real-weight runs: GP_REAL_MODEL=$GP_REAL_MODEL; python3 recipes/gpu-host/real_checkpoint.py $GP_REAL_MODEL"
  t=$SECONDS
  python3 recipes/gpu-host/real_checkpoint.py "$GP_REAL_MODEL" || exit 1
  limit=$(( limit - (SECONDS - t) > 30 ? limit - (SECONDS - t) : 30 ))  # timeout 0 would mean none
  echo "engine-proof: checkpoint ready after $((SECONDS - t)) s; the proof gets ${limit} s"
fi
if [[ ${STACKS:-0} == 1 ]]; then
  export GP_STACKS_DIR=$PROOF_OUT-stacks PYTHONPATH=$PWD/recipes/gpu-host/stacksample:$PYTHONPATH
  echo "engine-proof: STACKS=1: stack samples of every Python process go to $GP_STACKS_DIR"
fi
echo "engine-proof: $(date -u +%FT%TZ) recipe $RECIPE runs ${RUNS:-all} -> $PROOF_OUT"
timeout "$limit" python3 -m gptools.prove "recipes/$RECIPE" --out "$PROOF_OUT" ${RUNS:+--runs "$RUNS"} --keep-going
rc=$?
mkdir -p "$OUT/proof"
cp "$PROOF_OUT"/REPORT.md "$PROOF_OUT"/report.json.gz "$PROOF_OUT"/phases.png "$OUT/proof/" 2>/dev/null
(cd "$PROOF_OUT" && tar czf "$OUT/proof/logs.tgz" --exclude='*/cache' --exclude='archives' --exclude='cache-warm*' \
  ./*/log.txt ./*/result.json ./*/stats ./*/run.json ./*/runner-state.*.json ./*/restored-ranges.*.json ./*/region-sums.*.json ./*/memory-owners.*.json.gz ./archives-*.diff.txt ./*/dot-* ./*/cprofile.* 2>/dev/null)
[[ -n ${GP_STACKS_DIR:-} ]] && tar czf "$OUT/proof/stacks.tgz" -C "$GP_STACKS_DIR" .
exit $rc
