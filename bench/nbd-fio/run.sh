#!/usr/bin/env bash
# fio over NBD: ibid vs qemu-nbd (raw, qcow2) vs nbdkit file, in one run.
# Issue 4, "Measure it". See docs/benchmarks/nbd-fio.md for the method and the results.
#
# usage: bench/nbd-fio/run.sh [--quick] [--reps N] [--out DIR] [--scratch DIR]
#                             [--systems "ibid qemu-raw qemu-qcow2 nbdkit-file"]
#                             [--ibid PATH] [--port-base N] [--perf] [--jobs "JOB ..."]
#
#   --quick     smoke test: 256 MiB sequential jobs, 3 s random jobs, 2 s QD1 jobs, 1 repetition
#   --reps N    repetitions (default 3); every repetition starts every system on fresh storage
#   --out DIR   results directory (default bench/nbd-fio/results/<UTC timestamp>)
#   --scratch   where the pool / image files go (default: a fresh dir under /var/tmp)
#   --jobs      run only these jobs (default: all, in order: seq-unique seq-reducible randwrite
#               randread qd1-write-flush qd1-write-fua write-zeroes; later jobs use the data the
#               sequential jobs wrote)
#   --perf      also run `perf record` on the ibid process during each ibid job (costs CPU:
#               do not use for the measured runs on a small box)
#
# Needs: fio (nbd engine), qemu-nbd, qemu-img, nbdkit, nbdinfo, /usr/bin/python3 with the libnbd
# bindings (python3-libnbd), jq is not needed.  Builds nothing: pass --ibid or build
# target/release/ibid first.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)

ARGS="$*"
QUICK=0
REPS=3
OUT=""
SCRATCH=""
SYSTEMS="ibid qemu-raw qemu-qcow2 nbdkit-file"
IBID="$REPO/target/release/ibid"
PORT_BASE=10850
PERF=0
JOBS="seq-unique seq-reducible randwrite randread qd1-write-flush qd1-write-fua write-zeroes"

while [ $# -gt 0 ]; do
    case "$1" in
        --quick) QUICK=1 ;;
        --reps) REPS=$2; shift ;;
        --out) OUT=$2; shift ;;
        --scratch) SCRATCH=$2; shift ;;
        --systems) SYSTEMS=$2; shift ;;
        --ibid) IBID=$2; shift ;;
        --port-base) PORT_BASE=$2; shift ;;
        --perf) PERF=1 ;;
        --jobs) JOBS=$2; shift ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done

VOL_SIZE=16G            # every export is 16 GiB
SEQ_SIZE=4G             # each 1 MiB sequential job writes this much (unique at 0, reducible after)
RAND_REGION=4G          # random jobs and QD1 jobs work inside [0, RAND_REGION) (written by seq-unique)
RAND_RUNTIME=30         # seconds, time-based, after RAMP
RAMP=2
QD1_RUNTIME=10
ZERO_SIZE=16G           # write-zeroes over the whole export
ZERO_CHUNK=1G           # bytes per NBD_CMD_WRITE_ZEROES
if [ "$QUICK" = 1 ]; then
    SEQ_SIZE=256M; RAND_REGION=256M; RAND_RUNTIME=3; RAMP=0; QD1_RUNTIME=2
    [ "$REPS" = 3 ] && REPS=1
fi

bytes() { numfmt --from=iec "$1"; }

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
[ -n "$OUT" ] || OUT="$HERE/results/$STAMP"
mkdir -p "$OUT/fio" "$OUT/ops" "$OUT/logs" "$OUT/perf"
if [ -z "$SCRATCH" ]; then
    SCRATCH=$(mktemp -d /var/tmp/nbd-fio.XXXXXX)
else
    mkdir -p "$SCRATCH"
fi
PY=/usr/bin/python3

for t in fio qemu-nbd qemu-img nbdkit nbdinfo "$PY"; do
    command -v "$t" >/dev/null || { echo "missing tool: $t" >&2; exit 1; }
