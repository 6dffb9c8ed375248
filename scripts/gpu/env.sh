# This workplace's device machine only (optional elsewhere): the scripts of scripts/gpu
# source it when the repository carries wheels in .whl/ (from the repo root):
#   source scripts/gpu/env.sh
# On any other CUDA machine, install kvdist (make venv, or pip install -e .) instead.
# Installs the carried wheels (.whl/: mpich, mpi4py, pytest-mpi, pydantic...) into
# /tmp/site and points mpi4py at MPICH's libmpi (the image also has Open MPI's, which
# mpi4py would otherwise pick, giving every rank rank 0).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
# pip --target drops the mpich wheel's data/lib (libmpi.so.12): unpack it by hand.
if [ ! -e /tmp/site/lib/libmpi.so.12 ]; then
    python3 -m zipfile -e .whl/mpich-*.whl /tmp/mpich-wheel &&
        mkdir -p /tmp/site/lib /tmp/site/bin &&
        cp -r /tmp/mpich-wheel/mpich-*.data/data/lib/. /tmp/site/lib/ &&
        cp -r /tmp/mpich-wheel/mpich-*.data/data/bin/. /tmp/site/bin/ &&
        chmod +x /tmp/site/bin/* || return 1
fi
export PYTHONPATH=/tmp/site:$PWD
export PATH=/tmp/site/bin:$PATH
export LD_LIBRARY_PATH=/tmp/site/lib:${LD_LIBRARY_PATH:-}
export MPI4PY_LIBMPI=/tmp/site/lib/libmpi.so.12
export MPIEXEC=/tmp/site/bin/mpiexec
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-300}
export PYTHONUNBUFFERED=1
