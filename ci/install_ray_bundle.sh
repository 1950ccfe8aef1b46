#!/usr/bin/env bash
# On a lent GPU machine: install the stripped Ray that ci/build_ray_bundle.sh made (carry .whl).
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 -m pip install --quiet --no-index --find-links .whl/ray/deps click filelock jsonschema msgpack packaging protobuf pyyaml requests
tar -C "$site" -xJf .whl/ray/ray-*-cp312-stripped.tar.xz
python3 -c 'import ray; print("ray", ray.__version__)'
