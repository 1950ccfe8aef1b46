#!/usr/bin/env bash
# Several runs at once on one lent machine, from a job file: one device tool call does many suites.
# Usage (on the device, from the repository root): MRH_GIT_COMMIT=SHA bash ci/gpu_batch.sh JOBFILE
# Each job line: NAME GPUS SECONDS ARGS...
#   NAME not starting with "bench-": `ci/device_run.sh NAME ARGS...` (pytest; ARGS as on a shell line)
#   NAME "bench-...": ARGS is a command whose stdout (one JSON line) goes to $OUT/NAME.json
#   GPUS: CUDA_VISIBLE_DEVICES of the job. Jobs may share GPUs: the harness's tiny models use a
#   fraction of one, so a 4-rank world and two 2-rank worlds can run side by side; timings (the
#   benches) then run in a "serial" group first, alone on the machine.
# Lines "serial" / "parallel" switch how the following jobs run (default parallel); "#" comments.
# Setup (wheels, TE from .te/, vLLM from .vllm/) runs once first. Each job's files are packed into
# $OUT/NAME.tgz as soon as it ends, and everything into $OUT/batch.tgz at the end (the device tool returns
# few files per call): a call killed before the end still brings back the jobs that had finished.
# BATCH_LIMIT (default 570 s, from the start): no job runs past it. Each job's SECONDS is cut to what is
# left less BATCH_MARGIN (default 90 s: pytest gets SIGINT at its limit and SIGKILL 45 s later, then its
# report is written and packed), and a job with under 30 s left is skipped. 2026-11-27: a pytest run took
# 109 s to end after its SIGINT, the call outlived the device tool's limit and came back without its reports.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
jobs_file=${1:?usage: ci/gpu_batch.sh JOBFILE}
out=${OUT:?set OUT (the device tool sets it)}
t0=$(date +%s)
MRH_SETUP_ONLY=1 bash ci/device_run.sh setup > "$out/setup.log" 2>&1 || { tail -40 "$out/setup.log"; exit 1; }
[ -f /tmp/site/te_env.sh ] && . /tmp/site/te_env.sh
echo "gpu_batch: setup done in $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpus.txt" 2>&1
mode=parallel; pids=()
budget=${BATCH_LIMIT:-570} margin=${BATCH_MARGIN:-90}
export RUN_KILL_AFTER=45  # device_run.sh: SIGKILL this long after the SIGINT
pack_job() {  # NAME: its files (NAME.*, rows-NAME/) into NAME.tgz
  local name=$1 files
  files=$(cd "$out" && ls -d "$name".* "rows-$name" 2>/dev/null | grep -v "^$name.tgz$")
  [ -z "$files" ] && return
  (cd "$out" && tar czf "/tmp/$name.tgz" $files && rm -rf $files && mv "/tmp/$name.tgz" "$name.tgz")
}
run_job() {  # NAME GPUS SECONDS ARGS...
  local name=$1 gpus=$2 limit=$3; shift 3
  local t=$(date +%s)
  local left=$(( budget - (t - t0) - margin ))
  if [ "$left" -lt 30 ]; then echo "gpu_batch: $name skipped: ${left} s left of BATCH_LIMIT=$budget"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  if [[ $name == bench-* ]]; then
    CUDA_VISIBLE_DEVICES=$gpus timeout -k "$RUN_KILL_AFTER" -s INT "$limit" bash -c "$*" > "$out/$name.json" 2> "$out/$name.log"
  else
    CUDA_VISIBLE_DEVICES=$gpus RUN_TIMEOUT=$limit ROWS_DIR=$out/rows-$name \
      bash -c "bash ci/device_run.sh $name $* --mrh-report-dir $out/rows-$name" > "$out/$name.stdout" 2>&1
  fi
  local rc=$?
  echo "gpu_batch: $name rc=$rc $(( $(date +%s) - t )) s $(grep -h '^- outcome' "$out/$name.md" 2>/dev/null)"
  pack_job "$name"
}
while IFS= read -r line || [ -n "$line" ]; do
  [[ -z "${line// }" || $line == \#* ]] && continue
  case $line in
    serial|parallel) [ "$mode" = parallel ] && { wait; pids=(); }; mode=$line; continue ;;
  esac
  read -r name gpus limit rest <<< "$line"
  if [ "$mode" = serial ]; then run_job "$name" "$gpus" "$limit" "$rest"; else run_job "$name" "$gpus" "$limit" "$rest" & fi
done < "$jobs_file"
wait
echo "gpu_batch: all jobs done in $(( $(date +%s) - t0 )) s"
tar czf /tmp/batch.tgz -C "$out" . && rm -rf "${out:?}"/* && mv /tmp/batch.tgz "$out/batch.tgz"
