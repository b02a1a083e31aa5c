#!/usr/bin/env bash
# kill -9 soak of the offload paths (issue 35): each round starts a push, a restore (full or
# instant, in turn) or a remote GC, kills the server with SIGKILL at a random moment, restarts
# it, and runs the operation again to its end; then the bucket must verify clean. At the end,
# every snapshot the remote holds is restored and compared with the pool's own copy.
#
# usage: bench/offload/soak.sh [--rounds N] [--size-mib M] [--keep] IBID
#
# Needs an S3 store in the environment, as `scripts/ceph-rgw.sh start DIR` prints it
# (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, IBID_TEST_BUCKET); keys go
# under a prefix of the run's own. Real clients only: the ibid CLI, nbdsh, qemu-img.
# Ends with the line
#   soak: R rounds, K kills (push P, restore S, instant I, gc G), verify clean V/R, restores equal E/T
# and exits 1 if any check failed.
set -euo pipefail
# (No `grep -q` after a pipe below: with pipefail, a reader that stops early fails the
# pipeline through the writer's SIGPIPE.)

ROUNDS=20 SIZE_MIB=512 KEEP=0
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) ROUNDS=$2; shift ;;
        --size-mib) SIZE_MIB=$2; shift ;;
        --keep) KEEP=1 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) IBID=$1 ;;
    esac
    shift
done
[ -n "${IBID:-}" ] || { echo "give the ibid binary" >&2; exit 2; }
for v in AWS_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY IBID_TEST_BUCKET; do
    [ -n "${!v:-}" ] || { echo "$v is not set: eval \"\$(scripts/ceph-rgw.sh start DIR)\"" >&2; exit 2; }
done
SCRATCH=$(mktemp -d /var/tmp/ibid-soak.XXXXXX)
PREFIX=soak-$$-$(date +%s)
NBD=10995 HTTP=18995
API=http://127.0.0.1:$HTTP
PID=""
cleanup() {
    [ -z "$PID" ] || kill -KILL "$PID" 2>/dev/null || true
    [ "$KEEP" = 1 ] && echo "kept $SCRATCH" || rm -rf "$SCRATCH"
}
trap cleanup EXIT

start() {
    "$IBID" serve --data "$SCRATCH/pool" --nbd 127.0.0.1:$NBD --iscsi off --http 127.0.0.1:$HTTP \
        --no-default-volume >>"$SCRATCH/server.log" 2>&1 &
    PID=$!
    for _ in $(seq 600); do
        grep -q 'Ctrl-C stops' "$SCRATCH/server.log" 2>/dev/null && \
            [ "$(grep -c 'Ctrl-C stops' "$SCRATCH/server.log")" -ge "$STARTS" ] && return
        sleep 0.05
    done
    echo "the server did not start: $(tail -5 "$SCRATCH/server.log")" >&2; exit 1
}
STARTS=0
restart() {
    if [ -n "$PID" ]; then kill -KILL "$PID"; wait "$PID" 2>/dev/null || true; fi
    STARTS=$((STARTS + 1)); start
}
cli() { "$IBID" --server "$API" "$@"; }
url() { echo "nbd://127.0.0.1:$NBD/$1"; }

FAILED=0
fail() { echo "FAIL: $*" >&2; FAILED=1; }

restart
cli remote add soak --endpoint "$AWS_ENDPOINT_URL" --bucket "$IBID_TEST_BUCKET" --prefix "$PREFIX" >/dev/null
cli volume create vm --size "${SIZE_MIB}M" >/dev/null
head -c $((SIZE_MIB << 20)) /dev/urandom >"$SCRATCH/seed.img"
qemu-img convert -n -f raw -O raw "$SCRATCH/seed.img" "$(url vm)"
rm -f "$SCRATCH/seed.img"

