#!/usr/bin/env bash
# iSCSI reads only: tgt and one or more ibid binaries (A/B), alternating, in one run, on
# 127.0.0.1. The read half of bench/iscsi/run.sh, quick enough to repeat while changing the
# read path (issue 33). See docs/benchmarks/iscsi-tgt.md.
#
# usage: bench/iscsi/reads.sh [--size SIZE] [--time N] [--rounds N] [--warm N] [--out DIR] IBID...
#
#   IBID        ibid binaries to compare (e.g. a build of main and one of a branch); each round
#               runs tgt, then every binary, so each is measured beside tgt under the same load
#   --size S    LUN size, filled with random data (default 2G)
#   --time N    seconds per iscsi-perf run (default 10)
#   --rounds N  rounds (default 2)
#   --warm N    whole-LUN reads (qemu-img convert out, unmeasured) before the measured ones
#               on each freshly started target (default 0). A long-running server has read
#               its hot data before: tgt's page cache is warm after one pass, ibid's read
#               cache admits a block on its second miss, so `--warm 2` compares the two
#               warm (with a LUN smaller than ibid's read cache, a sixteenth of the RAM)
#
# Per system and round, on a freshly started target: qemu-img convert of the whole LUN out to
# qemu's null driver (reads only, nothing written; it also warms the caches), then iscsi-perf
# random 4 KiB reads QD32 (-r -m 32 -b 8) and sequential 1 MiB reads QD8 (-m 8 -b 2048). Prints one tab-separated line per measurement, with the
# load average before it.
set -euo pipefail

SIZE=2G T=10 ROUNDS=2 WARM=0 OUT=""
BINS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --size) SIZE=$2; shift ;;
        --time) T=$2; shift ;;
        --rounds) ROUNDS=$2; shift ;;
        --warm) WARM=$2; shift ;;
        --out) OUT=$2; shift ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) BINS+=("$1") ;;
    esac
    shift
done
[ ${#BINS[@]} -gt 0 ] || { echo "give at least one ibid binary" >&2; exit 2; }
SCRATCH=$(mktemp -d /var/tmp/ibid-reads.XXXXXX)
OUT=${OUT:-$SCRATCH/out}
mkdir -p "$OUT"
TGT_PORT=3271 TGT_CTL=27 TGT_IQN=iqn.2026-11.org.ibid.bench:tgt
IBID_PORT=3272 IBID_NBD=10872 IBID_IQN=iqn.2026-11.org.ibid:pool
PID=""
stop() {
    [ -n "$PID" ] || return 0
    if [ "$1" = tgt ]; then
        tgtadm -C "$TGT_CTL" --lld iscsi --op delete --mode target --tid 1 --force >/dev/null 2>&1 || true
        tgtadm -C "$TGT_CTL" --op delete --mode system >/dev/null 2>&1 || true
        for _ in $(seq 50); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$PID" 2>/dev/null || true
    else
        kill -TERM "$PID" 2>/dev/null || true
        for _ in $(seq 300); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
    fi
    wait "$PID" 2>/dev/null || true
    PID=""
}
CURRENT=tgt
trap 'stop "$CURRENT"; rm -rf "$SCRATCH"' EXIT

SIZE_B=$(numfmt --from=iec "$SIZE")
head -c "$SIZE_B" /dev/urandom >"$SCRATCH/data.img"
# One pool per binary, filled once through iSCSI.
for i in "${!BINS[@]}"; do
    "${BINS[$i]}" serve --data "$SCRATCH/pool$i" --iscsi "127.0.0.1:$IBID_PORT" \
        --nbd "127.0.0.1:$IBID_NBD" --http off --no-default-volume --volume "data=$SIZE" \
        >"$OUT/ibid$i.log" 2>&1 &
    PID=$!; CURRENT=ibid
    for _ in $(seq 100); do grep -q 'Ctrl-C stops' "$OUT/ibid$i.log" && break; sleep 0.1; done
    qemu-img convert -n -f raw -O raw "$SCRATCH/data.img" "iscsi://127.0.0.1:$IBID_PORT/$IBID_IQN/0"
    stop ibid
done

measure() { # measure SYSTEM URL
    local load r m
    for _ in $(seq "$WARM"); do
        qemu-img convert -n -f raw "$2" --target-image-opts "driver=null-co,size=$SIZE_B"
    done
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    local t0 t1
    t0=$(date +%s.%N)
    qemu-img convert -n -f raw "$2" --target-image-opts "driver=null-co,size=$SIZE_B"
    t1=$(date +%s.%N)
    r=$(iscsi-perf -r -m 32 -b 8 -t "$T" -i iqn.2026-11.org.ibid:reads "$2" 2>&1 | tr '\r' '\n' \
        | grep 'iops average' | tail -1 | sed -E 's/.*iops average ([0-9]+) .*/\1/')
    m=$(iscsi-perf -m 8 -b 2048 -t "$T" -i iqn.2026-11.org.ibid:reads "$2" 2>&1 | tr '\r' '\n' \
        | grep 'iops average' | tail -1 | sed -E 's/.*\(([0-9]+) MB\/s\).*/\1/')
    printf '%s\t%s\trand4k_qd32_iops=%s\tseq1m_qd8_MBps=%s\tconvert_out_MBps=%.0f\tload=%s\n' \
        "$ROUND" "$1" "$r" "$m" "$(echo "$SIZE_B / ($t1 - $t0) / 1000000" | bc -l)" "$load" | tee -a "$OUT/results.tsv"
}

for ROUND in $(seq "$ROUNDS"); do
    tgtd -f -C "$TGT_CTL" --iscsi "portal=127.0.0.1:$TGT_PORT" >"$OUT/tgtd.log" 2>&1 &
    PID=$!; CURRENT=tgt
    for _ in $(seq 50); do tgtadm -C "$TGT_CTL" --op show --mode target >/dev/null 2>&1 && break; sleep 0.1; done
    tgtadm -C "$TGT_CTL" --lld iscsi --op new --mode target --tid 1 -T "$TGT_IQN"
    tgtadm -C "$TGT_CTL" --lld iscsi --op new --mode logicalunit --tid 1 --lun 1 \
        -b "$SCRATCH/data.img" --bstype rdwr
    tgtadm -C "$TGT_CTL" --lld iscsi --op bind --mode target --tid 1 -I ALL
    measure tgt "iscsi://127.0.0.1:$TGT_PORT/$TGT_IQN/1"
    stop tgt
    for i in "${!BINS[@]}"; do
        "${BINS[$i]}" serve --data "$SCRATCH/pool$i" --iscsi "127.0.0.1:$IBID_PORT" \
            --nbd "127.0.0.1:$IBID_NBD" --http off --no-default-volume >"$OUT/ibid$i-r$ROUND.log" 2>&1 &
        PID=$!; CURRENT=ibid
        for _ in $(seq 100); do grep -q 'Ctrl-C stops' "$OUT/ibid$i-r$ROUND.log" && break; sleep 0.1; done
        measure "ibid$i" "iscsi://127.0.0.1:$IBID_PORT/$IBID_IQN/0"
        stop ibid
    done
done
