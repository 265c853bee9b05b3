#!/usr/bin/env bash
# Runs a command as a CPU with AVX512-BF16 but no AMX computes (bench/simulated_host/sitecustomize.py says how and
# what it cannot change): `bench/avx512_host.sh .venv/bin/python bench/long_alone.py`.
here=$(cd "$(dirname "$0")" && pwd)
export EAGLENEST_SIMULATED_HOST=avx512-bf16
export PYTHONPATH="$here/simulated_host${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
