#!/usr/bin/env bash
# SIGTERM while the server's background work runs (issue 31, goal 4: "shutdown completes within
# 5 s whatever background work is running"). For each case: a fresh `ibid serve`, a volume of
# --size-mib of unique data written over NBD, the work started through the real clients (the
# CLI, nbdsh, fio), SIGTERM after --delay-ms, and the time until the process exits. Then the
# server is started again on the same pool, `ibid pool verify` must pass, and every volume
# must read back as it should (md5 of the NBD export against the data written).
#
# usage: bench/shutdown.sh [--size-mib M] [--delay-ms D] [--cases a,b,...] [--keep] IBID
#
# Cases: writes (fio random writes running), copy-permanent (a `volume copy` across volumes
# being made permanent, 5 s after it), flatten (a snapshot deleted under a volume rewritten
# since), clone-full (a full clone running), zero-settle (the whole volume zeroed, the commits
# settling it), cleaner (the volume rewritten, its garbage being cleaned), scrub (a scrub pass),
# delete (the volume deleted: its layer's entries being deleted; it must stay deleted).
# Prints one row per case and exits 1 if a server failed to stop, to reopen, or to verify, or
# data read back wrong.
set -euo pipefail

SIZE_MIB=4096 DELAY_MS=1500 KEEP=0
CASES=writes,copy-permanent,flatten,clone-full,zero-settle,cleaner,scrub,delete
while [ $# -gt 0 ]; do
    case "$1" in
        --size-mib) SIZE_MIB=$2; shift ;;
        --delay-ms) DELAY_MS=$2; shift ;;
        --cases) CASES=$2; shift ;;
        --keep) KEEP=1 ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) IBID=$1 ;;
    esac
    shift
done
[ -n "${IBID:-}" ] || { echo "give the ibid binary" >&2; exit 2; }
IBID=$(realpath "$IBID")
SCRATCH=$(mktemp -d /var/tmp/ibid-shutdown.XXXXXX)
NBD=10996 HTTP=18996
API=http://127.0.0.1:$HTTP
PID=""
cleanup() {
    [ -z "$PID" ] || kill -KILL "$PID" 2>/dev/null || true
    [ "$KEEP" = 1 ] && echo "kept $SCRATCH" || rm -rf "$SCRATCH"
}
trap cleanup EXIT

STARTS=0
start() {
    STARTS=$((STARTS + 1))
    RUST_LOG=${RUST_LOG:-info} "$IBID" serve --data "$SCRATCH/pool" --nbd 127.0.0.1:$NBD \
        --iscsi off --http 127.0.0.1:$HTTP --no-default-volume >>"$SCRATCH/server.log" 2>&1 &
    PID=$!
    for _ in $(seq 1200); do
        local started
        started=$(grep -c 'Ctrl-C stops' "$SCRATCH/server.log" 2>/dev/null || true)
        [ "${started:-0}" -ge "$STARTS" ] && return
        kill -0 "$PID" 2>/dev/null || break
        sleep 0.05
    done
    echo "the server did not start: $(tail -5 "$SCRATCH/server.log")" >&2; exit 1
}
cli() { "$IBID" --server "$API" "$@"; }
url() { echo "nbd://127.0.0.1:$NBD/$1"; }
md5() { nbdcopy "$(url "$1")" - | md5sum | cut -d' ' -f1; }
now_ms() { date +%s%3N; }

FAILED=0
fail() { echo "FAIL: $*" >&2; FAILED=1; }

# Stops the server with SIGTERM and sets STOP_MS to the milliseconds until it exited (the
# process is killed after 60 s, and the case fails).
term() {
    local t0 t1
    t0=$(now_ms)
    kill -TERM "$PID"
    for _ in $(seq 6000); do
        kill -0 "$PID" 2>/dev/null || break
        sleep 0.01
    done
    if kill -0 "$PID" 2>/dev/null; then
        kill -KILL "$PID"; fail "$CASE: still running 60 s after SIGTERM"
    fi
    local status=0
    wait "$PID" || status=$?
    [ "$status" = 0 ] || fail "$CASE: the server exited with status $status after SIGTERM"
    PID=""
    t1=$(now_ms)
    STOP_MS=$((t1 - t0))
}

SEED=$SCRATCH/seed.img
head -c $((SIZE_MIB << 20)) /dev/urandom >"$SEED"
SEED_MD5=$(md5sum "$SEED" | cut -d' ' -f1)
ZERO_MD5=$(head -c $((SIZE_MIB << 20)) /dev/zero | md5sum | cut -d' ' -f1)

# Sets up a fresh pool holding `vm` with the seed data.
fresh() {
    [ -z "$PID" ] || { kill -KILL "$PID"; wait "$PID" 2>/dev/null || true; PID=""; }
    rm -rf "$SCRATCH/pool" "$SCRATCH/server.log"
    STARTS=0
    start
    cli volume create vm --size "${SIZE_MIB}M" >/dev/null
    nbdcopy "$SEED" "$(url vm)"
}