done
case " $SYSTEMS " in *" ibid "*) [ -x "$IBID" ] || { echo "no ibid binary at $IBID" >&2; exit 1; } ;; esac

# ---------------------------------------------------------------- process bookkeeping
SRV_PID=""
PERF_PID=""
cleanup() {
    local rc=$?
    [ -n "$PERF_PID" ] && kill -INT "$PERF_PID" 2>/dev/null && wait "$PERF_PID" 2>/dev/null || true
    stop_server || true
    rm -rf "$SCRATCH"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

stop_server() {
    if [ -n "$SRV_PID" ]; then
        kill -TERM "$SRV_PID" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$SRV_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$SRV_PID" 2>/dev/null || true
        wait "$SRV_PID" 2>/dev/null || true
        SRV_PID=""
    fi
}

port_of() {
    case "$1" in
        ibid) echo $((PORT_BASE + 0)) ;; qemu-raw) echo $((PORT_BASE + 1)) ;;
        qemu-qcow2) echo $((PORT_BASE + 2)) ;; nbdkit-file) echo $((PORT_BASE + 3)) ;;
        *) echo "unknown system $1" >&2; return 1 ;;
    esac
}

# start_server SYSTEM REP -> sets SRV_PID, URI, DATA
start_server() {
    local sys=$1 rep=$2 port
    port=$(port_of "$sys")
    if ss -ltn "sport = :$port" | grep -q LISTEN; then
        echo "port $port already in use" >&2; return 1
    fi
    DATA="$SCRATCH/$sys"
    rm -rf "$DATA"; mkdir -p "$DATA"
    local log="$OUT/logs/$sys-rep$rep.log"
    case "$sys" in
        ibid)
            "$IBID" serve --data "$DATA/pool" --nbd "127.0.0.1:$port" --iscsi off \
                --volume "bench=$VOL_SIZE" --no-default-volume >"$log" 2>&1 &
            ;;
        qemu-raw)
            qemu-img create -q -f raw "$DATA/disk.raw" "$VOL_SIZE"
            qemu-nbd -f raw -b 127.0.0.1 -p "$port" -t -e 8 -x bench --cache=none --aio=native \
                --discard=unmap "$DATA/disk.raw" >"$log" 2>&1 &
            ;;
        qemu-qcow2)
            qemu-img create -q -f qcow2 "$DATA/disk.qcow2" "$VOL_SIZE"
            qemu-nbd -f qcow2 -b 127.0.0.1 -p "$port" -t -e 8 -x bench --cache=none --aio=native \
                --discard=unmap "$DATA/disk.qcow2" >"$log" 2>&1 &
            ;;
        nbdkit-file)
            truncate -s "$VOL_SIZE" "$DATA/disk.img"
            nbdkit -f -i 127.0.0.1 -p "$port" -e bench file file="$DATA/disk.img" >"$log" 2>&1 &
            ;;
    esac
    SRV_PID=$!
    URI="nbd://127.0.0.1:$port/bench"
    for _ in $(seq 300); do
        if nbdinfo --size "$URI" >/dev/null 2>&1; then return 0; fi
        kill -0 "$SRV_PID" 2>/dev/null || { echo "$sys died at start:"; cat "$log"; return 1; } >&2
        sleep 0.1
    done
    echo "$sys did not come up on $URI" >&2; return 1
}

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }

perf_start() {
    if [ "$PERF" = 1 ] && [ "$1" = ibid ]; then
        perf record -F 999 -p "$SRV_PID" -o "$OUT/perf/$2.data" >/dev/null 2>&1 &
        PERF_PID=$!
    fi
}
perf_stop() {
    if [ -n "$PERF_PID" ]; then
        kill -INT "$PERF_PID" 2>/dev/null || true
        wait "$PERF_PID" 2>/dev/null || true
        PERF_PID=""
        { perf report -i "$OUT/perf/$1.data" --sort comm --stdio 2>/dev/null | grep -v '^#' | grep -v '^$' | head -12
          echo
          perf report -i "$OUT/perf/$1.data" --sort symbol --stdio 2>/dev/null | grep -v '^#' | grep -v '^$' | head -40
        } | sed 's/[ -]*$//' >"$OUT/perf/$1.txt" || true
        rm -f "$OUT/perf/$1.data"
    fi
}

