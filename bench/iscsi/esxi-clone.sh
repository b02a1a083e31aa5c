#!/usr/bin/env bash
# What ESXi does to a datastore LUN, at a size the suite's test does not reach: each IBID
# binary in turn (A/B, alternating over rounds) serves a 16 GiB `datastore` and a 4 GiB
# `other` volume over iSCSI on 127.0.0.1, and `esxi_datastore.c` (libiscsi) eager-zeroes
# 2 × DATA_MIB + 64 MiB with WRITE SAME, writes DATA_MIB of distinct data, then clones it with
# EXTENDED COPY in 4 MiB segments, 8 in flight, within the LUN and to the other one, while 4
# initiators beat with COMPARE AND WRITE. Prints the program's figures per binary and round
# (xcopy_s: the two clones; worst_*_ms: the slowest command of each kind; it fails any run
# with a command over 1 s or wrong data).
#
# --in-flight N: N commands in flight instead of 8 (every phase; 1 is the QD1 baseline);
# --settle-ms MS: a pause between writing the data and cloning it, so that the copies meet
# committed data (a disk written long before), not the commit of the data just written.
#
# usage: bench/iscsi/esxi-clone.sh [--data-mib N] [--rounds N] [--in-flight N] [--settle-ms MS] IBID...
set -euo pipefail
DATA=1024 ROUNDS=2 IN_FLIGHT=8 SETTLE_MS=0
while [ $# -gt 0 ]; do
    case $1 in
    --data-mib) DATA=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --in-flight) IN_FLIGHT=$2; shift 2 ;;
    --settle-ms) SETTLE_MS=$2; shift 2 ;;
    *) break ;;
    esac
done
[ $# -ge 1 ] || { sed -n '2,16p' "$0"; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
scratch=$(mktemp -d /var/tmp/esxi-clone.XXXXXX)
trap 'kill $pid 2>/dev/null || true; rm -rf "$scratch"' EXIT
cc -O1 -DIN_FLIGHT="$IN_FLIGHT" -o "$scratch/esxi" "$here/../../crates/ibid-iscsi/tests/c/esxi_datastore.c" -liscsi -lpthread
port=3297
for round in $(seq "$ROUNDS"); do
    for bin in "$@"; do
        rm -rf "$scratch/pool"
        "$bin" serve --data "$scratch/pool" --no-default-volume --volume datastore=16G \
            --volume other=4G --nbd 127.0.0.1:10897 --iscsi 127.0.0.1:$port --http off \
            > "$scratch/log" 2>&1 &
        pid=$!
        for _ in $(seq 100); do iscsi-ls iscsi://127.0.0.1:$port > /dev/null 2>&1 && break; sleep 0.1; done
        out=$(ESXI_SETTLE_MS=$SETTLE_MS "$scratch/esxi" 127.0.0.1:$port iqn.2026-11.org.ibid:pool 0 1 $((2 * DATA + 64)) "$DATA" 4 2>&1 \
            | tr '\n' ' ') || true
        echo "round $round $bin: $out"
        kill $pid; wait $pid 2>/dev/null || true
    done
done
