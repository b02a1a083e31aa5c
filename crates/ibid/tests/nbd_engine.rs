//! End to end: `ibid serve` on a real pool, driven over NBD by the real clients (qemu-img,
//! qemu-io, nbdinfo, nbdcopy, fio, nbdfuse + ext4). Space accounting is checked by opening the
//! pool with the engine after the server has stopped cleanly.

mod common;

use common::{make_image, output, require, run, Server};
use ibid_engine::{Pool, PoolConfig};
use std::collections::HashSet;

fn engine_stats(dir: &std::path::Path) -> ibid_engine::PoolStats {
    let pool = common::open_quiet(dir);
    let s = pool.stats();
    pool.close().expect("close");
    s
}

/// An image copied in with qemu-img, read back with qemu-img and nbdcopy, survives a restart,
/// is mapped exactly (zeros are holes), and costs exactly its distinct non-zero blocks.
#[test]
fn qemu_img_convert_compare_map_and_space_accounting() {
    let srv = Server::start(&["--volume", "img=16M", "--no-default-volume"]);
    let work = tempfile::tempdir().expect("tempdir");
    let image = work.path().join("in.raw");
    make_image(&image, 16 << 20);
    let img = image.to_str().expect("utf8");
    run(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            img,
            &srv.url("img"),
        ],
    );
    run(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", img, &srv.url("img")],
    );
    let map = run(
        "qemu-img",
        &["map", "--output=json", "-f", "raw", &srv.url("img")],
    );
    let extents: Vec<serde_json::Value> = serde_json::from_str(&map).expect("map json");
    let zero_bytes: u64 = extents
        .iter()
        .filter(|e| e["zero"] == true)
        .map(|e| e["length"].as_u64().expect("length"))
        .sum();
    // Every 8th block of the image is zero, and every 8th+6,7 too (untouched): 3/8 of it.
    assert_eq!(
        zero_bytes,
        (16 << 20) * 3 / 8,
        "qemu-img map zero extents: {map}"
    );
    let out = work.path().join("out.raw");
    run(
        "nbdcopy",
        &["--progress", &srv.url("img"), out.to_str().expect("utf8")],
    );
    assert!(
        std::fs::read(&out).expect("out") == std::fs::read(&image).expect("in"),
        "nbdcopy out differs"
    );

    let dir = srv.stop();
    let stats = engine_stats(&dir.path().join("pool"));
    let data = std::fs::read(&image).expect("image");
    let blocks: Vec<&[u8]> = data
        .chunks(4096)
        .filter(|b| b.iter().any(|&x| x != 0))
        .collect();
    let distinct: HashSet<&[u8]> = blocks.iter().copied().collect();
    assert_eq!(stats.logical_written_bytes, blocks.len() as u64 * 4096);
    assert_eq!(stats.unique_chunks, distinct.len() as u64);
    // 3/8 of the blocks are random (stored whole, 24-byte record header each); the two
    // repeated blocks dedup to one chunk each, and zeros cost nothing: 5/8 of the blocks are
    // logical data over ~3/8 physical.
    assert!(stats.physical_bytes <= stats.unique_chunks * (4096 + 24));
    assert!(
        stats.data_reduction_ratio > 1.6,
        "reduction ratio {}",
        stats.data_reduction_ratio
    );

    // Restart on the same pool: the data is still there.
    let srv = Server::start_in(dir, &[]);
    run(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", img, &srv.url("img")],
    );
}