# run_job SYSTEM REP JOB -- records wall time, server CPU seconds and the load average
META="$OUT/jobs.tsv"
[ -f "$META" ] || printf 'system\trep\tjob\twall_s\tserver_cpu_s\tloadavg1\tctx_switches\n' >"$META"
run_job() {
    local sys=$1 rep=$2 job=$3 t0 t1 c0 c1 load tag
    tag="$sys-rep$rep-$job"
    load=$(cut -d' ' -f1 /proc/loadavg)
    c0=$(cpu_ticks "$SRV_PID"); t0=$(date +%s.%N)
    perf_start "$sys" "$tag"
    perf stat -x, -e context-switches -p "$SRV_PID" -o "$OUT/logs/$tag.cs" 2>/dev/null &
    local stat_pid=$!
    local common=(--ioengine=nbd "--uri=$URI" --output-format=json --lat_percentiles=1
                  "--output=$OUT/fio/$tag.json")
    case "$job" in
        seq-unique)
            fio --name="$job" "${common[@]}" --rw=write --bs=1M --iodepth=8 \
                --offset=0 --size="$SEQ_SIZE" --refill_buffers=1 --randseed=1 --end_fsync=1 ;;
        seq-reducible)
            fio --name="$job" "${common[@]}" --rw=write --bs=1M --iodepth=8 \
                --offset="$SEQ_SIZE" --size="$SEQ_SIZE" --refill_buffers=1 --randseed=2 \
                --dedupe_percentage=80 --buffer_compress_percentage=50 --end_fsync=1 ;;
        randwrite)
            fio --name="$job" "${common[@]}" --rw=randwrite --bs=4k --iodepth=32 \
                --offset=0 --size="$RAND_REGION" --norandommap --refill_buffers=1 --randseed=3 \
                --time_based --runtime="$RAND_RUNTIME" --ramp_time="$RAMP" ;;
        randread)
            fio --name="$job" "${common[@]}" --rw=randread --bs=4k --iodepth=32 \
                --offset=0 --size="$RAND_REGION" --norandommap --randseed=4 \
                --time_based --runtime="$RAND_RUNTIME" --ramp_time="$RAMP" ;;
        qd1-write-flush)
            fio --name="$job" "${common[@]}" --rw=randwrite --bs=4k --iodepth=1 --fsync=1 \
                --offset=0 --size="$RAND_REGION" --norandommap --refill_buffers=1 --randseed=5 \
                --time_based --runtime="$QD1_RUNTIME" ;;
        qd1-write-fua)
            "$PY" "$HERE/nbdops.py" fua "$URI" "$QD1_RUNTIME" "$(bytes "$RAND_REGION")" \
                "$OUT/ops/$tag.json" >/dev/null ;;
        write-zeroes)
            "$PY" "$HERE/nbdops.py" zero "$URI" "$(bytes "$ZERO_SIZE")" "$(bytes "$ZERO_CHUNK")" \
                "$OUT/ops/$tag.json" >/dev/null ;;
    esac
    t1=$(date +%s.%N); c1=$(cpu_ticks "$SRV_PID")
    kill -INT "$stat_pid" 2>/dev/null || true; wait "$stat_pid" 2>/dev/null || true
    local cs
    cs=$(awk -F, '/context-switches/ {print $1}' "$OUT/logs/$tag.cs" 2>/dev/null || true)
    perf_stop "$tag"
    printf '%s\t%s\t%s\t%.2f\t%.2f\t%s\t%s\n' "$sys" "$rep" "$job" "$(echo "$t1 - $t0" | bc)" \
        "$(echo "($c1 - $c0) / $(getconf CLK_TCK)" | bc -l)" "$load" "${cs:-}" >>"$META"
    echo "  $tag: done ($(echo "$t1 - $t0" | bc | cut -c1-6) s, load $load)"
}


