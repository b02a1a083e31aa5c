//! End to end over iSCSI: `ibid serve` on a real pool, driven by libiscsi's conformance suite
//! (the VAAI suites and the I/O basics, the reservation suites across a restart, the ReadOnly
//! suite on an exported snapshot), qemu-img through `iscsi://`, and a libiscsi program issuing
//! EXTENDED COPY — whose copies must add no space to the pool — and persistent reservations
//! with APTPL. The full suite runs against the target with in-memory LUNs in `ibid-iscsi`'s own
//! tests; here it proves the engine and the server's LUN table behind the target.

mod common;

use common::{api_call, make_image, require, run, Server, IQN};
use std::process::Command;

/// Suites run against the engine: the VAAI primitives and the basic I/O paths.
const SUITES: &[&str] = &[
    "SCSI.CompareAndWrite",
    "SCSI.ExtendedCopy",
    "SCSI.ReceiveCopyResults",
    "SCSI.WriteSame10",
    "SCSI.WriteSame16",
    "SCSI.Unmap",
    "SCSI.GetLBAStatus",
    "SCSI.Read16",
    "SCSI.Write16",
    "SCSI.ReadCapacity16",
    "SCSI.Inquiry",
];
/// Tests that fail because the test is wrong for a 512e LUN (see docs/ISCSI.md).
const KNOWN_TEST_DEFECTS: &[&str] = &["UnmapSingle"];

/// The reservation suites (libiscsi's Prin*/Prout*), run with two initiator names.
const RESERVATION_SUITES: &[&str] = &[
    "SCSI.PrinReadKeys",
    "SCSI.PrinServiceactionRange",
    "SCSI.PrinReportCapabilities",
    "SCSI.ProutRegister",
    "SCSI.ProutReserve",
    "SCSI.ProutClear",
    "SCSI.ProutPreempt",
];

#[test]
fn libiscsi_vaai_suites_pass_on_the_engine() {
    require("iscsi-test-cu");
    require("timeout");
    let srv = Server::start(&[
        "--volume",
        "lun0=64M",
        "--volume",
        "lun1=64M",
        "--no-default-volume",
    ]);
    let failures = run_suites(&srv.iscsi_url(0), SUITES);
    assert!(
        failures.is_empty(),
        "iscsi-test-cu failures on the engine: {failures:#?}"
    );
}

/// Runs each of `suites` (one process each, under `timeout`) against `url` with two initiator
/// names; returns the failures (known test defects aside). Every suite must run a test, and
/// none may run only skipped tests.
fn run_suites(url: &str, suites: &[&str]) -> Vec<String> {
    let mut failures = Vec::new();
    for suite in suites {
        let out = Command::new("timeout")
            .args(["180", "iscsi-test-cu", "-d", "-v", "-t", suite])
            .args([
                "-i",
                "iqn.2026-11.org.ibid:test-a",
                "-I",
                "iqn.2026-11.org.ibid:test-b",
            ])
            .arg(url)
            .output()
            .expect("run iscsi-test-cu");
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        let failed: Vec<&str> = text
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("Test: "))
            .filter(|l| l.contains("FAILED"))
            .map(|l| l.split(" ...").next().unwrap_or(l).trim())
            .filter(|name| !KNOWN_TEST_DEFECTS.iter().any(|d| name.contains(d)))
            .collect();
        let ran = text
            .lines()
            .filter(|l| l.trim_start().starts_with("Test: "))
            .count();
        let skipped = text.lines().filter(|l| l.contains("[SKIPPED]")).count();
        eprintln!(
            "{suite}: {ran} tests, {} failed, {skipped} skip lines",
            failed.len()
        );
        assert!(
            ran > 0 || text.contains("Test:"),
            "{suite} ran no test:\n{text}"
        );
        let passed_asserts = text
            .lines()
            .find(|l| l.trim_start().starts_with("asserts"))
            .and_then(|l| l.split_whitespace().nth(3))
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
        assert!(
            passed_asserts > 0,
            "{suite} checked nothing (all skipped?):\n{text}"
        );
        if !failed.is_empty() || out.status.code() == Some(124) {
            failures.push(format!(
                "{suite}: {failed:?} (exit {:?})",
                out.status.code()
            ));
        }
    }
    failures
}

