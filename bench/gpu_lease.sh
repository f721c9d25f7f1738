#!/bin/bash
# One GPU lease in one device call (issue 42): install the wheels the GPU image lacks, unpack the caches a
# past lease brought back, run bench/gpu_proof.py's stages within the call's time, and send back the logs and
# this lease's caches. A cold machine spends minutes autotuning fla's kernels (Triton) and compiling
# (Inductor) before the first step; with the caches carried, the next lease starts where this one stopped.
#
#   here, once:        ../shared/tools/gpu-wheels.sh                  (writes .whl; .gpu-cache starts empty)
#   the device call:   bash bench/gpu_lease.sh [STAGE ...]             carry [".whl", ".gpu-cache"], timeout_s 600
#   back here:         bash bench/gpu_lease.sh --keep /work/.device/N  (the call's files_at: its caches into .gpu-cache)
#
# STAGE as bench/gpu_proof.py takes them (default below). LEASE_SECONDS (default 480) bounds the stages; the
# install, unpacking and packing take about 60 s more. $OUT gets summary.jsonl, logs.tgz, env.txt and the
# caches as parts of at most 15 MiB (the device returns 8 files of 16 MiB at most; carry holds 64 MiB in all).
set -u
CACHE=/tmp/gpu-cache  # the same path on every lease: Inductor's cached code names its files by path

if [ "${1:-}" = "--keep" ]; then
    [ -f "${2:-}/summary.jsonl" ] || { echo "--keep DIR: DIR is a device call's files_at (with summary.jsonl)"; exit 2; }
    ls "$2"/gpu-cache.tgz.* >/dev/null 2>&1 || { echo "--keep $2: no gpu-cache.tgz.* there (the lease packed none): .gpu-cache unchanged"; exit 1; }
    mkdir -p .gpu-cache && rm -f .gpu-cache/gpu-cache.tgz.* && cp "$2"/gpu-cache.tgz.* .gpu-cache/ && ls -l .gpu-cache
    exit 0
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$CACHE/triton TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor
mkdir -p $CACHE /tmp/proof
if ls .gpu-cache/gpu-cache.tgz.* >/dev/null 2>&1; then
    cat .gpu-cache/gpu-cache.tgz.* | tar -xzf - -C $CACHE && echo "caches from a past lease: $(du -sh $CACHE | cut -f1)"
fi
{ date -u; nvidia-smi -L; python3 -c "import sys, torch, triton, transformers, fla, torchao; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, 'torchao', torchao.__version__)" 2>&1 | tail -1; } | tee /tmp/proof/env.txt

[ $# -gt 0 ] || set -- bench:c,g,b,a@330 train:gla_340M@120 tests
python3 bench/gpu_proof.py --out /tmp/proof --deadline "${LEASE_SECONDS:-480}" "$@"
code=$?

cp /tmp/proof/summary.jsonl /tmp/proof/env.txt "$OUT"/
tar -czf "$OUT"/logs.tgz --exclude='*trace.json' -C /tmp proof
tar -czf - -C $CACHE . | split -b 15m -a 1 - "$OUT"/gpu-cache.tgz.
if [ "$(ls "$OUT"/gpu-cache.tgz.* | wc -l)" -gt 3 ]; then  # over what .whl leaves of carry's 64 MiB: keep the autotuning alone
    rm "$OUT"/gpu-cache.tgz.*
    (cd $CACHE && find . -name '*.autotune.json' | tar -czf "$OUT"/gpu-cache.tgz.a -T -)
fi
ls -l "$OUT"
exit $code
