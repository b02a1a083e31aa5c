#!/usr/bin/env bash
# Runs a one-node Ceph cluster with a RADOS Gateway (S3) on loopback, as plain processes under
# DIR: one monitor, one manager, one OSD on a file-backed BlueStore, pool size 1, radosgw's beast
# frontend on 127.0.0.1. No systemd, no cephadm, no kernel modules, no authentication inside the
# cluster (it listens on loopback only); S3 requests are signed with the key pair created here.
#
#   scripts/ceph-rgw.sh start DIR   # prints `export` lines: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
#                                   # AWS_SECRET_ACCESS_KEY, AWS_REGION, IBID_TEST_BUCKET
#   scripts/ceph-rgw.sh stop DIR    # stops the daemons (DIR is left for inspection)
#
# `start` takes about a minute (most of it waiting for HEALTH_OK). Ports: the monitor and the
# gateway take free ports found at start, so several clusters can run side by side. Needs the
# packages scripts/install-test-tools.sh installs (ceph-mon ceph-mgr ceph-osd radosgw ceph-common).
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
cmd=$1
mkdir -p "$2"
dir=$(cd "$2" && pwd)
conf=$dir/ceph.conf
# How long each stage may take before start gives up (seconds).
HEALTH_WAIT_S=${CEPH_RGW_HEALTH_WAIT_S:-240}
RGW_WAIT_S=${CEPH_RGW_WAIT_S:-120}
BUCKET=${IBID_TEST_BUCKET:-ibid-test}
ACCESS_KEY=ibidtestaccesskey
SECRET_KEY=ibidtestsecretkey0123456789abcdef

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

log() { echo "ceph-rgw: $*" >&2; }

ceph_() { timeout 20 ceph --conf "$conf" --connect-timeout 10 "$@"; }

