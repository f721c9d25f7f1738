#!/bin/bash
# fla's autotuning results, kept in the repo so that every lease, on any machine, starts tuned (issue 60).
# fla has Triton save each tuning pass's winner as TRITON_CACHE_DIR/<key>/<kernel>.autotune.json (``cache_results``);
# a machine that finds the file compiles the chosen config alone instead of timing every config.
#
#   pack CACHE FILE    the results in CACHE/triton (a lease's TRITON_CACHE_DIR) into FILE, a gzipped tar of
#                      ./triton/<key>/<kernel>.autotune.json
#   unpack FILE CACHE  FILE's results into CACHE/triton (nothing when FILE does not exist yet)
#   merge FILE NEW     NEW's results (a lease's pack) added to FILE's; FILE unchanged when NEW is not a gzipped tar
set -u

count() { tar -tzf "$1" | grep -c 'autotune\.json$'; }

case "${1:-}" in
pack)
    (cd "$2" && find ./triton -name '*.autotune.json' 2>/dev/null | sort | tar -czf - -T -) > "$3" ;;
unpack)
    mkdir -p "$3"
    [ ! -f "$2" ] || { tar -xzf "$2" -C "$3" && echo "autotuning results from past leases: $(count "$2")"; } ;;
merge)
    merged=$(mktemp -d)
    [ ! -f "$2" ] || tar -xzf "$2" -C "$merged"
    if ! tar -xzf "$3" -C "$merged" 2>/dev/null; then
        rm -rf "$merged"; echo "$3 is not a gzipped tar: $2 unchanged"; exit 1
    fi
    bash "$0" pack "$merged" "$2.new" && mv "$2.new" "$2" && rm -rf "$merged"
    echo "$2: $(count "$2") autotuning results" ;;
*)
    echo "usage: $0 pack CACHE FILE | unpack FILE CACHE | merge FILE NEW"; exit 2 ;;
esac
