#!/usr/bin/env bash
# Print the commit of this checkout as environment assignments, for a machine that gets the working
# tree without .git (the lent GPU machines): prefix the remote command with this output, e.g.
#   $(bash ci/git_env.sh) bash ci/device_run.sh NAME suites -m gpu     (composed here, run there)
# MRH_GIT_DIRTY=1 when tracked files differ from HEAD (the tree that travels is not that commit).
set -euo pipefail
cd "$(dirname "$0")/.."
commit=$(git rev-parse HEAD)
if [ -n "$(git --no-optional-locks status --porcelain --untracked-files=no)" ]; then dirty=1; else dirty=0; fi
echo "MRH_GIT_COMMIT=$commit MRH_GIT_DIRTY=$dirty"
