#!/bin/bash
# One GPU lease in one device call (issue 42): install the wheels the GPU image lacks, unpack the autotuning
# results past leases brought back (bench/gpu-autotune.tgz, committed), run bench/gpu_proof.py's stages within
# the call's time, and send back the logs and the autotuning results so far. A cold machine spends minutes
# timing each of fla's kernels' configs (Triton's autotuning, which fla saves as *.autotune.json); with those
# results in the repo, every lease compiles each kernel's chosen config alone (bench/autotune_results.sh).
#
#   here, once:        ../shared/tools/gpu-wheels.sh                  (writes .whl)
#   the device call:   bash bench/gpu_lease.sh [STAGE ...]             carry [".whl"], timeout_s 600
#   a second call:     bash bench/gpu_lease.sh tests                   the CUDA tests (never beside the bench)
#   back here:         bash bench/gpu_lease.sh --keep /work/.device/N  (the call's files_at: its results join
#                      bench/gpu-autotune.tgz; commit it)
#
# STAGE as bench/gpu_proof.py takes them. The default, bench:a,c,d, measures: rows (a), (c) and (d) of
# bench/bench_train.py side by side (tokens/s, peak allocated memory, time to first step, data-loading share, each
# a ratio to (a)) and (c)'s top kernels from torch.profiler; its log ends with the table to paste into
# bench/RESULTS.md. LEASE_SECONDS (default 470) bounds the stages; the
# install and packing take about 30 s more. $OUT gets summary.jsonl, logs.tgz, env.txt and autotune.tgz, all
# small: the compiled kernels and Inductor's cache stay behind (lease 3's were over 90 MB, past what a call
# returns and a carry holds, and packing them ran past its call's time).
set -u
CACHE=/tmp/gpu-cache
KEPT=bench/gpu-autotune.tgz
RESULTS="bash $(dirname "$0")/autotune_results.sh"

if [ "${1:-}" = "--keep" ]; then
    [ -f "${2:-}/summary.jsonl" ] || { echo "--keep DIR: DIR is a device call's files_at (with summary.jsonl)"; exit 2; }
    [ -f "$2/autotune.tgz" ] || { echo "--keep $2: no autotune.tgz there (the lease packed none): $KEPT unchanged"; exit 1; }
    $RESULTS merge $KEPT "$2/autotune.tgz" || exit 1
    exit 0
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$CACHE/triton TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor
mkdir -p $CACHE /tmp/proof
$RESULTS unpack $KEPT $CACHE
{ date -u; nvidia-smi -L; python3 -c "import sys, torch, triton, transformers, fla, torchao; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, 'torchao', torchao.__version__)" 2>&1 | tail -1; } | tee /tmp/proof/env.txt

[ $# -gt 0 ] || set -- bench:a,c,d
python3 bench/gpu_proof.py --out /tmp/proof --deadline "${LEASE_SECONDS:-470}" "$@"
code=$?

cp /tmp/proof/summary.jsonl /tmp/proof/env.txt "$OUT"/
tar -czf "$OUT"/logs.tgz --exclude='*trace.json' -C /tmp proof
$RESULTS pack $CACHE "$OUT"/autotune.tgz
ls -l "$OUT"
exit $code
