#!/bin/bash
# Wheels for running the GPU check on a machine without network (a lent device, an air-gapped node):
# what lightning_3d needs beyond a CUDA torch and Lightning, plus DeepSpeed for the peer cases.
#   benchmarks/gpu_wheels.sh DIR [PYTHON_VERSION]      # e.g. benchmarks/gpu_wheels.sh .whl 3.12
# Then on the GPU machine: WHEELS=DIR benchmarks/gpu_session.sh  (docs/gpu.md, "Without network").
set -euo pipefail
dir=${1:?usage: gpu_wheels.sh DIR [PYTHON_VERSION]}
py=${2:-3.12}
mkdir -p "$dir"
# binary wheels for the target's Python (pydantic-core and msgpack are compiled)
pip download --quiet --no-deps -d "$dir" --python-version "$py" --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  hydra-core==1.3.2 omegaconf==2.3.0 hjson pydantic pydantic-core annotated-types typing-inspection \
  typing-extensions py-cpuinfo msgpack einops ninja
# pure-Python sdists built here: antlr4 (hydra's parser runtime) and DeepSpeed without its ops (JIT-built there)
DS_BUILD_OPS=0 pip wheel --quiet --no-deps -w "$dir" antlr4-python3-runtime==4.9.3 deepspeed==0.19.8
ls "$dir"
