#!/usr/bin/env bash
# iSCSI: ibid vs tgt serving sparse files, in one run, on 127.0.0.1.
# Issue 6, "Measure it". See docs/benchmarks/iscsi-tgt.md for the method and the results.
#
# usage: bench/iscsi/run.sh [--quick] [--reps N] [--size SIZE] [--image SIZE] [--big SIZE]
#                           [--systems "tgt ibid"] [--out DIR] [--scratch DIR] [--ibid PATH]
#
#   --size S    size of each ordinary LUN and of the XCOPY / read+write copy (default 8G)
#   --image S   size of the mixed image qemu-img converts into a LUN (default 4G)
#   --big S     size of the LUN zeroed with WRITE SAME (default 1T)
#   --zero-cap S  tgt writes WRITE SAME zeros as data: without UNMAP it is timed over this much
#               and extrapolated to --big (default 1G)
#   --perf-time N  seconds per iscsi-perf run (default 20)
#   --reps N    repetitions of every measurement (default 3); the data LUN is filled once per
#               system, before the first repetition
#   --quick     smoke test (< 60 s on an idle 2-core box): 256M LUNs, 128M image, 16G "big"
#               LUN, 3 s iscsi-perf, 1 repetition
#   --out DIR   results directory (default bench/iscsi/results/<UTC timestamp>)
#   --scratch   where the tgt files, the ibid pool and the image go (default: new dir in /var/tmp)
#
# Needs: tgtd/tgtadm (apt-get install tgt), iscsi-perf (libiscsi-bin), libiscsi-dev and cc (for
# iscsi_xcopy.c), qemu-img/qemu-io with iscsi:// (qemu-utils + qemu-block-extra), nbdkit (random
# plugin, the source of the written data), curl, /usr/bin/python3. Builds nothing of ibid: pass
# --ibid or build it first (cargo build --release -p ibid).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)

ARGS="$*"
QUICK=0
REPS=3
OUT=""
SCRATCH=""
SYSTEMS="tgt ibid"
IBID="${CARGO_TARGET_DIR:-$REPO/target}/release/ibid"
SIZE=8G
IMAGE=4G
BIG=1T
ZCAP=1G
PERF_T=20
SET_SIZE=0 SET_IMAGE=0 SET_BIG=0 SET_ZCAP=0 SET_PERF=0 SET_REPS=0

while [ $# -gt 0 ]; do
    case "$1" in
        --quick) QUICK=1 ;;
        --reps) REPS=$2; SET_REPS=1; shift ;;
        --size) SIZE=$2; SET_SIZE=1; shift ;;
        --image) IMAGE=$2; SET_IMAGE=1; shift ;;
        --big) BIG=$2; SET_BIG=1; shift ;;
        --zero-cap) ZCAP=$2; SET_ZCAP=1; shift ;;
        --perf-time) PERF_T=$2; SET_PERF=1; shift ;;
        --systems) SYSTEMS=$2; shift ;;
        --out) OUT=$2; shift ;;
        --scratch) SCRATCH=$2; shift ;;
        --ibid) IBID=$2; shift ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done
if [ "$QUICK" = 1 ]; then
    [ "$SET_SIZE" = 1 ] || SIZE=256M
    [ "$SET_IMAGE" = 1 ] || IMAGE=128M
    [ "$SET_BIG" = 1 ] || BIG=16G
    [ "$SET_ZCAP" = 1 ] || ZCAP=64M
    [ "$SET_PERF" = 1 ] || PERF_T=3
    [ "$SET_REPS" = 1 ] || REPS=1
fi

bytes() { numfmt --from=iec "$1"; }
SIZE_B=$(bytes "$SIZE"); IMAGE_B=$(bytes "$IMAGE"); BIG_B=$(bytes "$BIG"); ZCAP_B=$(bytes "$ZCAP")
GIB=$((1 << 30))

# ---------------------------------------------------------------- tools
missing=0
need() { command -v "$1" >/dev/null || { echo "missing tool: $1 ($2)" >&2; missing=1; }; }
need tgtd "apt-get install tgt"
need tgtadm "apt-get install tgt"
need iscsi-perf "apt-get install libiscsi-bin"
need qemu-img "apt-get install qemu-utils"
need qemu-io "apt-get install qemu-utils"
need nbdkit "apt-get install nbdkit"
need cc "apt-get install gcc"
need curl "apt-get install curl"
[ -e /usr/include/iscsi/iscsi.h ] || { echo "missing libiscsi-dev (apt-get install libiscsi-dev)" >&2; missing=1; }
ls /usr/lib/x86_64-linux-gnu/qemu/block-iscsi.so >/dev/null 2>&1 \
    || echo "warning: qemu block-iscsi module not found (apt-get install qemu-block-extra)" >&2
