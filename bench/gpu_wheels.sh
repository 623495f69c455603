#!/usr/bin/env bash
# The wheels bench/gpu_quick.sh installs on the lent GPU machine, which reaches no registry: what the
# training job imports beyond that machine's image (torch 2.11, transformers 5.17, accelerate 1.15, peft,
# safetensors, numpy, pillow, pyarrow: the device tool's KINDS.md), at the accelerate image's pins
# (training_image/requirements-accelerate.txt), for its Python 3.12 on x86-64. About 20 MB: a call
# carries 64 MiB. Run here, from the repository root; `.whl/` is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
pip() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl "$@"; }
pip diffusers==0.42.1 webdataset==0.2.111 braceexpand==0.1.7 \
  boto3==1.44.5 "botocore==$(grep -m1 '^botocore==' training_image/constraints-accelerate.txt | cut -d= -f3)" \
  "s3transfer==$(grep -m1 '^s3transfer==' training_image/constraints-accelerate.txt | cut -d= -f3)" \
  "jmespath==$(grep -m1 '^jmespath==' training_image/constraints-accelerate.txt | cut -d= -f3)" \
  "importlib_metadata==$(grep -m1 '^importlib_metadata==' training_image/constraints-accelerate.txt | cut -d= -f3)"
du -sh .whl && ls .whl
