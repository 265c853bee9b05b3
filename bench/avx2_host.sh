#!/usr/bin/env bash
# Runs a command as a CPU without AVX512 computes (bench/simulated_host/sitecustomize.py says how and what it cannot
# change): `bench/avx2_host.sh make demo`, `bench/avx2_host.sh .venv/bin/eaglenest doctor`.
here=$(cd "$(dirname "$0")" && pwd)
export EAGLENEST_SIMULATED_HOST=avx2
export PYTHONPATH="$here/simulated_host${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