case " $SYSTEMS " in *" ibid "*) [ -x "$IBID" ] || { echo "no ibid binary at $IBID (cargo build --release -p ibid)" >&2; missing=1; } ;; esac
[ "$missing" = 0 ] || exit 1
PY=/usr/bin/python3

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
[ -n "$OUT" ] || OUT="$HERE/results/$STAMP"
mkdir -p "$OUT/logs" "$OUT/pool"
if [ -z "$SCRATCH" ]; then SCRATCH=$(mktemp -d /var/tmp/iscsi-tgt.XXXXXX); else mkdir -p "$SCRATCH"; fi

# Disk space: one system at a time; tgt needs the most (data + read/write copy + image + zero cap).
need_kib=$(( (3 * SIZE_B + 2 * IMAGE_B + ZCAP_B) / 1024 + 2 * 1024 * 1024 ))
avail_kib=$(df -Pk "$SCRATCH" | awk 'NR==2 {print $4}')
if [ "$avail_kib" -lt "$need_kib" ]; then
    echo "not enough space in $SCRATCH: need about $((need_kib / 1048576)) GiB, have $((avail_kib / 1048576)) GiB" >&2
    rmdir "$SCRATCH" 2>/dev/null || true
    exit 1
fi

cc -O2 -Wall -o "$SCRATCH/iscsi_xcopy" "$HERE/iscsi_xcopy.c" -liscsi
XCOPY="$SCRATCH/iscsi_xcopy"

# ---------------------------------------------------------------- servers
TGT_PORT=3261 TGT_CTL=11 TGT_IQN=iqn.2026-11.org.ibid.bench:tgt
IBID_PORT=3262 IBID_NBD=10862 IBID_HTTP=7862 IBID_IQN=iqn.2026-11.org.ibid:pool
TGT_PID="" IBID_PID=""
API=""

stop_tgt() {
    if [ -n "$TGT_PID" ]; then
        tgtadm -C "$TGT_CTL" --lld iscsi --op delete --mode target --tid 1 --force >/dev/null 2>&1 || true
        tgtadm -C "$TGT_CTL" --op delete --mode system >/dev/null 2>&1 || true
        for _ in $(seq 50); do kill -0 "$TGT_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$TGT_PID" 2>/dev/null || true    # tgtd ignores SIGTERM
        wait "$TGT_PID" 2>/dev/null || true
        TGT_PID=""
    fi
}
stop_ibid() {
    if [ -n "$IBID_PID" ]; then
        kill -TERM "$IBID_PID" 2>/dev/null || true
        for _ in $(seq 300); do kill -0 "$IBID_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$IBID_PID" 2>/dev/null || true
        wait "$IBID_PID" 2>/dev/null || true
        IBID_PID=""
    fi
}
cleanup() {
    local rc=$?
    stop_tgt || true
    stop_ibid || true
    rm -rf "$SCRATCH"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

port_free() { ! ss -ltn "sport = :$1" | grep -q LISTEN; }

# LUN roles; both systems get the same five LUNs in the same order.
ROLES="data xdst rwdst conv big"
size_of() { case "$1" in big) echo "$BIG_B" ;; *) echo "$SIZE_B" ;; esac; }

# start_tgt -> PORTAL IQN LUN_<role>
start_tgt() {
    port_free "$TGT_PORT" || { echo "port $TGT_PORT in use" >&2; return 1; }
    mkdir -p "$SCRATCH/tgt"
    tgtd -f -C "$TGT_CTL" --iscsi "portal=127.0.0.1:$TGT_PORT" >"$OUT/logs/tgtd.log" 2>&1 &
    TGT_PID=$!
    for _ in $(seq 50); do tgtadm -C "$TGT_CTL" --op show --mode target >/dev/null 2>&1 && break; sleep 0.1; done
    tgtadm -C "$TGT_CTL" --lld iscsi --op new --mode target --tid 1 -T "$TGT_IQN"
    local lun=1 r
    for r in $ROLES; do
        truncate -s "$(size_of "$r")" "$SCRATCH/tgt/$r.img"
        tgtadm -C "$TGT_CTL" --lld iscsi --op new --mode logicalunit --tid 1 --lun "$lun" \
            -b "$SCRATCH/tgt/$r.img" --bstype rdwr
        tgtadm -C "$TGT_CTL" --lld iscsi --op update --mode logicalunit --tid 1 --lun "$lun" \
            --params thin_provisioning=1
        eval "LUN_$r=$lun"
        lun=$((lun + 1))
    done
    tgtadm -C "$TGT_CTL" --lld iscsi --op bind --mode target --tid 1 -I ALL
    tgtadm -C "$TGT_CTL" --lld iscsi --op show --mode target >"$OUT/logs/tgt-show.txt"
    PORTAL="127.0.0.1:$TGT_PORT" IQN=$TGT_IQN
}

