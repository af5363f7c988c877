#!/usr/bin/env bash
# Debugging aid on the GPU host: run the driver for a few starts in order, each with a time limit, logs to $OUT.
# usage: TP=1 OUT=/tmp/o bash smoke.sh save:save:/root/arch/a load:load:/root/arch/a [off:off:-]
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/smoke}; TP=${TP:-2}; LIMIT=${LIMIT:-420}
mkdir -p "$OUT"
for spec in "$@"; do
  IFS=: read -r name mode archive <<<"$spec"
  mkdir -p "$OUT/$name/stats"
  args=(--run "$name" --mode "$mode" --result "$OUT/$name/result.json" --tp "$TP")
  [[ "$archive" != "-" ]] && args+=(--archive "$archive")
  echo "smoke: $(date +%T) $name: mode=$mode tp=$TP archive=$archive"
  t=$(date +%s.%N)
  GRAPHPERSIST_STATS_DIR="$OUT/$name/stats" GP_PROOF_LOG="$OUT/$name/log.txt" \
    timeout -k 10 "$LIMIT" setsid python3 "$HERE/driver.py" "${args[@]}" >"$OUT/$name/log.txt" 2>&1
  rc=$?
  pkill -9 -f "driver.py --run $name" 2>/dev/null; sleep 2
  echo "smoke: $name rc=$rc in $(python3 -c "import time;print(round(time.time()-$t,1))") s"
  grep -E "graphpersist|driver:|Error|error|Traceback" "$OUT/$name/log.txt" | grep -v "^\s*$" | tail -25
  [[ -f "$OUT/$name/result.json" ]] && python3 -c "import json,sys;r=json.load(open(sys.argv[1]));print({k:r.get(k) for k in ('ok','error','start_to_ready_s','phases','latency','jit')})" "$OUT/$name/result.json"
done
