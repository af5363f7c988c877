#!/usr/bin/env bash
# A SAVE and a LOAD of an engine recipe with the allocation trace on, ON the GPU host, then what tells why a LOAD
# refused `setup tensor N differs`, in one call:
#   RECIPE=vllm-qwen3-8b-tp1 bash recipes/gpu-host/traced-pair.sh
# 1. engine-proof.sh with GRAPHPERSIST_ALLOC_TRACE=$OUT/alloctrace and RUNS=save,load (LIMIT, default 420 s: the first
#    SAVE of a fresh host compiles cold) into $PROOF_OUT (engine-proof.sh's default, so later calls can add runs);
# 2. each run's result and the LOAD's restore lines;
# 3. `graphpersist allocdiff` of rank 0's two traces into $OUT/allocdiff.txt;
# 4. tests/gpu/test_alloctrace_gpu.py if more than 90 s of the 590 s a device call allows are left (else NOT RUN).
set -uo pipefail
[[ ${1:-} == -h || ${1:-} == --help ]] && { sed -n '2,9p' "$0" | cut -c3-; exit 0; }
RECIPE=${RECIPE:?set RECIPE (a folder under recipes/)}
OUT=${OUT:?set OUT (the device tool sets it)}
NAME=${RECIPE%/}
PROOF_OUT=${PROOF_OUT:-/root/proof-${NAME##*/}}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/../.."
began=$SECONDS
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
echo "traced-pair: $RECIPE save,load with GRAPHPERSIST_ALLOC_TRACE=$OUT/alloctrace -> $PROOF_OUT"
GRAPHPERSIST_ALLOC_TRACE=$OUT/alloctrace RECIPE=$RECIPE PROOF_OUT=$PROOF_OUT RUNS=save,load LIMIT=${LIMIT:-420} \
  OUT=$OUT bash recipes/gpu-host/engine-proof.sh >"$OUT/proof.txt" 2>&1
echo "traced-pair: proof exit $? after $((SECONDS - began)) s (log: proof.txt)"
for run in save load; do
  echo "== $run: $(head -c 1500 "$PROOF_OUT/$run/result.json" 2>/dev/null || echo 'no result')"
done
grep -h "compiled model\|open + validate\|setup tensor" "$PROOF_OUT/load/log.txt" 2>/dev/null | head -8 | cut -c1-400
ls -la "$OUT/alloctrace" 2>&1 | head -5
PYTHONPATH=overlays/graphpersist timeout 60 python3 -m graphpersist allocdiff "$OUT/alloctrace/save-rank0.json.gz" \
  "$OUT/alloctrace/load-rank0.json.gz" >"$OUT/allocdiff.txt" 2>&1
echo "traced-pair: allocdiff exit $? (1: the starts part, 0: they do not, 2: a file is no trace)"
head -80 "$OUT/allocdiff.txt"
left=$((590 - (SECONDS - began)))
if ((left > 90)); then
  timeout $((left - 10)) python3 -m pytest -m gpu tests/gpu/test_alloctrace_gpu.py -p no:cacheprovider -rA -s \
    >"$OUT/alloctrace-test.txt" 2>&1
  echo "traced-pair: tests/gpu/test_alloctrace_gpu.py exit $?"
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/alloctrace-test.txt" | tail -8
else
  echo "traced-pair: tests/gpu/test_alloctrace_gpu.py NOT RUN (${left} s left in this call)"
fi