stop() {
  local pid
  for name in rgw osd mgr mon; do
    for f in "$dir"/run/"$name"*.pid; do
      [ -f "$f" ] || continue
      pid=$(cat "$f")
      kill "$pid" 2>/dev/null || true
    done
  done
  # Give them a few seconds to exit, then kill what is left.
  for _ in $(seq 50); do
    local alive=0
    for f in "$dir"/run/*.pid; do
      [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && alive=1
    done
    [ $alive = 0 ] && break
    sleep 0.2
  done
  for f in "$dir"/run/*.pid; do
    [ -f "$f" ] || continue
    kill -9 "$(cat "$f")" 2>/dev/null || true
    rm -f "$f"
  done
}

start() {
  if [ -f "$dir/env" ] && [ -f "$dir/run/rgw.pid" ] && kill -0 "$(cat "$dir/run/rgw.pid")" 2>/dev/null; then
    cat "$dir/env"  # already running
    return
  fi
  stop
  rm -rf "$dir"/{mon,mgr,osd,run,log,env,ceph.conf,monmap}
  mkdir -p "$dir"/{mon/mon.a,mgr/mgr.x,osd/osd.0,run,log}
  local mon_port rgw_port fsid
  mon_port=$(free_port)
  rgw_port=$(free_port)
  fsid=$(python3 -c 'import uuid; print(uuid.uuid4())')
  cat >"$conf" <<CONF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$mon_port
public network = 127.0.0.0/8
auth cluster required = none
auth service required = none
auth client required = none
# radosgw asks for a secure (encrypted) monitor connection by default, which auth none cannot
# give: it would retry forever with EACCES.
ms mon client mode = crc
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim = false
mon warn on insecure global id reclaim allowed = false
mon data avail warn = 1
mon data avail crit = 0
osd objectstore = bluestore
bluestore block create = true
bluestore block size = ${CEPH_RGW_OSD_BYTES:-8589934592}
bluestore fsck on mount = false
osd memory target = 536870912
osd crush chooseleaf type = 0
run dir = $dir/run
log file = $dir/log/\$name.log
pid file = $dir/run/\$name.pid
admin socket = $dir/run/\$name.asok
mon data = $dir/mon/\$name
mgr data = $dir/mgr/\$name
osd data = $dir/osd/\$name
crash dir = $dir/log/crash
[mon]
mon cluster log file = $dir/log/cluster.log
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:$rgw_port tcp_nodelay=1
rgw data = $dir/rgw
rgw dns name = 127.0.0.1
rgw enable usage log = false
rgw thread pool size = 64
# A deleted object's tail (past its first 4 MiB) is queued for RGW's garbage collector, which
# by default frees it 2 hours later: runs that write and delete GiBs (the offload benchmark,
# the soak) would fill the small test OSD long before. Free it within a minute instead.
rgw gc obj min wait = 10
rgw gc processor period = 20
rgw gc processor max time = 20
CONF
  log "monitor on 127.0.0.1:$mon_port, gateway on 127.0.0.1:$rgw_port"
  # The monitor must find itself, by name, in the initial map (else it probes forever).
  monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$mon_port]" "$dir/monmap" >/dev/null
  ceph-mon --conf "$conf" --id a --mkfs --monmap "$dir/monmap" >"$dir/log/mkfs-mon.log" 2>&1
  ceph-mon --conf "$conf" --id a
  ceph-mgr --conf "$conf" --id x
  timeout 60 ceph --conf "$conf" osd create >/dev/null
  ceph-osd --conf "$conf" --id 0 --mkfs >"$dir/log/mkfs-osd.log" 2>&1
  ceph-osd --conf "$conf" --id 0
  log "waiting for HEALTH_OK"
  local waited=0 health=""
  while :; do
    health=$(ceph_ health 2>/dev/null || true)
    case "$health" in HEALTH_OK*) break ;; esac
    if [ $waited -ge "$HEALTH_WAIT_S" ]; then
      log "no HEALTH_OK after ${HEALTH_WAIT_S}s: $health"
      ceph_ status >&2 || true
      exit 1
    fi
    sleep 1
    waited=$((waited + 1))
  done
  log "healthy after ${waited}s; starting radosgw"
  radosgw --conf "$conf" --id rgw
  waited=0
  until curl -s -o /dev/null "http://127.0.0.1:$rgw_port/"; do
    if [ $waited -ge "$RGW_WAIT_S" ]; then
      log "radosgw did not answer on 127.0.0.1:$rgw_port after ${RGW_WAIT_S}s"
      tail -20 "$dir/log/client.rgw.log" >&2 || true
      exit 1
    fi
    sleep 1
    waited=$((waited + 1))
  done
  radosgw-admin --conf "$conf" user create --uid ibid-test --display-name "ibid tests" \
    --access-key "$ACCESS_KEY" --secret "$SECRET_KEY" >/dev/null 2>"$dir/log/user-create.log"
  # RGW answers 403 to a signed request without x-amz-content-sha256 (the empty body's hash).
  local status
  status=$(curl -s -o "$dir/log/bucket-create.out" -w '%{http_code}' -X PUT \
    --aws-sigv4 "aws:amz:us-east-1:s3" --user "$ACCESS_KEY:$SECRET_KEY" \
    -H "x-amz-content-sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855" \
    "http://127.0.0.1:$rgw_port/$BUCKET")
  case "$status" in
    200|409) ;;
    *) log "creating bucket $BUCKET answered HTTP $status: $(cat "$dir/log/bucket-create.out")"; exit 1 ;;
  esac
  cat >"$dir/env" <<ENV
export AWS_ENDPOINT_URL=http://127.0.0.1:$rgw_port
export AWS_ACCESS_KEY_ID=$ACCESS_KEY
export AWS_SECRET_ACCESS_KEY=$SECRET_KEY
export AWS_REGION=us-east-1
export IBID_TEST_BUCKET=$BUCKET
ENV
  cat "$dir/env"
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