# ---------------------------------------------------------------- environment record
{
    echo "date_utc: $(date -u +%FT%TZ)"
    echo "command: $0 $ARGS"
    echo "quick: $QUICK reps: $REPS systems: $SYSTEMS jobs: $JOBS"
    echo "seq_size: $SEQ_SIZE rand_region: $RAND_REGION rand_runtime: $RAND_RUNTIME ramp: $RAMP qd1_runtime: $QD1_RUNTIME zero: $ZERO_SIZE in $ZERO_CHUNK requests"
    echo "uptime: $(uptime)"
    echo "nproc: $(nproc)"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
    echo "kernel: $(uname -r)"
    echo "--- free -g"; free -g
    echo "--- df -T $SCRATCH"; df -T "$SCRATCH"
    echo "--- versions"
    echo "fio: $(fio --version)"
    echo "qemu-nbd: $(qemu-nbd --version | head -1)"
    echo "nbdkit: $(nbdkit --version)"
    echo "libnbd: $(nbdinfo --version | head -1)"
    echo "ibid: $IBID ($(git -C "$REPO" rev-parse HEAD) $(git -C "$REPO" status --porcelain -- crates Cargo.toml Cargo.lock | wc -l) uncommitted changes under crates/)"
} >"$OUT/env.txt"

# The disk alone, the ceiling for every system: 1 MiB O_DIRECT writes of a new file on the
# scratch filesystem, one at a time and four at a time (hosts of the same kind differed 2x).
disk_alone() {
    local f="$SCRATCH/disk-alone.fio" mbs
    mbs=$(fio --name=disk --filename="$f" --rw=write --bs=1M --size="$DISK_PROBE_SIZE" --direct=1 \
              "$@" --output-format=json 2>/dev/null |
          "$PY" -c 'import json, sys; print("%.0f" % (json.load(sys.stdin)["jobs"][0]["write"]["bw_bytes"] / 1e6))') ||
        mbs="failed"
    rm -f "$f"
    echo "$mbs"
}
DISK_PROBE_SIZE=1G
[ "$QUICK" = 1 ] && DISK_PROBE_SIZE=256M
echo "disk alone ($DISK_PROBE_SIZE of 1 MiB O_DIRECT writes to a new file in $SCRATCH):" \
    "QD1 $(disk_alone --ioengine=psync) MB/s, QD4 $(disk_alone --ioengine=libaio --iodepth=4) MB/s" |
    tee -a "$OUT/env.txt"
echo "results: $OUT"

# ---------------------------------------------------------------- the run
read -r -a SYS_ARR <<<"$SYSTEMS"
n=${#SYS_ARR[@]}
for rep in $(seq "$REPS"); do
    # rotate the order each repetition so slow drifts in machine load spread over all systems
    for i in $(seq 0 $((n - 1))); do
        sys=${SYS_ARR[$(( (i + rep - 1) % n ))]}
        echo "rep $rep: $sys"
        start_server "$sys" "$rep"
        for job in $JOBS; do
            run_job "$sys" "$rep" "$job"
            if [ "$job" = seq-reducible ]; then
                printf '%s\t%s\t%s\n' "$sys" "$rep" "$(du -sk "$DATA" | cut -f1)" >>"$OUT/space_after_seq_kib.tsv"
            fi
        done
        stop_server
        rm -rf "$DATA"
    done
done
echo "uptime_end: $(uptime)" >>"$OUT/env.txt"

"$PY" "$HERE/summarize.py" "$OUT" | tee "$OUT/results.md"