/// Builds the libiscsi test program `ibid_initiator.c`; returns its path.
fn initiator_program() -> std::path::PathBuf {
    require("cc");
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../ibid-iscsi/tests/c/ibid_initiator.c");
    let bin = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("ibid_initiator_e2e");
    static BUILT: std::sync::Once = std::sync::Once::new();
    BUILT.call_once(|| {
        let tmp = bin.with_extension("tmp");
        let st = Command::new("cc")
            .args(["-O1", "-o"])
            .arg(&tmp)
            .arg(&src)
            .arg("-liscsi")
            .status()
            .expect("cc");
        assert!(
            st.success(),
            "building {src:?} failed: is libiscsi-dev installed?"
        );
        std::fs::rename(&tmp, &bin).expect("install the test program");
    });
    bin
}

/// Runs `ibid_initiator MODE PORTAL IQN ARGS...`, which must succeed.
fn initiator(srv: &Server, mode: &str, args: &[&str]) {
    let out = Command::new(initiator_program())
        .args([mode, srv.iscsi.as_deref().expect("iscsi"), IQN])
        .args(args)
        .output()
        .expect("run ibid_initiator");
    assert!(
        out.status.success(),
        "ibid_initiator {mode} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The LUN numbers `iscsi-ls` lists, in its order (REPORT LUNS).
fn listed_luns(srv: &Server) -> Vec<u64> {
    let out = run(
        "iscsi-ls",
        &[
            "-s",
            &format!("iscsi://{}", srv.iscsi.as_deref().expect("iscsi")),
        ],
    );
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("Lun:"))
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect()
}

/// LUNs are configuration: a volume created with a LUN gets it, others the lowest free one;
/// REPORT LUNS lists them in order; a volume can be moved, and a session using another LUN
/// gets REPORTED LUNS DATA HAS CHANGED; a pool from before the LUN table keeps its old
/// numbers (id − 1); everything survives a restart.
#[test]
fn lun_numbers_are_configuration_and_survive_restarts() {
    require("iscsi-ls");
    let srv = Server::start(&[
        "--volume",
        "a=16M",
        "--volume",
        "b=16M",
        "--volume",
        "c=16M",
        "--no-default-volume",
    ]);
    // A pool that had no table: today's numbers (volume id - 1) are kept.
    assert_eq!(listed_luns(&srv), [0, 1, 2]);
    let (status, v) = api_call(&srv, "DELETE", "/api/v1/volumes/b", None);
    assert_eq!(status, 204, "{v}");
    let (status, v) = api_call(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name": "d", "size": "16M", "lun": 9}"#),
    );
    assert_eq!((status, v["lun"].as_u64()), (201, Some(9)), "{v}");
    let (status, v) = api_call(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name": "e", "size": "16M"}"#),
    );
    assert_eq!(
        (status, v["lun"].as_u64()),
        (201, Some(1)),
        "lowest free: {v}"
    );
    let (status, v) = api_call(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name": "f", "size": "16M", "lun": 9}"#),
    );
    assert_eq!(
        (status, v["code"].as_str()),
        (409, Some("lun_in_use")),
        "{v}"
    );
    let (status, _) = api_call(&srv, "GET", "/api/v1/volumes/f", None);
    assert_eq!(status, 404, "a refused create leaves no volume behind");
    let (status, v) = api_call(&srv, "PATCH", "/api/v1/volumes/a", Some(r#"{"lun": 4}"#));
    assert_eq!((status, v["lun"].as_u64()), (200, Some(4)), "{v}");
    assert_eq!(listed_luns(&srv), [1, 2, 4, 9]);
    // The LUN reaches the volume it names: write through LUN 4, read it through NBD as "a".
    run(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x4a 0 64k", &srv.iscsi_url(4)],
    );
    run(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x4a 0 64k", &srv.url("a")],
    );
    // A session using LUN 1 is told when another volume moves: REPORTED LUNS DATA HAS
    // CHANGED at its next command.
    let mut waiter = Command::new(initiator_program())
        .args(["ua-wait", srv.iscsi.as_deref().expect("iscsi"), IQN, "1"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run ibid_initiator ua-wait");
    let mut ready = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(waiter.stdout.as_mut().expect("stdout")),
        &mut ready,
    )
    .expect("read");
    assert_eq!(ready.trim(), "ready");
    let (status, v) = api_call(&srv, "PATCH", "/api/v1/volumes/d", Some(r#"{"lun": 12}"#));
    assert_eq!((status, v["lun"].as_u64()), (200, Some(12)), "{v}");
    std::io::Write::write_all(waiter.stdin.as_mut().expect("stdin"), b"go\n").expect("write");
    let out = waiter.wait_with_output().expect("ua-wait");
    assert!(
        out.status.success(),
        "no REPORTED LUNS DATA HAS CHANGED after a move: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = srv.stop();
    let srv = Server::start_in(dir, &["--no-default-volume"]);
    assert_eq!(listed_luns(&srv), [1, 2, 4, 12]);
    let (_, v) = api_call(&srv, "GET", "/api/v1/volumes/e", None);
    assert_eq!(v["lun"].as_u64(), Some(1), "{v}");
}

/// A snapshot exported as a LUN is read-only: it reads the data of the moment it was taken,
/// writes fail (DATA PROTECT), and libiscsi's ReadOnly suite passes on it; unexporting it is
/// refused while a session uses it, unless forced; unexported, the LUN is gone.
#[test]
fn snapshot_exported_read_only() {
    require("iscsi-test-cu");
    let srv = Server::start(&["--volume", "vm=16M", "--no-default-volume"]);
    run(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x11 0 1M", &srv.iscsi_url(0)],
    );
    let (status, v) = api_call(
        &srv,
        "POST",
        "/api/v1/volumes/vm/snapshots",
        Some(r#"{"name": "golden"}"#),
    );
    assert_eq!((status, &v["lun"]), (201, &serde_json::Value::Null), "{v}");
    let (status, v) = api_call(
        &srv,
        "POST",
        "/api/v1/volumes/vm/snapshots/golden/export",
        Some(r#"{"lun": 7}"#),
    );
    assert_eq!((status, v["lun"].as_u64()), (200, Some(7)), "{v}");
    // Exported at creation: at the LUN asked for; a taken LUN leaves no snapshot behind.
    let (status, v) = api_call(
        &srv,
        "POST",
        "/api/v1/volumes/vm/snapshots",
        Some(r#"{"name": "taken", "lun": 7}"#),
    );
    assert_eq!(
        (status, v["code"].as_str()),
        (409, Some("lun_in_use")),
        "{v}"
    );
    let (status, v) = api_call(
        &srv,
        "POST",
        "/api/v1/volumes/vm/snapshots",
        Some(r#"{"name": "second", "export": true}"#),
    );
    assert_eq!((status, v["lun"].as_u64()), (201, Some(1)), "{v}");
    let (_, list) = api_call(&srv, "GET", "/api/v1/volumes/vm/snapshots", None);
    let names: Vec<&str> = list
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert!(!names.contains(&"taken"), "{list}");
    let (status, _) = api_call(&srv, "DELETE", "/api/v1/volumes/vm/snapshots/second", None);
    assert_eq!(status, 204);
    run(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x22 0 1M", &srv.iscsi_url(0)],
    );
    run(
        "qemu-io",
        &[
            "-r",
            "-f",
            "raw",
            "-c",
            "read -P 0x11 0 1M",
            &srv.iscsi_url(7),
        ],
    );
    // qemu reads the write-protect bit of MODE SENSE and refuses to open the LUN for writing;
    // the ReadOnly suite checks that every write command gets DATA PROTECT.
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x33 0 4k", &srv.iscsi_url(7)])
        .output()
        .expect("qemu-io");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && text.contains("write protected"),
        "a read-write open of the snapshot LUN: {text}"
    );
    let failures = run_suites(&srv.iscsi_url(7), &["SCSI.ReadOnly"]);
    assert!(failures.is_empty(), "{failures:#?}");
    run(
        "qemu-io",
        &[
            "-r",
            "-f",
            "raw",
            "-c",
            "read -P 0x11 0 1M",
            &srv.iscsi_url(7),
        ],
    );
    // While a session uses the snapshot's LUN, unexporting it is refused unless forced.
    let mut held = Command::new("qemu-io")
        .args(["-r", "-f", "raw", &srv.iscsi_url(7)])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("qemu-io");
    let mut in_use = false;
    for _ in 0..100 {
        let (_, v) = api_call(&srv, "GET", "/api/v1/volumes/vm", None);
        if v["clients"].as_array().is_some_and(|c| !c.is_empty()) {
            assert_eq!(v["clients"][0]["export"], "vm@golden", "{v}");
            in_use = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(in_use, "the qemu-io session was never listed");
    let path = "/api/v1/volumes/vm/snapshots/golden/export";
    let (status, v) = api_call(&srv, "DELETE", path, None);
    assert_eq!((status, v["code"].as_str()), (409, Some("in_use")), "{v}");
    let (status, v) = api_call(&srv, "DELETE", &format!("{path}?force=true"), None);
    assert_eq!(status, 204, "{v}");
    assert_eq!(listed_luns(&srv), [0]);
    let _ = held.kill();
    let _ = held.wait();
}

/// Persistent reservations: libiscsi's reservation suites pass with two initiators; a
/// registration and a Write Exclusive reservation made with APTPL survive a restart of the
/// target (another initiator still conflicts, then preempts); the suites pass again after it.
#[test]
fn persistent_reservations_survive_a_restart() {
    require("iscsi-test-cu");
    let srv = Server::start(&["--volume", "shared=16M", "--no-default-volume"]);
    let failures = run_suites(&srv.iscsi_url(0), RESERVATION_SUITES);
    assert!(failures.is_empty(), "before the restart: {failures:#?}");
    initiator(&srv, "pr-set", &["0"]);
    let dir = srv.stop();
    let saved = std::fs::read_to_string(dir.path().join("pool/reservations.json"))
        .expect("reservations.json");
    assert!(saved.contains("pr-a"), "{saved}");
    let srv = Server::start_in(dir, &["--no-default-volume"]);
    initiator(&srv, "pr-check", &["0"]);
    let failures = run_suites(&srv.iscsi_url(0), RESERVATION_SUITES);
    assert!(failures.is_empty(), "after the restart: {failures:#?}");
}

/// qemu-img writes an image through iSCSI; NBD reads the same bytes back.
#[test]
fn qemu_img_through_iscsi_and_the_same_data_through_nbd() {
    let srv = Server::start(&["--volume", "shared=16M", "--no-default-volume"]);
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
            &srv.iscsi_url(0),
        ],
    );
    run(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", img, &srv.iscsi_url(0)],
    );
    run(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", img, &srv.url("shared")],
    );
    let out = run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -z 0 1M",
            "-c",
            "discard 1M 1M",
            "-c",
            "read -P 0 0 2M",
            &srv.iscsi_url(0),
        ],
    );
    assert!(!out.contains("Pattern verification failed"), "{out}");
    run(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0 0 2M", &srv.url("shared")],
    );
}

/// Reads over iSCSI served from the read cache (blocks read twice; their Data-In sent from the
/// cache's memory) are the bytes written, before and after an overwrite through iSCSI; the
/// metrics count the hits.
#[test]
fn cached_reads_over_iscsi_are_the_data_written() {
    let srv = Server::start(&[
        "--volume",
        "c=32M",
        "--no-default-volume",
        "--read-cache",
        "64M",
    ]);
    let work = tempfile::tempdir().expect("tempdir");
    let image = work.path().join("in.raw");
    make_image(&image, 32 << 20);
    let img = image.to_str().expect("utf8");
    let lun = srv.iscsi_url(0);
    run(
        "qemu-img",
        &["convert", "-n", "-f", "raw", "-O", "raw", img, &lun],
    );
    let compare = || {
        run(
            "qemu-img",
            &["compare", "-f", "raw", "-F", "raw", img, &lun],
        )
    };
    for _ in 0..3 {
        compare();
    }
    let hits_after_reads = cache_hits(&srv);
    assert!(
        hits_after_reads >= 2048,
        "the third pass over 32 MiB hit the cache for {hits_after_reads} blocks"
    );
    // Overwrite 1 MiB at 4 MiB through iSCSI, and the image the same way; every later pass
    // (the second from the cache again) reads the new bytes.
    for target in [lun.as_str(), img] {
        run(
            "qemu-io",
            &["-f", "raw", "-c", "write -P 0x5a 4M 1M", target],
        );
    }
    for _ in 0..3 {
        compare();
    }
    let out = run("qemu-io", &["-f", "raw", "-c", "read -P 0x5a 4M 1M", &lun]);
    assert!(!out.contains("Pattern verification failed"), "{out}");
    assert!(cache_hits(&srv) > hits_after_reads);
}

/// `ibid_read_cache_hits_total` from `/metrics`.
fn cache_hits(srv: &Server) -> u64 {
    let url = format!("http://{}/metrics", srv.http.as_deref().expect("API"));
    let page = run("curl", &["-s", "-S", "-f", &url]);
    page.lines()
        .find_map(|l| l.strip_prefix("ibid_read_cache_hits_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("ibid_read_cache_hits_total on the metrics page")
}

/// Runs the initiator program's `xcopy` (LUN 0 to LUN 1 and within LUN 0, data verified)
/// against `srv`; fails the test, naming `what`, if it fails.
fn run_xcopy(bin: &std::path::Path, srv: &Server, what: &str) {
    let out = Command::new(bin)
        .args(["xcopy", srv.iscsi.as_deref().expect("iscsi"), IQN])
        .output()
        .expect("run xcopy");
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A server with two 64 MiB volumes, `a` and `b`, the LUNs the XCOPY program copies between.
fn server_with_a_and_b() -> Server {
    Server::start(&[
        "--volume",
        "a=64M",
        "--volume",
        "b=64M",
        "--no-default-volume",
    ])
}

/// EXTENDED COPY between two LUNs and within one, through a libiscsi program: data verified
/// by the program, and the pool holds no more distinct chunks than the source data.
#[test]
fn xcopy_through_libiscsi_adds_no_space() {
    let bin = initiator_program();
    let srv = server_with_a_and_b();
    run_xcopy(&bin, &srv, "xcopy");
    let dir = srv.stop();
    let pool = common::open_quiet(&dir.path().join("pool"));
    let s = pool.stats();
    // The program writes 1 MiB of source data once and copies it twice by XCOPY: three
    // logical copies, stored once. (Dedup alone would also store it once; that the copy reads
    // and writes nothing is proven by the engine's copy tests and its CopyReport.)
    assert_eq!(
        s.logical_written_bytes,
        3 << 20,
        "three logical copies of 1 MiB"
    );
    assert!(
        s.unique_chunks > 0 && s.unique_chunks <= 256,
        "unique chunks {}",
        s.unique_chunks
    );
    pool.verify().expect("verify");
    pool.close().expect("close");
}

/// EXTENDED COPY within and out of a volume that an NBD client keeps writing to (elsewhere on
/// it): every copy succeeds, its data verified, rather than being aborted because the volume
/// kept changing — NBD writes wait at the volume's copy gate as iSCSI writes do.
#[test]
fn xcopy_succeeds_while_nbd_writes_the_volume() {
    require("fio");
    let bin = initiator_program();
    let srv = server_with_a_and_b();
    // Random 4 KiB writes at QD8 over the upper half of `a` (the copies use its first 5 MiB).
    let mut fio = Command::new("fio")
        .args([
            "--name=busy",
            "--thread",
            "--ioengine=nbd",
            &format!("--uri={}", srv.url("a")),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=8",
            "--offset=32M",
            "--size=32M",
            "--time_based",
            "--runtime=30",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start fio");
    std::thread::sleep(std::time::Duration::from_secs(1));
    for round in 0..8 {
        run_xcopy(
            &bin,
            &srv,
            &format!("xcopy round {round} beside NBD writes"),
        );
    }
    assert!(
        fio.try_wait().expect("fio").is_none(),
        "fio stopped before the copies ended: the writes did not run beside them"
    );
    fio.kill().expect("stop fio");
    let _ = fio.wait();
}