/// qemu-io: patterned writes, zero writes (with and without unmap), discard, aio, flush, and
/// read-back verification; then nbdinfo sees the export and its map.
#[test]
fn qemu_io_write_zero_discard_and_nbdinfo() {
    let srv = Server::start(&["--volume", "q=32M", "--no-default-volume"]);
    let url = srv.url("q");
    let cmds = [
        "write -P 0xa5 0 1M",
        "write -P 0x5a 1M 512",
        "aio_write -P 0x11 2M 64k",
        "aio_flush",
        "write -z 4M 1M",
        "write -z -u 5M 1M",
        "discard 1536k 512k",
        "flush",
        "read -P 0xa5 0 1M",
        "read -P 0x5a 1M 512",
        "read -P 0 1049088 523776",
        "read -P 0x11 2M 64k",
        "read -P 0 4M 2M",
    ];
    let mut args = vec!["-f", "raw"];
    for c in &cmds {
        args.extend(["-c", c]);
    }
    args.push(&url);
    let out = run("qemu-io", &args);
    assert!(!out.contains("Pattern verification failed"), "{out}");
    let info = run("nbdinfo", &[&url]);
    assert!(info.contains("export-size: 33554432"), "{info}");
    assert!(
        info.contains("can_fast_zero: true") && info.contains("can_multi_conn: true"),
        "{info}"
    );
    let list = run("nbdinfo", &["--list", &format!("nbd://{}", srv.nbd)]);
    assert!(list.contains("export=\"q\""), "{list}");
    let map = run("nbdinfo", &["--map", &url]);
    assert!(
        map.lines().next().is_some_and(|l| l.contains("data")),
        "{map}"
    );
    // Out-of-range I/O is refused and the server keeps serving.
    let bad = output("qemu-io", &["-f", "raw", "-c", "read 32M 512", &url]);
    assert!(
        String::from_utf8_lossy(&bad.stdout).contains("error")
            || !bad.status.success()
            || String::from_utf8_lossy(&bad.stderr).contains("error")
    );
    run("qemu-io", &["-f", "raw", "-c", "read -P 0xa5 0 4k", &url]);
}

/// fio's nbd engine: random 4 KiB writes at queue depth 16 with crc32c verification.
#[test]
fn fio_nbd_verify_crc32c() {
    require("fio");
    let srv = Server::start(&["--volume", "f=64M", "--no-default-volume"]);
    fio_verify(&srv);
}

/// `--nbd-workers 1`: the server runs exactly one NBD worker thread, and a client with 16
/// requests in flight still gets every one answered correctly (they queue for it). Zero
/// workers is refused before anything starts.
#[test]
fn nbd_workers_flag_sets_the_pool_size() {
    require("fio");
    let srv = Server::start(&[
        "--volume",
        "f=64M",
        "--no-default-volume",
        "--nbd-workers",
        "1",
    ]);
    fio_verify(&srv);
    // Checked once requests were served: the pool starts beside the listener, not before the
    // server prints its address.
    let names: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", srv.pid()))
        .expect("tasks")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .filter(|c| c.starts_with("ibid-nbd-"))
        .collect();
    assert_eq!(names, vec!["ibid-nbd-0".to_string()]);
    refuses_zero("--nbd-workers");
}

/// A pool with more segment files than the process may open at once: under a limit of 80
/// open files (soft and hard, so the server cannot raise it), 2.5 GiB of unique data fill ~80
/// segment files of 32 MiB, past the 40 the pool keeps open; every write succeeds and every
/// block reads back verified (before the bound, the writes failed with EIO once the files
/// took the last descriptors: "open segment: Too many open files").
#[test]
fn more_segment_files_than_the_open_files_limit() {
    require("fio");
    let srv = Server::start_with_open_files_limit(80, &["--volume", "f=3G", "--no-default-volume"]);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", srv.pid())).expect("limits");
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("open files line");
    assert_eq!(
        open_files.split_whitespace().nth(3),
        Some("80"),
        "{open_files}"
    );
    fio_write_verified(
        &srv,
        &[
            "--name=many-files",
            "--rw=write",
            "--bs=1M",
            "--iodepth=8",
            "--size=2560M",
            "--refill_buffers=1",
        ],
    );
    let segments = std::fs::read_dir(srv.pool_dir().join("segments"))
        .expect("segments")
        .count();
    assert!(segments > 70, "{segments} segment files");
}

/// `ibid serve FLAG 0` fails, naming the flag, before it creates the pool.
fn refuses_zero(flag: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let refused = output(
        env!("CARGO_BIN_EXE_ibid"),
        &[
            "serve",
            "--data",
            &dir.path().join("pool").display().to_string(),
            flag,
            "0",
        ],
    );
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains(flag), "{err}");
    assert!(!dir.path().join("pool").exists());
}

/// Threads of the server named `name`.
fn threads_named(srv: &Server, name: &str) -> usize {
    std::fs::read_dir(format!("/proc/{}/task", srv.pid()))
        .expect("tasks")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.trim() == name)
        .count()
}

