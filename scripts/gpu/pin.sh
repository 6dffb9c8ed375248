#!/usr/bin/env bash
# Host and disk tier figures on a GPU machine. From the repo root: bash scripts/gpu/pin.sh
# Prints: bench pin (8 GiB and 32 GiB, kvdist vs torch.empty(pin_memory=True)), bench disk
# on the machine's local disk, and the GPU-dependent host/disk/integrity tests.
set -u
if [ -d .whl ]; then source scripts/gpu/env.sh || exit 1; fi  # this workplace's carried wheels
export PYTHONUNBUFFERED=1
echo "== node: $(nproc) cores, $(grep MemAvailable /proc/meminfo | tr -s ' '), memlock $(ulimit -l)," \
     "THP $(cat /sys/kernel/mm/transparent_hugepage/enabled)"
echo "== bench pin"
python3 -m kvdist bench pin --sizes 8GiB,32GiB --repeat 2
echo "== bench disk"
python3 -m kvdist bench disk --dir "${KVDIST_DISK_DIR:-/tmp}" --size 2GiB --rounds 3
echo "== GPU tests"
python3 -m pytest -q -p no:cacheprovider tests/test_host_tier.py tests/test_disk_tier.py \
    tests/test_integrity.py -k "cuda or host or disk or tier"
