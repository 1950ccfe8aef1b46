#!/usr/bin/env bash
# Build the Ray that travels to a lent GPU machine (Python 3.12 image, no Ray): the ray wheel for
# cp312 unpacked with what the harness never runs removed (the Java jars, the dashboard's web UI,
# RLlib, Tune, Train, Serve, Data, LLM), xz-compressed, plus the wheels of Ray's requirements the
# image may lack. A device call carries 64 MiB in all; the ray wheel alone is ~76 MiB.
# Usage: bash ci/build_ray_bundle.sh [VERSION]   -> .whl/ray/ray-VERSION-cp312-stripped.tar.xz + deps
# On the GPU machine: bash ci/install_ray_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-2.60.0}
out=.whl/ray
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out"
pip=(python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
     --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --implementation cp)
"${pip[@]}" --no-deps -d "$tmp/wheel" "ray==$version"
# Ray's requirements (click, filelock, jsonschema, msgpack, packaging, protobuf, pyyaml, requests) and theirs
"${pip[@]}" -d "$out/deps" click filelock jsonschema msgpack "packaging>=24.2" protobuf pyyaml requests
# Unpack keeping each file's mode (zipfile -e drops it: gcs_server and raylet must stay executable).
python3 - "$tmp"/wheel/ray-*.whl "$tmp/site" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for info in wheel.infolist():
        path = wheel.extract(info, sys.argv[2])
        mode = info.external_attr >> 16
        if mode:
            os.chmod(path, mode)
PY
cd "$tmp/site/ray"
rm -rf jars dashboard/client/build rllib tune train serve data llm air/examples
cd - >/dev/null
tar -C "$tmp/site" -cJf "$out/ray-$version-cp312-stripped.tar.xz" .
du -sh "$out"/* "$out"/deps | sort -h
