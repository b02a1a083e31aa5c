//! End-to-end tests with the real NBD clients (qemu-img, qemu-io, nbdinfo, nbdcopy, nbdsh,
//! fio) against a captive server on the in-memory backend over 127.0.0.1.

mod common;

use common::{cmd, exports, logs, nbdsh, ok, text, TestServer};
use ibid_nbd::memory::MemoryExport;
use ibid_nbd::{ServerConfig, TlsConfig, TlsCredentials};

/// Writes a raw image with data at [1 MiB, 2 MiB) (pattern 0xab) and [5 MiB, 5 MiB + 64 KiB).
fn source_image(dir: &std::path::Path) -> String {
    let path = dir.join("src.img").to_string_lossy().into_owned();
    ok("qemu-img", &["create", "-f", "raw", &path, "8M"]);
    ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0xab 1M 1M",
            "-c",
            "write -P 0x5c 5M 64k",
            &path,
        ],
    );
    path
}

/// Proves qemu-img info/convert (in and out)/compare/map against the server, and that qemu
/// negotiated extended headers (qemu 10 asks for them).
#[test]
fn qemu_img_info_convert_compare_map() {
    let ex = exports();
    ex.insert("conv", MemoryExport::new(8 << 20));
    let srv = TestServer::start(ex, ServerConfig::default());
    let dir = tempfile::tempdir().expect("tempdir");
    let src = source_image(dir.path());
    let uri = srv.uri("conv");

    let info = ok("qemu-img", &["info", "--output=json", &uri]);
    let info: serde_json::Value = serde_json::from_str(&info).expect("info json");
    assert_eq!(info["virtual-size"], 8 << 20, "{info}");

    ok(
        "qemu-img",
        &["convert", "-n", "-f", "raw", "-O", "raw", &src, &uri],
    );
    ok(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", &src, &uri],
    );

    let out = dir.path().join("out.img").to_string_lossy().into_owned();
    ok("qemu-img", &["convert", "-O", "raw", &uri, &out]);
    ok(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", &src, &out],
    );

    let map = ok("qemu-img", &["map", "--output=json", &uri]);
    let map: Vec<serde_json::Value> = serde_json::from_str(&map).expect("map json");
    let data: Vec<(u64, u64)> = map
        .iter()
        .filter(|e| e["data"] == true)
        .map(|e| {
            assert_eq!(e["zero"], false, "{e}");
            (
                e["start"].as_u64().unwrap_or(0),
                e["length"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        data,
        vec![(1 << 20, 1 << 20), (5 << 20, 64 << 10)],
        "{map:?}"
    );
    for e in map.iter().filter(|e| e["data"] == false) {
        assert_eq!(e["zero"], true, "holes read as zero: {e}");
    }
    assert!(
        logs().contains("mode=Extended"),
        "qemu should have negotiated extended headers"
    );
}

/// Proves qemu-io's write -P, write -f (FUA), write -z, write -z -u, write -z -n (fast zero),
/// discard, aio_write, flush and read -P verification.
#[test]
fn qemu_io_commands() {
    let ex = exports();
    let srv = TestServer::start(ex.clone(), ServerConfig::default());
    let uri = srv.uri("disk");
    let out = ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x11 0 64k",
            "-c",
            "write -f -P 0x12 64k 4k",
            "-c",
            "write -P 0x33 128k 192k",
            "-c",
            "write -z 128k 64k",
            "-c",
            "write -z -u 192k 64k",
            "-c",
            "write -z -n 256k 64k",
            "-c",
            "discard 320k 64k",
            "-c",
            "aio_write -P 0x22 1M 64k",
            "-c",
            "aio_write -P 0x23 2M 512",
            "-c",
            "aio_flush",
            "-c",
            "flush",
            "-c",
            "read -P 0x11 0 64k",
            "-c",
            "read -P 0x12 64k 4k",
            "-c",
            "read -P 0 128k 256k",
            "-c",
            "read -P 0x22 1M 64k",
            "-c",
            "read -P 0x23 2M 512",
            &uri,
        ],
    );
    assert!(!out.contains("failed"), "{out}");
    assert!(!out.contains("Pattern verification"), "{out}");
}

/// Proves nbdinfo --list, the advertised capabilities and block sizes, and --map extents.
#[test]
fn nbdinfo_list_capabilities_map() {
    let ex = exports();
    let m = ex.insert("mapped", MemoryExport::new(1 << 20));
    m.fill(64 << 10, &[9u8; 8192]).expect("fill");
    ex.insert("snap", MemoryExport::new(1 << 20).read_only());
    let srv = TestServer::start(ex, ServerConfig::default());

    let list = ok(
        "nbdinfo",
        &["--list", &format!("nbd://127.0.0.1:{}", srv.port)],
    );
    for name in ["disk", "mapped", "snap"] {
        assert!(
            list.contains(&format!("export=\"{name}\"")) || list.contains(name),
            "{list}"
        );
    }

    let info = ok("nbdinfo", &[&srv.uri("disk")]);
    for want in [
        "can_multi_conn: true",
        "can_fast_zero: true",
        "can_zero: true",
        "can_trim: true",
        "can_flush: true",
        "can_fua: true",
        "can_cache: true",
        "is_read_only: false",
        "block_size_minimum: 512",
        "block_size_preferred: 4096",
        "block_size_maximum: 33554432",
        "base:allocation",
    ] {
        assert!(info.contains(want), "missing {want}:\n{info}");
    }
    let ro = ok("nbdinfo", &[&srv.uri("snap")]);
    assert!(ro.contains("is_read_only: true"), "{ro}");

    let map = ok("nbdinfo", &["--map", &srv.uri("mapped")]);
    let rows: Vec<Vec<String>> = map
        .lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect();
    let rows: Vec<(&str, &str, &str)> = rows
        .iter()
        .map(|r| (r[0].as_str(), r[1].as_str(), r[2].as_str()))
        .collect();
    assert_eq!(
        rows,
        vec![
            ("0", "65536", "3"),
            ("65536", "8192", "0"),
            ("73728", "974848", "3")
        ],
        "{map}"
    );
}

/// Proves nbdcopy copies in and out (with --progress) byte for byte.
#[test]
fn nbdcopy_in_and_out() {
    let ex = exports();
    ex.insert("copy", MemoryExport::new(8 << 20));
    let srv = TestServer::start(ex, ServerConfig::default());
    let dir = tempfile::tempdir().expect("tempdir");
    let src = source_image(dir.path());
    ok("nbdcopy", &["--progress", &src, &srv.uri("copy")]);
    let out = dir.path().join("out.img").to_string_lossy().into_owned();
    std::fs::File::create(&out)
        .and_then(|f| f.set_len(8 << 20))
        .expect("create out");
    ok("nbdcopy", &["--progress", &srv.uri("copy"), &out]);
    let a = std::fs::read(&src).expect("read src");
    let b = std::fs::read(&out).expect("read out");
    assert!(a == b, "copied image differs");
}

/// Proves fast zero, block status (full and REQ_ONE), cache, and multi-conn through libnbd:
/// a write on one connection, a flush on a second, and a read on a third see the data.
#[test]
fn nbdsh_fast_zero_block_status_multi_conn() {
    let srv = TestServer::start(exports(), ServerConfig::default());
    let uri = srv.uri("disk");
    let script = format!(
        r#"
def connect():
    h = nbd.NBD()
    h.add_meta_context("base:allocation")
    h.connect_uri("{uri}")
    return h

h1, h2, h3 = connect(), connect(), connect()
assert h1.can_multi_conn() and h1.can_fast_zero() and h1.can_cache()
buf = b"\xa5" * 65536
h1.pwrite(buf, 1048576)
h2.flush()
assert h3.pread(65536, 1048576) == buf

entries = []
def cb(metacontext, offset, e, err):
    assert metacontext == "base:allocation"
    entries.extend(e)
h3.block_status(4 * 1048576, 0, cb)
assert entries[:6] == [1048576, 3, 65536, 0, 3 * 1048576 - 65536, 3], entries

entries.clear()
h3.block_status(4 * 1048576, 0, cb, nbd.CMD_FLAG_REQ_ONE)
assert entries == [1048576, 3], entries

h1.zero(65536, 1048576, nbd.CMD_FLAG_FAST_ZERO)
h1.zero(4096, 2 * 1048576, nbd.CMD_FLAG_NO_HOLE | nbd.CMD_FLAG_FUA)
assert h2.pread(65536, 1048576) == b"\0" * 65536
entries.clear()
h2.block_status(4 * 1048576, 0, cb)
assert entries == [4 * 1048576, 3], entries
h2.cache(65536, 0)
for h in (h1, h2, h3):
    h.shutdown()
print("ok")
"#
    );
    let out = nbdsh(&script);
    assert!(out.contains("ok"), "{out}");
}

/// Proves a read-only export refuses writes, trims and zeroes with EPERM (libnbd's client-side
/// checks turned off so the request reaches the server) while reads work.
#[test]
fn read_only_export_refuses_writes_with_eperm() {
    let ex = exports();
    let snap = ex.insert("vol@snap", MemoryExport::new(1 << 20).read_only());
    snap.fill(0, &[7u8; 4096]).expect("fill");
    let srv = TestServer::start(ex, ServerConfig::default());
    let script = format!(
        r#"
h = nbd.NBD()
h.connect_uri("{}")
assert h.is_read_only()
h.set_strict_mode(0)
for op in (lambda: h.pwrite(b"x" * 512, 0), lambda: h.trim(512, 0), lambda: h.zero(512, 0)):
    try:
        op()
        raise SystemExit("write to read-only export succeeded")
    except nbd.Error as e:
        assert "command failed" in str(e) and "EPERM" in str(e), e
assert h.pread(4096, 0) == b"\x07" * 4096
h.shutdown()
print("ok")
"#,
        srv.uri("vol@snap")
    );
    assert!(nbdsh(&script).contains("ok"));
}

/// Proves a full pool gives qemu-io ENOSPC for writes needing space, while overwrites of
/// existing data and reads keep working.
#[test]
fn pool_full_gives_enospc_and_reads_still_work() {
    let ex = exports();
    ex.insert("full", MemoryExport::new(16 << 20).with_capacity_blocks(16));
    let srv = TestServer::start(ex, ServerConfig::default());
    let uri = srv.uri("full");
    ok("qemu-io", &["-f", "raw", "-c", "write -P 0x42 0 64k", &uri]);
    let o = cmd("qemu-io", &["-f", "raw", "-c", "write -P 0x43 1M 4k", &uri]);
    let all = text(&o);
    assert!(all.contains("No space left on device"), "{all}");
    let out = ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "read -P 0x42 0 64k",
            "-c",
            "write -P 0x44 0 4k",
            "-c",
            "read -P 0 1M 4k",
            &uri,
        ],
    );
    assert!(!out.contains("failed"), "{out}");
}

