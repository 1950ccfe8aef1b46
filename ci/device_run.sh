#!/usr/bin/env bash
# Run a suite on a lent GPU machine (bare image: Python 3.12 + torch, no megatron-core/mbridge).
# Usage: bash ci/device_run.sh NAME [pytest args...]   (wheels in .whl/, results under $OUT)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
name=$1; shift
out=${OUT:-reports/gpu}
# Install once per machine (several runs may share it, possibly concurrently on disjoint GPUs).
if ! python3 -c "import megatron.core, mbridge, harness" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>/dev/null || exit 1
fi
start=$(date -u +%FT%TZ); t0=$(date +%s)
# RUN_TIMEOUT: stop with SIGINT, so pytest still writes its JUnit file and summary.
timeout -s INT "${RUN_TIMEOUT:-3600}" python3 -m pytest "$@" -ra -p no:cacheprovider \
  --junitxml="$out/$name.junit.xml" 2>&1 | tee "$out/$name.log"
rc=${PIPESTATUS[0]}
python3 ci/gpu_report.py --name "$name" --junit "$out/$name.junit.xml" --log "$out/$name.log" \
  ${ROWS_DIR:+--rows-dir "$ROWS_DIR"} --started "$start" --wall-s $(( $(date +%s) - t0 )) --out "$out" \
  --command "pytest $*" || rc=1
rm -f "$out/$name.junit.xml"  # summarized in $name.json; keeps the files that come back few
exit $rc