start_ibid() {
    local p
    for p in "$IBID_PORT" "$IBID_NBD" "$IBID_HTTP"; do port_free "$p" || { echo "port $p in use" >&2; return 1; }; done
    local vols=() r
    for r in $ROLES; do vols+=(--volume "$r=$(size_of "$r")"); done
    "$IBID" serve --data "$SCRATCH/ibid" --iscsi "127.0.0.1:$IBID_PORT" --nbd "127.0.0.1:$IBID_NBD" \
        --http "127.0.0.1:$IBID_HTTP" --no-default-volume "${vols[@]}" >"$OUT/logs/ibid.log" 2>&1 &
    IBID_PID=$!
    for _ in $(seq 300); do
        grep -q 'Ctrl-C stops' "$OUT/logs/ibid.log" 2>/dev/null && break
        kill -0 "$IBID_PID" 2>/dev/null || { cat "$OUT/logs/ibid.log" >&2; return 1; }
        sleep 0.1
    done
    # "volume NAME SIZE iSCSI LUN N ..." in the banner (the LUN table; see `ibid volume list`)
    for r in $ROLES; do
        eval "LUN_$r=$(awk -v n="$r" '$1 == "volume" && $2 == n { for (i = 1; i < NF; i++) if ($i == "LUN") print $(i + 1) }' "$OUT/logs/ibid.log")"
    done
    PORTAL="127.0.0.1:$IBID_PORT" IQN=$IBID_IQN API="http://127.0.0.1:$IBID_HTTP/api/v1"
}

url() { echo "iscsi://$PORTAL/$IQN/$(eval echo "\$LUN_$1")"; }
pool() { # pool NAME -> saves the pool stats (ibid only)
    [ "$SYS" = ibid ] && curl -sf "$API/pool" >"$OUT/pool/$SYS-rep$REP-$1.json" || true
}

# ---------------------------------------------------------------- recording
RES="$OUT/results.tsv"
printf 'system\trep\tmeasure\tvalue\tunit\twall_s\tloadavg\tnote\n' >"$RES"
T0=0 LOAD=""
tick() { LOAD=$(cut -d' ' -f1-3 /proc/loadavg); T0=$(date +%s.%N); }
tock() { printf "%.3f" "$(echo "$(date +%s.%N) - $T0" | bc)"; }
record() { # record MEASURE VALUE UNIT WALL NOTE
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$SYS" "$REP" "$1" "$2" "$3" "$4" "$LOAD" "${5:-}" >>"$RES"
    printf '  %-6s rep %s %-22s %12s %-6s (%s s, load %s) %s\n' "$SYS" "$REP" "$1" "$2" "$3" "$4" "$LOAD" "${5:-}"
}
rate() { echo "scale=1; $1 / $2 / 1000000" | bc; }   # bytes seconds -> MB/s

# zero BYTES UNMAP(0|1) URL: WRITE SAME through qemu-io, 1 GiB per request (qemu-io caps one
# request below 2 GiB; qemu's iscsi driver turns each into WRITE SAME commands: WRITE SAME(10),
# at most 65535 blocks = 32 MiB each, on LUNs under 2 TiB whose VPD B2h sets LBPWS10).
zero() {
    local n=$(( $1 / GIB )) rest=$(( $1 % GIB )) flags="-z" args=() i
    [ "$2" = 1 ] && flags="-z -u"
    for i in $(seq 0 $((n - 1))); do args+=(-c "write -q $flags $((i * GIB)) $GIB"); done
    [ "$rest" -gt 0 ] && args+=(-c "write -q $flags $((n * GIB)) $rest")
    qemu-io -f raw "${args[@]}" "$3" >>"$OUT/logs/qemu-io.log" 2>&1
}