/// Proves fio's nbd engine with crc32c verification at queue depth 16.
#[test]
fn fio_nbd_engine_verify() {
    let srv = TestServer::start(exports(), ServerConfig::default());
    let uri = srv.uri("disk");
    let out = ok(
        "fio",
        &[
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--size=8M",
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
        ],
    );
    assert!(out.contains("err= 0"), "{out}");
    assert!(!out.contains("verify: bad"), "{out}");
}

/// Proves a TLS-required server refuses a plain client and serves nbdinfo and qemu-img over
/// TLS with an X.509 certificate generated here.
#[test]
fn tls_required_refuses_plain_and_accepts_x509() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tls = common::tls_material(dir.path());
    let config = ServerConfig {
        tls: Some(tls),
        ..ServerConfig::default()
    };
    let srv = TestServer::start(exports(), config);
    let plain = cmd("nbdinfo", &[&srv.uri("disk")]);
    assert!(
        !plain.status.success(),
        "plain client must be refused:\n{}",
        text(&plain)
    );

    let d = dir.path().to_string_lossy().into_owned();
    let tls_uri = format!("nbds://127.0.0.1:{}/disk?tls-certificates={d}", srv.port);
    let info = ok("nbdinfo", &[&tls_uri]);
    assert!(info.contains("export-size: 67108864"), "{info}");
    assert!(info.contains("tls: true") || info.contains("TLS"), "{info}");

    qemu_over_tls(
        srv.port,
        &format!("tls-creds-x509,id=tls0,endpoint=client,dir={d}"),
        0x61,
        true,
    );
}

