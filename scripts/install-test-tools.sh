#!/usr/bin/env bash
# Installs the real clients and peers the test suite drives, when they are missing.
# qemu-block-extra (qemu's iscsi:// driver) must match the installed qemu-utils exactly; the
# machine image ships qemu-utils from bookworm-backports, so we add that suite and install both
# from it (installing qemu-block-extra from plain bookworm would downgrade qemu-utils to 7.2).
set -euo pipefail
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo

need_pkgs=()
need() { command -v "$1" >/dev/null 2>&1 || need_pkgs+=("$2"); }
need nbdinfo libnbd-bin
need nbdfuse nbdfuse
need nbdkit nbdkit
need nbdsh python3-libnbd
need fio fio
need iscsi-test-cu libiscsi-bin
need mkfs.ext4 e2fsprogs
need fusermount3 fuse3
need losetup mount
need script bsdutils
need curl curl
# The web dashboard's tests drive Debian's Chromium headless through chromedriver.
need chromium chromium
need chromedriver chromium-driver
# The object-store tests (crates/ibid/tests/offload.rs) run Ceph's RADOS Gateway as plain
# processes on loopback (scripts/ceph-rgw.sh).
need ceph-mon ceph-mon
need ceph-mgr ceph-mgr
need ceph-osd ceph-osd
need radosgw radosgw
need radosgw-admin ceph-common
/usr/bin/python3 -c "import matplotlib" >/dev/null 2>&1 || need_pkgs+=(python3-matplotlib)
# scripts/faultfs.py (a FUSE filesystem that returns I/O errors on demand).
/usr/bin/python3 -c "import fusepy" >/dev/null 2>&1 || need_pkgs+=(python3-fusepy)
[ -f /usr/include/iscsi/iscsi.h ] || need_pkgs+=(libiscsi-dev)
# Build dependencies: openssl-sys (NBD TLS-PSK) finds libssl through pkg-config.
[ -f /usr/include/openssl/ssl.h ] || need_pkgs+=(libssl-dev)
need pkg-config pkg-config
qemu_ok=1
command -v qemu-img >/dev/null 2>&1 || qemu_ok=0
ls /usr/lib/x86_64-linux-gnu/qemu/block-iscsi.so >/dev/null 2>&1 || qemu_ok=0

[ "${#need_pkgs[@]}" -gt 0 ] || [ "$qemu_ok" = 0 ] || exit 0

if [ ! -f /etc/apt/sources.list.d/backports.sources ] && ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d; then
  $SUDO tee /etc/apt/sources.list.d/backports.sources >/dev/null <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi
echo "installing test tools: ${need_pkgs[*]} $([ "$qemu_ok" = 0 ] && echo qemu-utils qemu-block-extra)"
$SUDO apt-get update -qq
export DEBIAN_FRONTEND=noninteractive
if [ "$qemu_ok" = 0 ]; then
  $SUDO apt-get install -y -qq -t bookworm-backports qemu-utils qemu-block-extra
fi
if [ "${#need_pkgs[@]}" -gt 0 ]; then
  $SUDO apt-get install -y -qq "${need_pkgs[@]}"
fi
