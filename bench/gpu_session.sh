#!/usr/bin/env bash
# Everything yrcache checks on a lent GPU machine, in one call (about 4 minutes with `quick`,
# up to 10 with the rest of the suite).
#
# That machine has python3 with a CUDA torch, numpy, pytest and most of our
# dependencies, but no registry: cffi, pycparser, posix_ipc and diskcache travel
# as wheels.  Here, once, from the repository root:
#
#   echo /.whl/ >> .git/info/exclude
#   pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl cffi pycparser posix_ipc diskcache
#
# then run `bash bench/gpu_session.sh [quick]` there with `.whl` carried (quick: without
# the last step, the rest of the suite under that machine's python).  It builds the
# C extensions for that python, runs bench/gpu_check.py (arena <-> device copies,
# RL publish/fetch with device tensors) and the tests whose CUDA cases a machine
# without a GPU skips, and leaves its logs in $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_session: the wheels in .whl did not install"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
python3 -c 'import sys, numpy, torch; print(sys.version.split()[0], "numpy", numpy.__version__, "torch", torch.__version__,
    "cuda", torch.version.cuda, torch.cuda.is_available())'
python3 setup.py -q build_ext --inplace >"$out/build.txt" 2>&1 \
    || { tail -30 "$out/build.txt"; exit 1; }
echo "built: $(ls yrcache/*.so | tr '\n' ' ')"

echo "== bench/gpu_check.py"
timeout 240 python3 bench/gpu_check.py --json "$out/gpu_check.json" 2>&1 | grep -v '^JSON: ' | tee "$out/gpu_check.txt"

echo "== tests with CUDA cases"
timeout 300 python3 -m pytest -q -p no:cacheprovider --timeout 120 -rs \
    tests/test_rl_device.py tests/test_pinning.py tests/test_device_tier.py tests/test_store.py tests/test_tiers.py \
    tests/test_tier_conformance.py tests/test_bad_input.py tests/test_tier_tracking.py tests/test_codec.py \
    tests/test_rl_weights.py tests/test_dataloader.py 2>&1 | tee "$out/pytest_cuda.txt" | tail -25
[ "${1:-}" = quick ] && exit 0

echo "== the rest of the suite (this python, numpy and torch; cluster tests skip without pyetcd)"
timeout 360 python3 -m pytest -q -p no:cacheprovider --timeout 60 tests \
    --ignore tests/test_store.py --ignore tests/test_tiers.py \
    --ignore tests/test_tier_conformance.py --ignore tests/test_bad_input.py --ignore tests/test_device_tier.py \
    --ignore tests/test_tier_tracking.py --ignore tests/test_codec.py --ignore tests/test_rl_weights.py \
    --ignore tests/test_dataloader.py --ignore tests/test_rl_device.py --ignore tests/test_pinning.py 2>&1 | tee "$out/pytest_rest.txt" | tail -15
ls /dev/shm