/// Proves TLS with pre-shared keys: nbdinfo (libnbd's `tls-psk-file`) and qemu-io / qemu-img
/// (`tls-creds-psk`) connect with the right key; a plain client, a wrong key and an unknown
/// identity are refused.
#[test]
fn tls_psk_accepts_the_right_key_and_refuses_others() {
    let dir = tempfile::tempdir().expect("tempdir");
    let key = "5c0ffee5aa11ce0011223344556677889900aabbccddeeff0011223344556677";
    let other = "6c0ffee5aa11ce0011223344556677889900aabbccddeeff0011223344556677";
    let write_keys = |sub: &str, line: String| {
        let d = dir.path().join(sub);
        std::fs::create_dir_all(&d).expect("mkdir");
        std::fs::write(d.join("keys.psk"), line + "\n").expect("write keys");
        d.to_string_lossy().into_owned()
    };
    let good = write_keys("good", format!("alice:{key}"));
    let wrong = write_keys("wrong", format!("alice:{other}"));
    let stranger = write_keys("stranger", format!("mallory:{key}"));
    let config = ServerConfig {
        tls: Some(TlsConfig {
            credentials: TlsCredentials::Psk {
                keys_file: format!("{good}/keys.psk").into(),
            },
            required: true,
        }),
        ..ServerConfig::default()
    };
    let srv = TestServer::start(exports(), config);
    let plain = cmd("nbdinfo", &[&srv.uri("disk")]);
    assert!(!plain.status.success(), "plain client must be refused");

    let uri = |user: &str, d: &str| {
        format!(
            "nbds://{user}@127.0.0.1:{}/disk?tls-psk-file={d}/keys.psk",
            srv.port
        )
    };
    let info = ok("nbdinfo", &[&uri("alice", &good)]);
    assert!(info.contains("export-size: 67108864"), "{info}");
    for (what, u) in [
        ("wrong key", uri("alice", &wrong)),
        ("unknown identity", uri("mallory", &stranger)),
    ] {
        let out = cmd("nbdinfo", &[&u]);
        assert!(
            !out.status.success(),
            "{what} must be refused:\n{}",
            text(&out)
        );
    }

    qemu_over_tls(
        srv.port,
        &format!("tls-creds-psk,id=tls0,endpoint=client,dir={good},username=alice"),
        0x62,
        true,
    );
}