perf_run() { # perf_run NAME ARGS... -> IOPS and MB/s from iscsi-perf's last "iops average"
    iscsi-perf "$@" >"$OUT/logs/$SYS-rep$REP-$PERF_NAME.txt" 2>&1
    tr '\r' '\n' <"$OUT/logs/$SYS-rep$REP-$PERF_NAME.txt" | grep 'iops average' | tail -1 \
        | sed -E 's/.*iops average ([0-9]+) \(([0-9]+) MB\/s\).*/\1 \2/'
}

# ---------------------------------------------------------------- environment record
{
    echo "date_utc: $(date -u +%FT%TZ)"
    echo "command: $0 $ARGS"
    echo "quick: $QUICK reps: $REPS systems: $SYSTEMS"
    echo "size: $SIZE image: $IMAGE big: $BIG zero_cap(tgt, no unmap): $ZCAP perf_time: $PERF_T s"
    echo "uptime: $(uptime)"
    echo "nproc: $(nproc)"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
    echo "kernel: $(uname -r)"
    echo "rustc: $(rustc --version 2>/dev/null || echo n/a)"
    echo "--- free -g"; free -g
    echo "--- df -T $SCRATCH"; df -T "$SCRATCH"
    echo "--- versions"
    echo "tgtd: $(tgtd --version 2>&1 | head -1) ($(dpkg-query -W -f='${Version}' tgt 2>/dev/null))"
    echo "libiscsi: $(dpkg-query -W -f='${Version}' libiscsi7 2>/dev/null) (iscsi-perf, iscsi_xcopy, qemu's iscsi driver)"
    echo "qemu: $(qemu-img --version | head -1); qemu-block-extra $(dpkg-query -W -f='${Version}' qemu-block-extra 2>/dev/null)"
    echo "nbdkit: $(nbdkit --version)"
    echo "ibid: $IBID ($(git -C "$REPO" rev-parse HEAD) $(git -C "$REPO" status --porcelain -- crates Cargo.toml Cargo.lock | wc -l) uncommitted changes under crates/)"
} >"$OUT/env.txt"
echo "results: $OUT"

