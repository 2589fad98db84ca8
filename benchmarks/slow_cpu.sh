#!/usr/bin/env bash
# Runs a command as if on a 2.8x slower CPU: beside it, each core runs two busy loops pinned to it,
# at nice 0 and nice 1, so that a thread of the command gets 1024 / (1024 + 1024 + 820) = 36 % of
# its core, one thread on each core as much as one alone (2.76x was the factor between this machine
# kind's family 23 model 1 and a Zen 5 on the same suite: benchmarks/history.md). Waits on clocks
# are not slowed, as on a slower CPU. Unless AVX2=0, torch's, oneDNN's, MKL's and fbgemm's
# kernels are capped at AVX2 (with an inductor cache of its own: docs/benchmarking.md).
#
#   bash benchmarks/slow_cpu.sh bash .ci/run
#
# Caveats: a process the command starts in a session of its own (start_new_session) is scheduled
# in its own autogroup where the kernel has autogroups, and so gets up to half a core instead; the
# busy loops share the caches only lightly. Needs `taskset` (util-linux) and `nproc` cores to load.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: [AVX2=0] bash $0 COMMAND [ARGS...]" >&2; exit 2; }
loops=()
trap 'kill "${loops[@]}" 2>/dev/null || true' EXIT
for ((core = 0; core < $(nproc); core++)); do
    for niceness in 0 1; do
        nice -n "$niceness" taskset -c "$core" python3 -c "while True: pass" &
        loops+=($!)
    done
done
if [ "${AVX2:-1}" = 1 ]; then
    export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2
    export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}
fi
echo "$0: ${#loops[@]} busy loops on $(nproc) cores, AVX2 caps ${AVX2:-1}" >&2
"$@"