/// Writes and reads back a pattern with qemu-io over TLS (`object`: a `tls-creds-*` object
/// with id `tls0`), and with `info` checks qemu-img sees the 64 MiB export too.
fn qemu_over_tls(port: u16, object: &str, pattern: u8, info: bool) {
    let opts = format!(
        "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={port},export=disk,tls-creds=tls0"
    );
    let (write, read) = (
        format!("write -P {pattern:#x} 0 64k"),
        format!("read -P {pattern:#x} 0 64k"),
    );
    ok(
        "qemu-io",
        &[
            "--object",
            object,
            "--image-opts",
            "-c",
            &write,
            "-c",
            &read,
            &opts,
        ],
    );
    if info {
        let out = ok(
            "qemu-img",
            &["info", "--object", object, "--image-opts", &opts],
        );
        assert!(out.contains("64 MiB"), "{out}");
    }
}

/// Undoes the nbdfuse mount, loop device and filesystem mount, whatever step failed.
struct FsGuard {
    fuse_dir: String,
    mnt: String,
    loop_dev: Option<String>,
    fuse: Option<std::process::Child>,
}

impl Drop for FsGuard {
    fn drop(&mut self) {
        let _ = cmd("umount", &[&self.mnt]);
        if let Some(dev) = self.loop_dev.take() {
            let _ = cmd("losetup", &["-d", &dev]);
        }
        let _ = cmd("fusermount3", &["-u", &self.fuse_dir]);
        if let Some(mut child) = self.fuse.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Proves a real block-device stack: nbdfuse + a loop device + mkfs.ext4 + mount + file
/// writes read back + fstrim, after which the freed space is gone from the export.
#[test]
fn nbdfuse_loop_ext4_fstrim_returns_space() {
    for tool in [
        "nbdfuse",
        "losetup",
        "mkfs.ext4",
        "mount",
        "umount",
        "fstrim",
        "fusermount3",
    ] {
        common::require(tool);
    }
    let ex = exports();
    let fs = ex.insert("fs", MemoryExport::new(128 << 20));
    let srv = TestServer::start(ex, ServerConfig::default());
    let dir = tempfile::tempdir().expect("tempdir");
    let fuse_dir = dir.path().join("fuse");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&fuse_dir).expect("mkdir fuse");
    std::fs::create_dir(&mnt).expect("mkdir mnt");
    let mut guard = FsGuard {
        fuse_dir: fuse_dir.to_string_lossy().into_owned(),
        mnt: mnt.to_string_lossy().into_owned(),
        loop_dev: None,
        fuse: None,
    };
    let device = fuse_dir.join("nbd");
    guard.fuse = Some(
        std::process::Command::new("nbdfuse")
            .arg(&device)
            .arg(srv.uri("fs"))
            .spawn()
            .expect("spawn nbdfuse"),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !device.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "nbdfuse did not mount"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let dev = ok("losetup", &["-f", "--show", &device.to_string_lossy()]);
    let dev = dev.trim().to_string();
    guard.loop_dev = Some(dev.clone());
    ok("mkfs.ext4", &["-q", "-F", "-E", "nodiscard", &dev]);
    ok("mount", &[&dev, &guard.mnt]);

    let file = mnt.join("data.bin");
    let content: Vec<u8> = (0..(16u32 << 20))
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&file, &content).expect("write file");
    ok("sync", &[]);
    let used_with_file = fs.stored_blocks();
    assert!(
        used_with_file >= 4096,
        "16 MiB file stored: {used_with_file} blocks"
    );
    ok("sh", &["-c", "echo 3 > /proc/sys/vm/drop_caches || true"]);
    assert!(
        std::fs::read(&file).expect("read back") == content,
        "file content differs"
    );

    std::fs::remove_file(&file).expect("remove");
    ok("sync", &[]);
    ok("fstrim", &["-v", &guard.mnt]);
    let used_after_trim = fs.stored_blocks();
    assert!(
        used_after_trim + 4000 <= used_with_file,
        "fstrim must free the file's blocks: {used_with_file} -> {used_after_trim}"
    );
    drop(guard);
}

/// Proves mutual TLS: with a client CA configured, a client without a certificate is refused
/// and nbdinfo and qemu-io with a CA-signed client certificate are served.
#[test]
fn tls_client_certificates_required_when_configured() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut tls = common::tls_material(dir.path());
    if let TlsCredentials::X509 { client_ca_pem, .. } = &mut tls.credentials {
        *client_ca_pem = Some(dir.path().join("ca-cert.pem"));
    }
    let config = ServerConfig {
        tls: Some(tls),
        ..ServerConfig::default()
    };
    let srv = TestServer::start(exports(), config);
    let d = dir.path().to_string_lossy().into_owned();
    let no_cert = format!("nbds://127.0.0.1:{}/disk?tls-certificates={d}", srv.port);
    let refused = cmd("nbdinfo", &[&no_cert]);
    assert!(
        !refused.status.success(),
        "client without certificate:\n{}",
        text(&refused)
    );

    let with_cert = format!(
        "nbds://127.0.0.1:{}/disk?tls-certificates={d}/client",
        srv.port
    );
    let info = ok("nbdinfo", &[&with_cert]);
    assert!(info.contains("export-size: 67108864"), "{info}");
    qemu_over_tls(
        srv.port,
        &format!("tls-creds-x509,id=tls0,endpoint=client,dir={d}/client"),
        0x62,
        false,
    );
}