# ---------------------------------------------------------------- the mixed image
# 1 MiB chunks: 40 % unique random, 30 % zero (left as holes), 30 % copies of one of 8
# "popular" random chunks; deterministic (seeded).
"$PY" - "$SCRATCH/mixed.img" "$IMAGE_B" <<'EOF'
import random, sys
path, size = sys.argv[1], int(sys.argv[2])
MiB = 1 << 20
rng = random.Random(6)
popular = [rng.randbytes(MiB) for _ in range(8)]
kinds = {"random": 0, "zero": 0, "repeat": 0}
with open(path, "wb") as f:
    f.truncate(size)
    for i in range(size // MiB):
        r = rng.random()
        if r < 0.4:
            f.seek(i * MiB); f.write(rng.randbytes(MiB)); kinds["random"] += 1
        elif r < 0.7:
            kinds["zero"] += 1
        else:
            f.seek(i * MiB); f.write(popular[rng.randrange(8)]); kinds["repeat"] += 1
print("mixed image MiB chunks:", kinds)
EOF
echo "mixed image: $(du -k "$SCRATCH/mixed.img" | cut -f1) KiB allocated of $IMAGE_B bytes" | tee -a "$OUT/env.txt"

# ---------------------------------------------------------------- the run
for SYS in $SYSTEMS; do
    REP=0
    echo "== $SYS"
    case "$SYS" in tgt) start_tgt ;; ibid) start_ibid ;; *) echo "unknown system $SYS" >&2; exit 2 ;; esac
    echo "  LUNs: data=$LUN_data xdst=$LUN_xdst rwdst=$LUN_rwdst conv=$LUN_conv big=$LUN_big at $PORTAL $IQN"

    # Fill the data LUN once with unique random data (nbdkit random, seed 6), the same bytes on
    # both systems: everything iscsi-perf reads and every copy copies is written data.
    pool fill-before
    tick
    nbdkit -U - random size="$SIZE_B" seed=6 \
        --run "qemu-img convert -n -f raw -O raw \"\$uri\" '$(url data)'" >>"$OUT/logs/fill.log" 2>&1
    w=$(tock); record fill-unique "$(rate "$SIZE_B" "$w")" MB/s "$w" "qemu-img convert of $SIZE unique random data (1 run)"
    pool fill-after

    for REP in $(seq "$REPS"); do
        # (1) reads of written data
        PERF_NAME=randread; tick
        read -r iops mbs < <(perf_run -r -m 32 -b 8 -t "$PERF_T" -i iqn.2026-11.org.ibid:bench-perf "$(url data)")
        record randread-4k-qd32 "$iops" IOPS "$(tock)" "$mbs MB/s"
        PERF_NAME=seqread; tick
        read -r iops mbs < <(perf_run -m 8 -b 2048 -t "$PERF_T" -i iqn.2026-11.org.ibid:bench-perf "$(url data)")
        record seqread-1m-qd8 "$mbs" MB/s "$(tock)" "$iops IOPS"

        # (2) qemu-img convert of the mixed image into an empty (rep 1) / previously written LUN
        pool conv-before; tick
        qemu-img convert -n -f raw -O raw "$SCRATCH/mixed.img" "$(url conv)" >>"$OUT/logs/convert.log" 2>&1
        w=$(tock); record convert-mixed "$(rate "$IMAGE_B" "$w")" MB/s "$w" "logical bytes of $IMAGE"
        pool conv-after

        # (3) zeroing: WRITE SAME without UNMAP (zero data) and with UNMAP
        pool zero-before
        if [ "$SYS" = tgt ] && [ "$ZCAP_B" -lt "$BIG_B" ]; then
            tick; zero "$ZCAP_B" 0 "$(url big)"; w=$(tock)
            est=$(echo "$w * $BIG_B / $ZCAP_B" | bc -l | xargs printf '%.0f')
            record zero-nounmap "$est" s "$w" "EXTRAPOLATED from $ZCAP ($w s, $(rate "$ZCAP_B" "$w") MB/s) to $BIG"
        else
            tick; zero "$BIG_B" 0 "$(url big)"; w=$(tock)
            record zero-nounmap "$w" s "$w" "$BIG"
        fi
        pool zero-mid
        tick; zero "$BIG_B" 1 "$(url big)"; w=$(tock)
        record zero-unmap "$w" s "$w" "$BIG"
        pool zero-after
        [ "$SYS" = tgt ] && echo "  tgt big.img allocated after zeroing: $(du -k "$SCRATCH/tgt/big.img" | cut -f1) KiB" | tee -a "$OUT/logs/tgt-alloc.txt"

        # (4) EXTENDED COPY of the written data LUN into another LUN, then the read+write copy
        pool xcopy-before; tick
        set +e
        xo=$("$XCOPY" "$PORTAL" "$IQN" "$LUN_data" "$LUN_xdst" "$SIZE_B" 32 2>>"$OUT/logs/xcopy.log"); xrc=$?
        set -e
        w=$(tock)
        echo "$SYS rep $REP: rc $xrc $xo" >>"$OUT/logs/xcopy.log"
        if [ "$xrc" = 0 ]; then
            record xcopy "$(echo "$xo" | awk '{print $2}')" s "$w" "$(echo "$xo" | cut -d' ' -f3-)"
        else
            record xcopy NA s "$w" "not supported: $xo"
        fi
        pool xcopy-after
        pool rw-before; tick
        qemu-img convert -n -f raw -O raw "$(url data)" "$(url rwdst)" >>"$OUT/logs/rwcopy.log" 2>&1
        w=$(tock); record rwcopy "$w" s "$w" "qemu-img convert LUN->LUN, $(rate "$SIZE_B" "$w") MB/s"
        pool rw-after
    done
    [ "$SYS" = tgt ] && du -k "$SCRATCH"/tgt/*.img >"$OUT/logs/tgt-du-end.txt"
    # ibid's per-volume request counts and engine time per kind (how many WRITE SAME commands
    # qemu sent, and how long the engine spent on them)
    [ "$SYS" = ibid ] && { curl -sf "http://127.0.0.1:$IBID_HTTP/metrics" | grep '^ibid_volume_' \
        | grep -v bucket >"$OUT/logs/ibid-metrics.txt" || true; }
    case "$SYS" in tgt) stop_tgt ;; ibid) stop_ibid ;; esac
    rm -rf "${SCRATCH:?}/$SYS" "$SCRATCH/ibid"
done
echo "uptime_end: $(uptime)" >>"$OUT/env.txt"

"$PY" "$HERE/summarize.py" "$OUT" | tee "$OUT/results.md"
