#!/usr/bin/env bash
# Run a suite on a lent GPU machine (bare image: Python 3.12 + torch, no megatron-core/mbridge/TE).
# Usage: MRH_GIT_COMMIT=SHA [MRH_GIT_DIRTY=0|1] bash ci/device_run.sh NAME [pytest args...]
#   (wheels in .whl/, or .whl-b/ with MRH_BRIDGE=megatron-bridge; results under $OUT). The tree arrives without .git, so the commit the reports
#   record comes from MRH_GIT_COMMIT: compose the command where git is, `$(bash ci/git_env.sh) bash ...`.
#   Transformer Engine: carry a copy of ../shared/te as .te/ (never committed; `mkdir -p .te && cp -r
#   ../shared/te/. .te/`): it is built once per machine (2-3 min) and every run sees it, so the CUDA
#   variants run on both layer specs (--mrh-spec auto); without .te/ they run on the local spec only.
#   vLLM: carry a copy of ../shared/vllm as .vllm/ (`mkdir -p .vllm && cp -r ../shared/vllm/. .vllm/`): it is
#   installed once per machine into /tmp/vllm_site (about 1 min) and the vLLM engine's process runs there
#   (MRH_VLLM_PYTHON, MRH_VLLM_PATH). .te/ and .vllm/ together exceed what one call carries (64 MiB):
#   carry one per call while the machine is warm; what one call installed stays for the next.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
name=$1; shift
out=${OUT:-reports/gpu}
# Bad commit variables stop the run before any work; a missing one only warns (the run still counts).
if [ -n "${MRH_GIT_COMMIT:-}" ] && ! [[ $MRH_GIT_COMMIT =~ ^[0-9a-f]{7,40}$ ]]; then
  echo "device_run.sh: MRH_GIT_COMMIT='$MRH_GIT_COMMIT' is not a git sha (7-40 hex digits)" >&2; exit 2
fi
if ! [[ ${MRH_GIT_DIRTY:-0} =~ ^[01]$ ]]; then
  echo "device_run.sh: MRH_GIT_DIRTY='$MRH_GIT_DIRTY' must be 0 or 1" >&2; exit 2
fi
if ! git rev-parse HEAD >/dev/null 2>&1 && [ -z "${MRH_GIT_COMMIT:-}" ]; then
  echo "device_run.sh: WARNING: no .git here and MRH_GIT_COMMIT is unset: the reports will record" \
       "git_commit \"unknown\". Prefix the command with the output of 'bash ci/git_env.sh'." >&2
fi
# Install once per machine (several runs may share it, possibly concurrently on disjoint GPUs).
# Stack B (MRH_BRIDGE=megatron-bridge): megatron-core 0.19.2 + Megatron-Bridge 0.6.2 + omegaconf, carried
# in .whl-b/ (docs/versions.md); stack A: megatron-core 0.16.1 + mbridge 0.15.1 in .whl/. One stack per machine.
if [ "${MRH_BRIDGE:-mbridge}" = megatron-bridge ]; then wheels=.whl-b; bridge=megatron.bridge; else wheels=.whl; bridge=mbridge; fi
if ! python3 -c "import importlib.util as u, megatron.core, harness; assert u.find_spec('$bridge')" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile "$wheels"/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>/dev/null || exit 1
fi
if [ -d .te ] && ! python3 -c "import transformer_engine" 2>/dev/null; then
  if [ ! -f /tmp/site/te_env.sh ]; then
    echo "device_run.sh: building Transformer Engine from .te/ (log /tmp/te_build.log)" >&2
    SMOKE=0 bash .te/build_on_device.sh .te > /tmp/te_build.log 2>&1 || { tail -40 /tmp/te_build.log; exit 1; }
  fi
  . /tmp/site/te_env.sh
elif [ -f /tmp/site/te_env.sh ]; then
  . /tmp/site/te_env.sh  # built by an earlier call on this machine (one that carried .te/)
fi
# TE's loader takes the first libcudnn it finds: $CUDNN_HOME, then the unversioned libcudnn.so on the
# library path, which on these images is the system's cuDNN 9.14 (/usr/lib/x86_64-linux-gnu) while torch
# has loaded its wheel's 9.19 sub-libraries: every fused (cuDNN) attention then fails with
# CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED and TE falls back to its unfused attention, which has no context
# parallelism (2x H200, 2026-11-27). Point TE at torch's own cuDNN.
if [ -f /tmp/site/te_env.sh ] && [ -z "${CUDNN_HOME:-}" ]; then
  CUDNN_HOME=$(python3 -c "import glob, site; print(next(iter(d for s in site.getsitepackages() for d in glob.glob(s + '/nvidia/cudnn')), ''))")
  [ -n "$CUDNN_HOME" ] && export CUDNN_HOME
fi
if [ -d .vllm ] && [ ! -f /tmp/vllm_site/vllm_env.sh ]; then
  echo "device_run.sh: installing vLLM from .vllm/ (log /tmp/vllm_install.log)" >&2
  bash .vllm/install_on_device.sh .vllm > /tmp/vllm_install.log 2>&1 || { tail -40 /tmp/vllm_install.log; exit 1; }
fi
if [ -f /tmp/vllm_site/vllm_env.sh ]; then
  # Only the engine's process gets the vLLM site (its pinned packages stay out of the harness's imports).
  export MRH_VLLM_PYTHON=$(command -v python3) MRH_VLLM_PATH=/tmp/vllm_site
  export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0
fi
# MRH_SETUP_ONLY=1: install (and build) only, so that concurrent runs (ci/gpu_batch.sh) find it done.
[ -n "${MRH_SETUP_ONLY:-}" ] && exit 0
start=$(date -u +%FT%TZ); t0=$(date +%s)
# RUN_TIMEOUT: stop with SIGINT, so pytest still writes its JUnit file and summary; RUN_KILL_AFTER (default
# 120 s) later, SIGKILL (a world's teardown after the interrupt once took 109 s).
timeout -k "${RUN_KILL_AFTER:-120}" -s INT "${RUN_TIMEOUT:-3600}" python3 -m pytest "$@" -ra -p no:cacheprovider \
  --junitxml="$out/$name.junit.xml" 2>&1 | tee "$out/$name.log"
rc=${PIPESTATUS[0]}
python3 ci/gpu_report.py --name "$name" --junit "$out/$name.junit.xml" --log "$out/$name.log" \
  ${ROWS_DIR:+--rows-dir "$ROWS_DIR"} --started "$start" --wall-s $(( $(date +%s) - t0 )) --out "$out" \
  --command "pytest $*" || rc=1
rm -f "$out/$name.junit.xml"  # summarized in $name.json; keeps the files that come back few
# The device tool returns a bounded number of files per call (8 on 2026-11-23: the rows of two runs
# were lost that way). The rows live in results.json; the HTML and CSV renderings are rebuilt from
# it (`mrh report render`), so they do not travel. And the run comes back packed, as it is committed
# (docs/reports.md: JSON and logs over 64 KiB gzip'd, readers take both forms; standard library only).
python3 -m harness.report.packed "$out/$name.json" "$out/$name.log" ${ROWS_DIR:+"$ROWS_DIR"} || rc=1
exit $rc