# Rewrites vm with other unique data; its md5 is left in REWRITE_MD5.
rewrite() {
    head -c $((SIZE_MIB << 20)) /dev/urandom >"$SCRATCH/other.img"
    REWRITE_MD5=$(md5sum "$SCRATCH/other.img" | cut -d' ' -f1)
    nbdcopy "$SCRATCH/other.img" "$(url vm)"
    rm -f "$SCRATCH/other.img"
}

echo "# bench/shutdown.sh: $SIZE_MIB MiB volume, SIGTERM ${DELAY_MS} ms after the work starts ($(uptime | sed 's/.*load/load/'))"
echo
echo "| case | work at SIGTERM | stop ms | reopen + verify | data |"
echo "|---|---|---|---|---|"
IFS=, read -ra LIST <<<"$CASES"
for CASE in "${LIST[@]}"; do
    fresh
    declare -A WANT=([vm]=$SEED_MD5)
    FIO=""
    case "$CASE" in
        writes)
            # fio writes at random to a second volume; what it wrote is not checked, vm is.
            cli volume create scratch --size 1G >/dev/null
            fio --name=w --ioengine=nbd --uri="$(url scratch)" --rw=randwrite --bs=4k \
                --iodepth=32 --time_based --runtime=60 --size=1G >/dev/null 2>&1 &
            FIO=$!
            WORK="fio 4 KiB random writes, QD32" ;;
        copy-permanent)
            cli volume create dst --size "${SIZE_MIB}M" >/dev/null
            cli volume copy vm dst >/dev/null
            WANT[dst]=$SEED_MD5
            sleep 5
            WORK="a copy across volumes made permanent" ;;
        flatten)
            cli snapshot create vm old >/dev/null
            rewrite
            WANT[vm]=$REWRITE_MD5
            cli snapshot delete vm old >/dev/null
            WORK="a deleted snapshot's layer flattened" ;;
        clone-full)
            cli volume clone --full vm full >/dev/null 2>&1 &
            WANT[full]=maybe
            WORK="a full clone" ;;
        zero-settle)
            # nbdsh runs the python3 on PATH; the nbd module is the system's (python3-libnbd).
            PATH=/usr/bin:$PATH nbdsh -u "$(url vm)" -c '
n, step = h.get_size(), 1 << 30
for off in range(0, n, step):
    h.zero(min(step, n - off), off)
h.flush()'
            WANT[vm]=$ZERO_MD5
            WORK="the whole volume's zeroing settled" ;;
        cleaner)
            rewrite
            WANT[vm]=$REWRITE_MD5
            WORK="the garbage of a rewrite cleaned" ;;
        scrub)
            cli pool scrub >/dev/null
            WORK="a scrub pass" ;;
        delete)
            cli volume delete vm >/dev/null 2>&1 &
            WANT=([vm]=deleted)
            WORK="the volume deleted" ;;
        *) echo "unknown case $CASE" >&2; exit 2 ;;
    esac
    sleep "$(awk "BEGIN { print $DELAY_MS / 1000 }")"
    term
    [ -z "$FIO" ] || wait "$FIO" 2>/dev/null || true
    start
    if cli pool verify >/dev/null 2>"$SCRATCH/verify.err"; then
        VERIFY=ok
    else
        VERIFY="FAILED ($(head -c 200 "$SCRATCH/verify.err"))"; fail "$CASE: verify"
    fi
    DATA=ok
    for vol in "${!WANT[@]}"; do
        want=${WANT[$vol]}
        if [ "$want" = deleted ]; then
            if cli volume list 2>/dev/null | grep -qw "$vol"; then
                DATA="$vol still there"; fail "$CASE: $vol came back"
            else
                DATA="$DATA, $vol gone"
            fi
            continue
        fi
        if [ "$want" = maybe ]; then
            # A full clone the stop cut off is kept (since session 46) or, before, either
            # finished or left no volume: say which.
            if ! cli volume list 2>/dev/null | grep -qw "$vol"; then
                DATA="$DATA, $vol gone"
                continue
            fi
            DATA="$DATA, $vol kept"
            want=$SEED_MD5
        fi
        got=$(md5 "$vol")
        [ "$got" = "$want" ] || { DATA="$vol differs"; fail "$CASE: $vol reads back wrong"; }
    done
    unset WANT
    echo "| $CASE | $WORK | $STOP_MS | $VERIFY | $DATA |"
done
[ -z "$PID" ] || { kill -TERM "$PID"; wait "$PID" 2>/dev/null || true; PID=""; }
echo
echo "# done ($(uptime | sed 's/.*load/load/'))"
exit $FAILED