/// `--io-threads N`: the async runtime has N threads (named `ibid-io`; with only NBD traffic
/// nothing else on the runtime spawns threads), requests are served; without the flag, a
/// quarter of the cores, at least one. Zero is refused before anything starts.
#[test]
fn io_threads_flag_sets_the_runtime_size() {
    require("fio");
    let args = ["--volume", "f=64M", "--no-default-volume"];
    let srv = Server::start(&[&args[..], &["--io-threads", "3"]].concat());
    fio_verify(&srv);
    assert_eq!(threads_named(&srv, "ibid-io"), 3);
    drop(srv);
    let srv = Server::start(&args);
    fio_verify(&srv);
    let cores = std::thread::available_parallelism().expect("cores").get();
    assert_eq!(threads_named(&srv, "ibid-io"), (cores / 4).max(1));
    drop(srv);
    refuses_zero("--io-threads");
}

/// Random 4 KiB writes at queue depth 16 over the export `f` (32 MiB of it) with fio's crc32c
/// verification.
fn fio_verify(srv: &Server) {
    let v = fio_write_verified(
        srv,
        &[
            "--name=verify",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=32M",
        ],
    );
    assert!(
        v["jobs"][0]["write"]["io_bytes"]
            .as_u64()
            .expect("io_bytes")
            >= 32 << 20
    );
}

/// Runs fio's nbd engine against volume `f` with the `job` options, verifying what it wrote
/// by crc32c (fatal on the first mismatch); asserts the job ended without error and returns
/// fio's JSON report.
fn fio_write_verified(srv: &Server, job: &[&str]) -> serde_json::Value {
    let port = srv.nbd.rsplit(':').next().expect("port");
    let work = tempfile::tempdir().expect("tempdir");
    let uri = format!("--uri=nbd://127.0.0.1:{port}/f");
    let directory = format!("--directory={}", work.path().display());
    let mut args = vec!["--ioengine=nbd", uri.as_str()];
    args.extend_from_slice(job);
    args.extend_from_slice(&[
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--verify_state_save=0",
        directory.as_str(),
        "--output-format=json",
    ]);
    let out = run("fio", &args);
    let json_start = out.find('{').expect("fio json");
    let v: serde_json::Value = serde_json::from_str(&out[json_start..]).expect("fio json");
    assert_eq!(v["jobs"][0]["error"], 0, "{out}");
    v
}

/// A real filesystem on the volume (nbdfuse + loop + ext4): files round-trip, and after
/// deleting them and running fstrim, the pool's logical and physical usage drop.
#[test]
fn ext4_on_nbdfuse_fstrim_returns_space_to_the_pool() {
    for tool in [
        "nbdfuse",
        "losetup",
        "mkfs.ext4",
        "mount",
        "umount",
        "fstrim",
        "fusermount3",
    ] {
        require(tool);
    }
    let srv = Server::start(&["--volume", "fs=256M", "--no-default-volume"]);
    let work = tempfile::tempdir().expect("tempdir");
    let fuse_dir = work.path().join("fuse");
    let mnt = work.path().join("mnt");
    std::fs::create_dir(&fuse_dir).expect("mkdir");
    std::fs::create_dir(&mnt).expect("mkdir");
    let mut stack = FsStack {
        fuse_dir: fuse_dir.clone(),
        mnt: mnt.clone(),
        loop_dev: None,
        fuse: None,
    };
    let device = fuse_dir.join("nbd");
    stack.fuse = Some(
        std::process::Command::new("nbdfuse")
            .arg(&device)
            .arg(srv.url("fs"))
            .spawn()
            .expect("nbdfuse"),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !device.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "nbdfuse did not mount"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let dev = run("losetup", &["-f", "--show", device.to_str().expect("utf8")])
        .trim()
        .to_string();
    stack.loop_dev = Some(dev.clone());
    run("mkfs.ext4", &["-q", "-F", "-E", "nodiscard", &dev]);
    run("mount", &[&dev, mnt.to_str().expect("utf8")]);
    let file = mnt.join("data.bin");
    let content: Vec<u8> = (0..(32u32 << 20))
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&file, &content).expect("write file");
    run("sync", &[]);
    run("sh", &["-c", "echo 3 > /proc/sys/vm/drop_caches"]);
    assert!(
        std::fs::read(&file).expect("read back") == content,
        "file content differs"
    );
    // Stop writing, measure, delete + fstrim, measure again (through the engine, offline).
    std::fs::remove_file(&file).expect("rm");
    run("sync", &[]);
    run("fstrim", &[mnt.to_str().expect("utf8")]);
    run("sync", &[]);
    drop(stack);
    let dir = srv.stop();
    let after = engine_stats(&dir.path().join("pool"));
    // ext4's own metadata stays; the 32 MiB file must be gone from the pool.
    assert!(
        after.logical_written_bytes < 16 << 20,
        "after fstrim the pool still maps {} bytes",
        after.logical_written_bytes
    );
}