# Changes 10 % of vm in random 64 KiB pieces, flushed (a push then takes a while).
change() {
    # nbdsh runs the python3 on PATH; the nbd module is the system's (python3-libnbd).
    PATH=/usr/bin:$PATH nbdsh -u "$(url vm)" -c "
import os, random
n = h.get_size() // 65536
for _ in range(max(1, n // 10)):
    h.pwrite(os.urandom(65536), random.randrange(n) * 65536)
h.flush()"
}

# Waits until no job runs (after a restart, the server runs a cut-off push or restore again).
wait_jobs() {
    for _ in $(seq 1200); do
        cli job list --json | grep '"state": "running"' >/dev/null || return 0
        sleep 0.1
    done
    fail "jobs still running after 120 s"
}

# Runs `cli ARGS...` in the background and kills the server after a random 0.05-1 s;
# FINISHED says whether the command had ended by then.
FINISHED=0
kill_during() {
    cli "$@" >/dev/null 2>&1 &
    local c=$!
    sleep "$(awk -v r="$RANDOM" 'BEGIN { printf "%.2f", 0.05 + r / 32767 * 0.95 }')"
    FINISHED=0
    kill -0 "$c" 2>/dev/null || FINISHED=1
    restart
    wait "$c" 2>/dev/null || true
}

SNAPS=() KILLS=0 KP=0 KR=0 KI=0 KG=0 CLEAN=0
for round in $(seq "$ROUNDS"); do
    case $((round % 4)) in
    1|0)
        change
        snap="s$round"
        cli snapshot create vm@"$snap" >/dev/null
        kill_during snapshot push vm@"$snap" --remote soak
        KILLS=$((KILLS + 1)); KP=$((KP + 1))
        # The server runs the push again by itself; by hand if it had not started it.
        wait_jobs
        if ! cli snapshot list --remote soak --json | grep "\"$snap\"" >/dev/null; then
            cli snapshot push vm@"$snap" --remote soak >/dev/null || fail "round $round: push again"
        fi
        SNAPS+=("$snap")
        what="push (finished before the kill: $FINISHED)" ;;
    2)
        snap=${SNAPS[$((RANDOM % ${#SNAPS[@]}))]}
        if [ $((round % 8)) = 2 ]; then
            kill_during volume restore "r$round" --remote soak --snapshot vm@"$snap"
            KR=$((KR + 1))
            # The restore runs again after the restart: from its last checkpoint on the volume
            # kept, or from the start if it had made none (the volume is then deleted first).
            wait_jobs
            if ! cli volume list --json | grep "\"r$round\"" >/dev/null; then
                cli volume restore "r$round" --remote soak --snapshot vm@"$snap" >/dev/null || fail "round $round: restore again"
            fi
            what="restore of $snap (finished before the kill: $FINISHED)"
        else
            kill_during volume restore "r$round" --remote soak --snapshot vm@"$snap" --instant --fill-rate 64M
            KI=$((KI + 1))
            if ! cli volume list --json | grep "\"r$round\"" >/dev/null; then
                cli volume restore "r$round" --remote soak --snapshot vm@"$snap" --instant >/dev/null || fail "round $round: instant restore again"
            fi
            for _ in $(seq 1200); do
                cli volume describe "r$round" --json | grep '"restoring": null' >/dev/null && break
                sleep 0.1
            done
            what="instant restore of $snap (finished before the kill: $FINISHED)"
        fi
        KILLS=$((KILLS + 1))
        qemu-img compare -q -f raw -F raw "$(url "vm@$snap")" "$(url "r$round")" || fail "round $round: r$round differs from vm@$snap"
        cli volume delete "r$round" --force >/dev/null ;;
    3)
        if [ ${#SNAPS[@]} -gt 2 ]; then
            cli snapshot delete vm@"${SNAPS[0]}" --remote soak >/dev/null
            SNAPS=("${SNAPS[@]:1}")
        fi
        kill_during remote gc soak
        KILLS=$((KILLS + 1)); KG=$((KG + 1))
        wait_jobs
        cli remote gc soak >/dev/null || fail "round $round: gc again"
        what="gc (finished before the kill: $FINISHED)" ;;
    esac
    if out=$(cli remote verify soak --json 2>&1); then
        CLEAN=$((CLEAN + 1))
    else
        fail "round $round: remote verify: $out"
    fi
    echo "round $round: $what, verify ok so far $CLEAN/$round"
done

EQUAL=0
for snap in "${SNAPS[@]}"; do
    cli volume restore "final-$snap" --remote soak --snapshot vm@"$snap" >/dev/null
    if qemu-img compare -q -f raw -F raw "$(url "vm@$snap")" "$(url "final-$snap")"; then
        EQUAL=$((EQUAL + 1))
    else
        fail "final: vm@$snap restores different"
    fi
done
echo "soak: $ROUNDS rounds, $KILLS kills (push $KP, restore $KR, instant $KI, gc $KG), verify clean $CLEAN/$ROUNDS, restores equal $EQUAL/${#SNAPS[@]}"
exit $FAILED