struct FsStack {
    fuse_dir: std::path::PathBuf,
    mnt: std::path::PathBuf,
    loop_dev: Option<String>,
    fuse: Option<std::process::Child>,
}

impl Drop for FsStack {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.mnt).status();
        if let Some(dev) = self.loop_dev.take() {
            let _ = std::process::Command::new("losetup")
                .args(["-d", &dev])
                .status();
        }
        let _ = std::process::Command::new("fusermount3")
            .arg("-u")
            .arg(&self.fuse_dir)
            .status();
        if let Some(mut child) = self.fuse.take() {
            let _ = child.wait();
        }
    }
}

/// Snapshots are exported read-only as `VOLUME@SNAPSHOT`: listed, readable with the
/// snapshot's content after the volume changed, and writes are refused (EPERM).
#[test]
fn snapshots_are_read_only_exports() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let pool = Pool::create(
            dir.path().join("pool"),
            PoolConfig {
                background: false,
                ..PoolConfig::default()
            },
        )
        .expect("create");
        let v = pool.create_volume("vm", 8 << 20).expect("vm");
        v.write(0, &[0xa5; 1 << 20], false).expect("write");
        pool.create_snapshot("vm", "before").expect("snapshot");
        v.write(0, &[0x5a; 1 << 20], false).expect("overwrite");
        drop(v);
        pool.close().expect("close");
    }
    let srv = Server::start_in(dir, &["--no-default-volume"]);
    let list = run("nbdinfo", &["--list", &format!("nbd://{}", srv.nbd)]);
    assert!(list.contains("export=\"vm@before\""), "{list}");
    let snap = srv.url("vm@before");
    let info = run("nbdinfo", &[&snap]);
    assert!(info.contains("is_read_only: true"), "{info}");
    run(
        "qemu-io",
        &["-f", "raw", "-r", "-c", "read -P 0xa5 0 1M", &snap],
    );
    run(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x5a 0 1M", &srv.url("vm")],
    );
    let write = output("qemu-io", &["-f", "raw", "-c", "write -P 1 0 4k", &snap]);
    let text = String::from_utf8_lossy(&write.stdout).to_string()
        + &String::from_utf8_lossy(&write.stderr);
    assert!(
        !write.status.success()
            || text.contains("ermission")
            || text.contains("read-only")
            || text.contains("Read-only"),
        "{text}"
    );
    run(
        "qemu-io",
        &["-f", "raw", "-r", "-c", "read -P 0xa5 0 1M", &snap],
    );
}

/// `ibid serve --nbd-tls-psk FILE --nbd-tls-required`: a plain client is refused, nbdinfo with
/// the key file gets in (TLS-PSK, as qemu's `tls-creds-psk` and libnbd's `tls-psk-file` use).
#[test]
fn serve_with_tls_psk_required() {
    let work = tempfile::tempdir().expect("tempdir");
    let keys = work.path().join("keys.psk");
    std::fs::write(
        &keys,
        "admin:00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n",
    )
    .expect("write keys");
    let keys = keys.to_str().expect("utf8");
    let srv = Server::start(&[
        "--volume",
        "t=8M",
        "--no-default-volume",
        "--nbd-tls-psk",
        keys,
        "--nbd-tls-required",
    ]);
    let plain = output("nbdinfo", &[&srv.url("t")]);
    assert!(!plain.status.success(), "a plain client must be refused");
    let tls_url =
        srv.url("t").replacen("nbd://", "nbds://admin@", 1) + &format!("?tls-psk-file={keys}");
    let info = run("nbdinfo", &[&tls_url]);
    assert!(info.contains("export-size: 8388608"), "{info}");
}
