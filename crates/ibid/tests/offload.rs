//! Snapshots pushed to and restored from a real S3-compatible store: Ceph's RADOS Gateway,
//! started once for this test binary by scripts/ceph-rgw.sh (about 20 s) and stopped at the end,
//! driven through captive `ibid serve`s and the CLI; data written and compared over NBD with
//! real clients (nbdsh, qemu-img).
//!
//! To reuse a running gateway while developing: `scripts/ceph-rgw.sh start DIR`, then run the
//! tests with `IBID_TEST_RGW_ENV=DIR/env`.

mod common;

use common::{api_call, make_image, run, Server};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// How to reach the gateway (what scripts/ceph-rgw.sh prints).
struct Rgw {
    endpoint: String,
    key: String,
    secret: String,
    bucket: String,
    /// Prefix of this run's keys (a reused gateway keeps earlier runs' objects).
    run: String,
    /// The cluster's directory, when this test started it (stopped on drop).
    started: Option<tempfile::TempDir>,
}

impl Rgw {
    fn start() -> Rgw {
        if let Ok(env) = std::env::var("IBID_TEST_RGW_ENV") {
            return Rgw::parse(
                &std::fs::read_to_string(env).expect("read IBID_TEST_RGW_ENV"),
                None,
            );
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-rgw.sh");
        let t = Instant::now();
        let out = Command::new(&script)
            .arg("start")
            .arg(dir.path())
            .output()
            .expect("run scripts/ceph-rgw.sh");
        if !out.status.success() {
            // Stop whatever did start before failing.
            let _ = Command::new(&script).arg("stop").arg(dir.path()).output();
            panic!(
                "scripts/ceph-rgw.sh start failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let rgw = Rgw::parse(&String::from_utf8_lossy(&out.stdout), Some(dir));
        eprintln!(
            "RGW up in {:.1} s at {}",
            t.elapsed().as_secs_f64(),
            rgw.endpoint
        );
        rgw
    }

    fn parse(text: &str, started: Option<tempfile::TempDir>) -> Rgw {
        let get = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("export {k}=")))
                .unwrap_or_else(|| panic!("no {k} in {text}"))
                .to_string()
        };
        Rgw {
            endpoint: get("AWS_ENDPOINT_URL"),
            key: get("AWS_ACCESS_KEY_ID"),
            secret: get("AWS_SECRET_ACCESS_KEY"),
            bucket: get("IBID_TEST_BUCKET"),
            run: format!(
                "run-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .expect("clock")
                    .as_millis()
            ),
            started,
        }
    }

    /// Keys in the bucket under this run's `prefix` (a signed ListObjectsV2, with curl), without
    /// the run's prefix.
    fn keys(&self, prefix: &str) -> Vec<String> {
        let prefix = format!("{}/{prefix}", self.run);
        // The signature covers the query: '/' must be sent encoded.
        let url = format!(
            "{}/{}?list-type=2&prefix={}",
            self.endpoint,
            self.bucket,
            prefix.replace('/', "%2F")
        );
        let body = run(
            "curl",
            &[
                "-s",
                "-S",
                "--fail",
                "--aws-sigv4",
                "aws:amz:us-east-1:s3",
                "--user",
                &format!("{}:{}", self.key, self.secret),
                "-H",
                "x-amz-content-sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
                &url,
            ],
        );
        body.split("<Key>")
            .skip(1)
            .filter_map(|s| s.split_once("</Key>").map(|(k, _)| k.to_string()))
            .map(|k| {
                k.strip_prefix(&format!("{}/", self.run))
                    .unwrap_or(&k)
                    .to_string()
            })
            .collect()
    }
}

impl Drop for Rgw {
    fn drop(&mut self) {
        if let Some(dir) = &self.started {
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-rgw.sh");
            let _ = Command::new(script).arg("stop").arg(dir.path()).output();
        }
    }
}

/// Runs `ibid ARGS --server ...` against `srv` with the gateway's credentials in the
/// environment (as an admin's shell would have them).
fn ibid(srv: &Server, rgw: &Rgw, args: &[&str]) -> Output {
    let url = format!("http://{}", srv.http.as_deref().expect("API running"));
    let out = Command::new(env!("CARGO_BIN_EXE_ibid"))
        .args(args)
        .args(["--server", &url])
        .env_remove("IBID_SERVER")
        .env_remove("IBID_API_TOKEN")
        .env("AWS_ACCESS_KEY_ID", &rgw.key)
        .env("AWS_SECRET_ACCESS_KEY", &rgw.secret)
        .output()
        .expect("run ibid");
    eprintln!("ibid {} -> {}", args.join(" "), out.status);
    out
}

fn ok(srv: &Server, rgw: &Rgw, args: &[&str]) -> String {
    let out = ibid(srv, rgw, args);
    assert_eq!(
        out.status.code(),
        Some(0),
        "ibid {args:?}: stdout {} stderr {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn json(srv: &Server, rgw: &Rgw, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = ok(srv, rgw, &all);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("ibid {args:?}: {e}: {out}"))
}

/// As [`json`], with the progress events `--json` writes to standard error (one JSON object
/// per line).
fn json_with_events(srv: &Server, rgw: &Rgw, args: &[&str]) -> (Value, Vec<Value>) {
    let mut all = args.to_vec();
    all.push("--json");
    let out = ibid(srv, rgw, &all);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "ibid {args:?}: stdout {stdout} stderr {stderr}"
    );
    let result =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("ibid {args:?}: {e}: {stdout}"));
    let events = stderr
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("event {l}: {e}")))
        .collect();
    (result, events)
}

/// Adds the gateway as remote `name` (keys under the run's `prefix`) to `srv`.
fn add_remote(srv: &Server, rgw: &Rgw, name: &str, prefix: &str) {
    let prefix = &format!("{}/{prefix}", rgw.run);
    ok(
        srv,
        rgw,
        &[
            "remote",
            "add",
            name,
            "--endpoint",
            &rgw.endpoint,
            "--bucket",
            &rgw.bucket,
            "--prefix",
            prefix,
        ],
    );
}

/// Writes `len` random bytes at `offset` of `url` with nbdsh.
fn write_random(url: &str, offset: u64, len: u64) {
    run(
        "nbdsh",
        &[
            "-u",
            url,
            "-c",
            &format!("import os; h.pwrite(os.urandom({len}), {offset}); h.flush()"),
        ],
    );
}

/// Fills volume `name` of `srv` (created `size` bytes) with make_image's mixed data.
fn fill(srv: &Server, rgw: &Rgw, name: &str, size: u64) {
    ok(
        srv,
        rgw,
        &[
            "volume",
            "create",
            name,
            "--size",
            &format!("{}M", size / MIB),
        ],
    );
    let img = srv.dir.path().join(format!("{name}.img"));
    make_image(&img, size as usize);
    run(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            img.to_str().expect("path"),
            &srv.url(name),
        ],
    );
}

/// `qemu-img compare` of two NBD exports: equal content.
fn assert_same(a: &str, b: &str) {
    run("qemu-img", &["compare", "-f", "raw", "-F", "raw", a, b]);
}

/// The whole offload path on one gateway, in stages that each start from a fresh prefix:
/// one RGW per test binary (its start is most of the cost).
#[test]
fn snapshots_go_to_ceph_rgw_and_come_back() {
    let rgw = Rgw::start();
    let t = Instant::now();
    remotes_keep_their_credentials_to_themselves(&rgw);
    eprintln!("[{:.1} s] credentials", t.elapsed().as_secs_f64());
    push_incremental_and_restore_on_another_server(&rgw);
    eprintln!("[{:.1} s] push/restore", t.elapsed().as_secs_f64());
    a_push_killed_midway_completes_when_run_again(&rgw);
    eprintln!("[{:.1} s] kill -9", t.elapsed().as_secs_f64());
    deleted_snapshots_are_collected_and_the_rest_verifies(&rgw);
    eprintln!("[{:.1} s] gc/verify", t.elapsed().as_secs_f64());
    pushes_are_jobs_with_progress_and_can_be_cancelled(&rgw);
    eprintln!("[{:.1} s] jobs", t.elapsed().as_secs_f64());
    schedules_snapshot_push_and_keep_the_newest(&rgw);
    eprintln!("[{:.1} s] schedules", t.elapsed().as_secs_f64());
    a_failed_scheduled_push_is_tried_again(&rgw);
    eprintln!("[{:.1} s] schedule retry", t.elapsed().as_secs_f64());
    instant_restores_serve_at_once_and_survive_kill_9(&rgw);
    eprintln!("[{:.1} s] instant restore", t.elapsed().as_secs_f64());
}

/// `remote add` takes the keys from the environment; no answer of the API shows the secret;
/// the file that keeps it is the owner's only; a remote with a wrong secret is refused at
/// `add`, and an unknown remote is exit 3.
fn remotes_keep_their_credentials_to_themselves(rgw: &Rgw) {
    let srv = Server::start(&["--no-default-volume"]);
    add_remote(&srv, rgw, "rgw", "creds");
    let list = json(&srv, rgw, &["remote", "list"]);
    assert_eq!(list[0]["name"], "rgw");
    assert_eq!(list[0]["bucket"], rgw.bucket.as_str());
    let text = list.to_string();
    assert!(
        !text.contains(&rgw.secret) && !text.contains(&rgw.key),
        "{text}"
    );
    let file = srv.pool_dir().join("remotes.json");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&file)
        .expect("remotes.json")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    // A wrong secret: refused now, not at the first push.
    let out = Command::new(env!("CARGO_BIN_EXE_ibid"))
        .args([
            "remote",
            "add",
            "bad",
            "--endpoint",
            &rgw.endpoint,
            "--bucket",
            &rgw.bucket,
        ])
        .args([
            "--server",
            &format!("http://{}", srv.http.as_deref().expect("API")),
        ])
        .env("AWS_ACCESS_KEY_ID", &rgw.key)
        .env("AWS_SECRET_ACCESS_KEY", "wrong-secret")
        .output()
        .expect("run ibid");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("remote_failed") && !stderr.contains("wrong-secret"),
        "{stderr}"
    );
    let out = ibid(&srv, rgw, &["snapshot", "list", "--remote", "nope"]);
    assert_eq!(out.status.code(), Some(3));
    ok(&srv, rgw, &["remote", "remove", "rgw"]);
    assert_eq!(json(&srv, rgw, &["remote", "list"]), serde_json::json!([]));
    // Kept across a restart.
    add_remote(&srv, rgw, "rgw", "creds");
    let dir = srv.stop();
    let srv = Server::start_in(dir, &["--no-default-volume"]);
    assert_eq!(json(&srv, rgw, &["remote", "list"])[0]["name"], "rgw");
}

/// A full push, then an incremental one after 1 % of the volume changed (at most 1.2 % of
/// the volume sent); a second server with its own pool restores both snapshots from the
/// bucket, equal to the source's (qemu-img compare over NBD).
fn push_incremental_and_restore_on_another_server(rgw: &Rgw) {
    let size = 256 * MIB;
    let a = Server::start(&["--no-default-volume"]);
    add_remote(&a, rgw, "rgw", "incr");
    fill(&a, rgw, "vm", size);
    ok(&a, rgw, &["snapshot", "create", "vm@one"]);
    let (full, events) =
        json_with_events(&a, rgw, &["snapshot", "push", "vm@one", "--remote", "rgw"]);
    eprintln!("full push: {full}");
    // `--json` follows the job with progress events on standard error: bytes done never go
    // back, and the last event says it succeeded, with everything done.
    let last = events.last().expect("progress events on stderr");
    assert_eq!(last["event"], "succeeded", "{events:?}");
    assert_eq!(last["kind"], "push", "{last}");
    assert!(
        last["bytes_total"].as_u64().expect("bytes_total") > 0,
        "{last}"
    );
    assert_eq!(last["bytes_done"], last["bytes_total"], "{last}");
    let done: Vec<u64> = events
        .iter()
        .map(|e| e["bytes_done"].as_u64().expect("bytes_done"))
        .collect();
    assert!(done.windows(2).all(|w| w[0] <= w[1]), "{done:?}");
    assert!(
        events[..events.len() - 1]
            .iter()
            .all(|e| e["event"] == "progress"),
        "{events:?}"
    );
    assert!(full["chunks_sent"].as_u64().expect("chunks_sent") > 0);
    assert!(full["bytes_sent"].as_u64().expect("bytes_sent") > 0);
    assert!(full["duration_s"].as_f64().is_some());
    // Pushing it again is refused: the remote has it.
    let again = ibid(&a, rgw, &["snapshot", "push", "vm@one", "--remote", "rgw"]);
    assert_eq!(again.status.code(), Some(4));
    // 1 % of the volume changes: 2 MiB and 0.56 MiB of random data, 4 KiB-aligned.
    write_random(&a.url("vm"), 37 * MIB + 5 * 4096, 2 * MIB);
    write_random(&a.url("vm"), 201 * MIB + 77 * 4096, 573 * 1024);
    ok(&a, rgw, &["snapshot", "create", "vm@two"]);
    let incr = json(&a, rgw, &["snapshot", "push", "vm@two", "--remote", "rgw"]);
    eprintln!("incremental push: {incr}");
    let sent = incr["bytes_sent"].as_u64().expect("bytes_sent");
    assert!(
        sent <= size * 12 / 1000,
        "sent {sent} bytes for a 1 % change: {incr}"
    );
    assert!(
        sent >= 2 * MIB,
        "sent {sent}: the change itself is 2.56 MiB of random data"
    );
    assert!(incr["chunks_skipped"].as_u64().expect("skipped") > 1000);
    let listed = json(&a, rgw, &["snapshot", "list", "--remote", "rgw"]);
    let names: Vec<_> = listed
        .as_array()
        .expect("list")
        .iter()
        .map(|s| s["name"].clone())
        .collect();
    assert_eq!(names, ["one", "two"]);

    let b = Server::start(&["--no-default-volume"]);
    add_remote(&b, rgw, "rgw", "incr");
    for snap in ["one", "two"] {
        let restored = format!("r-{snap}");
        let r = json(
            &b,
            rgw,
            &[
                "volume",
                "restore",
                &restored,
                "--remote",
                "rgw",
                "--snapshot",
                &format!("vm@{snap}"),
            ],
        );
        eprintln!("restore: {r}");
        assert_eq!(r["size_bytes"].as_u64(), Some(size));
        assert_same(&a.url(&format!("vm@{snap}")), &b.url(&restored));
    }
    // The two restored volumes share their unchanged data in the second pool (dedup).
    let pool = json(&b, rgw, &["pool", "stats"]);
    eprintln!("second pool: {pool}");
    let out = ibid(
        &b,
        rgw,
        &[
            "volume",
            "restore",
            "r-one",
            "--remote",
            "rgw",
            "--snapshot",
            "vm@one",
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(4),
        "restoring over an existing volume"
    );
}

/// kill -9 of the server while a push uploads leaves packs but no snapshot in the bucket; after
/// the restart the push runs again by itself (its job is listed as interrupted) and completes
/// without sending those packs again, and the remote verifies clean. kill -9 during a restore,
/// after its first checkpoint: the half-restored volume is kept at the restart and the restore
/// runs again by itself, going on from the checkpoint; the volume equals the source (qemu-img
/// compare).
fn a_push_killed_midway_completes_when_run_again(rgw: &Rgw) {
    let size = 384 * MIB;
    let srv = Server::start(&["--no-default-volume"]);
    add_remote(&srv, rgw, "rgw", "kill");
    fill(&srv, rgw, "big", size);
    ok(&srv, rgw, &["snapshot", "create", "big@s"]);
    let url = format!("http://{}", srv.http.as_deref().expect("API"));
    let mut push = Command::new(env!("CARGO_BIN_EXE_ibid"))
        .args([
            "snapshot", "push", "big@s", "--remote", "rgw", "--server", &url,
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start push");
    // Killed once 4 packs (of about 19) are in the bucket.
    let deadline = Instant::now() + Duration::from_secs(60);
    while rgw.keys("kill/packs/").len() < 4 {
        assert!(
            Instant::now() < deadline,
            "4 packs not uploaded within 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let dir = srv.kill();
    let _ = push.wait();
    let keys = rgw.keys("kill/");
    assert!(
        !keys.iter().any(|k| k.starts_with("kill/snapshots/")),
        "the push finished before the kill; the test needs a bigger volume: {keys:?}"
    );
    let packs_left = rgw.keys("kill/packs/").len() as u64;
    let srv = Server::start_in(dir, &["--no-default-volume"]);
    // The job the kill cut off is listed as interrupted, and runs again by itself.
    let (cut, again) = jobs_after_restart(&srv, rgw);
    assert_eq!(
        (cut["kind"].as_str(), again["kind"].as_str()),
        (Some("push"), Some("push"))
    );
    assert_eq!(again["state"], "succeeded", "{again}");
    let report = again["result"].clone();
    eprintln!("resumed push ({packs_left} packs were left): {report}");
    // The packs already there are not sent again (a pack holds at most 8 MiB + one chunk).
    let packs_now = rgw.keys("kill/packs/").len() as u64;
    let sent = report["pack_bytes_sent"].as_u64().expect("pack_bytes_sent");
    assert!(
        sent <= (packs_now - packs_left) * (8 * MIB + 65536),
        "{packs_now} packs now: {report}"
    );
    assert!(
        report["chunks_skipped"].as_u64().expect("skipped") > 0,
        "{report}"
    );
    // A restore killed midway, after its first checkpoint: its volume stays, the restart
    // runs the restore again, which goes on from the checkpoint (receives less than the
    // whole snapshot) and ends equal.
    let restore_args = [
        "volume",
        "restore",
        "big",
        "--remote",
        "rgw",
        "--snapshot",
        "big@s",
    ];
    let b = Server::start(&["--no-default-volume"]);
    add_remote(&b, rgw, "rgw", "kill");
    let url = format!("http://{}", b.http.as_deref().expect("API"));
    let mut restore = Command::new(env!("CARGO_BIN_EXE_ibid"))
        .args(restore_args)
        .args(["--server", &url])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start restore");
    let remotes_json = b.dir.path().join("pool").join("remotes.json");
    let checkpointed = || {
        let table: Value = std::fs::read(&remotes_json)
            .ok()
            .and_then(|t| serde_json::from_slice(&t).ok())
            .unwrap_or(Value::Null);
        table["restore_progress"]["big"]["done_packs"]
            .as_array()
            .is_some_and(|p| !p.is_empty())
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !checkpointed() {
        assert!(
            Instant::now() < deadline,
            "the restore made no checkpoint within 60 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let dir = b.kill();
    let finished = restore.wait().map(|s| s.success()).unwrap_or(false);
    assert!(!finished, "the restore finished before the kill");
    let b = Server::start_in(dir, &["--no-default-volume"]);
    let (cut, again) = jobs_after_restart(&b, rgw);
    assert_eq!(
        (cut["kind"].as_str(), again["kind"].as_str()),
        (Some("restore"), Some("restore"))
    );
    assert_eq!(again["state"], "succeeded", "{again}");
    let received = again["result"]["bytes_received"]
        .as_u64()
        .expect("received");
    assert!(
        received < size * 9 / 10,
        "the restore went on from its checkpoint, yet received {received} of {size} bytes"
    );
    let out = ibid(&b, rgw, &restore_args);
    assert_eq!(
        out.status.code(),
        Some(4),
        "restored again over the resumed restore"
    );
    assert_same(&srv.url("big@s"), &b.url("big"));
    let v = json(&b, rgw, &["remote", "verify", "rgw"]);
    assert_eq!(v["ok"], true, "{v}");
}

/// A deleted remote snapshot's packs are freed by `remote gc`; the snapshot left verifies and
/// restores; a damaged pack makes `remote verify` exit 8.
fn deleted_snapshots_are_collected_and_the_rest_verifies(rgw: &Rgw) {
    let srv = Server::start(&["--no-default-volume"]);
    add_remote(&srv, rgw, "rgw", "gc");
    ok(&srv, rgw, &["volume", "create", "v", "--size", "64M"]);
    write_random(&srv.url("v"), 0, 32 * MIB);
    ok(&srv, rgw, &["snapshot", "create", "v@old"]);
    write_random(&srv.url("v"), 0, 32 * MIB);
    ok(&srv, rgw, &["snapshot", "create", "v@new"]);
    for s in ["v@old", "v@new"] {
        json(&srv, rgw, &["snapshot", "push", s, "--remote", "rgw"]);
    }
    let packs_before = rgw.keys("gc/packs/").len();
    ok(
        &srv,
        rgw,
        &["snapshot", "delete", "v@old", "--remote", "rgw"],
    );
    assert_eq!(
        ibid(
            &srv,
            rgw,
            &["snapshot", "delete", "v@old", "--remote", "rgw"]
        )
        .status
        .code(),
        Some(3)
    );
    let gc = json(&srv, rgw, &["remote", "gc", "rgw"]);
    eprintln!("gc: {gc}");
    assert!(gc["packs_deleted"].as_u64().expect("deleted") >= 3, "{gc}");
    assert!(
        gc["bytes_freed"].as_u64().expect("freed") >= 30 * MIB,
        "{gc}"
    );
    assert_eq!(
        rgw.keys("gc/packs/").len(),
        packs_before - gc["packs_deleted"].as_u64().expect("deleted") as usize
    );
    verified_and_restored(&srv, rgw, "v@new", "back");

    // Repacking: "newer" keeps 30..32 MiB of "new", a quarter of the last pack its push
    // filled; once "new" is deleted, GC moves that quarter into a new pack and rewrites
    // newer's manifest, and the old pack goes.
    write_random(&srv.url("v"), 0, 30 * MIB);
    ok(&srv, rgw, &["snapshot", "create", "v@newer"]);
    json(
        &srv,
        rgw,
        &["snapshot", "push", "v@newer", "--remote", "rgw"],
    );
    ok(
        &srv,
        rgw,
        &["snapshot", "delete", "v@new", "--remote", "rgw"],
    );
    let gc = ibid(&srv, rgw, &["remote", "gc", "rgw"]);
    let said = String::from_utf8_lossy(&gc.stdout);
    assert!(gc.status.success(), "{said}");
    assert!(
        said.contains("repacked 1 packs mostly garbage: 32 chunks moved")
            && said.contains("1 manifests rewritten"),
        "{said}"
    );
    verified_and_restored(&srv, rgw, "v@newer", "back2");
}

/// `remote verify` finds nothing wrong or unreferenced, and `snapshot` restores as volume
/// `new` equal to it.
fn verified_and_restored(srv: &Server, rgw: &Rgw, snapshot: &str, new: &str) {
    let v = json(srv, rgw, &["remote", "verify", "rgw"]);
    assert_eq!(
        (v["ok"].clone(), v["unreferenced_packs"].clone()),
        (true.into(), 0.into()),
        "{v}"
    );
    json(
        srv,
        rgw,
        &[
            "volume",
            "restore",
            new,
            "--remote",
            "rgw",
            "--snapshot",
            snapshot,
        ],
    );
    assert_same(&srv.url(snapshot), &srv.url(new));
}

/// A push started in the background is a job: listed with its progress, cancelled on request
/// (nothing appears in the remote), and a push run to its end reports all its bytes done.
fn pushes_are_jobs_with_progress_and_can_be_cancelled(rgw: &Rgw) {
    let srv = Server::start(&["--no-default-volume"]);
    add_remote(&srv, rgw, "rgw", "jobs");
    fill(&srv, rgw, "vm", 256 * MIB);
    ok(&srv, rgw, &["snapshot", "create", "vm@s"]);
    let body = r#"{"remote":"rgw","background":true}"#;
    let (status, job) = api_call(
        &srv,
        "POST",
        "/api/v1/volumes/vm/snapshots/s/push",
        Some(body),
    );
    assert_eq!(status, 202, "{job}");
    assert_eq!(job["state"], "running", "{job}");
    let id = job["id"].as_u64().expect("id");
    let (status, cancelled) = api_call(
        &srv,
        "POST",
        &format!("/api/v1/jobs/{id}/cancel"),
        Some("{}"),
    );
    assert_eq!(status, 200, "the push ended before the cancel: {cancelled}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let job = loop {
        let (_, job) = api_call(&srv, "GET", &format!("/api/v1/jobs/{id}"), None);
        if job["state"] != "running" {
            break job;
        }
        assert!(
            Instant::now() < deadline,
            "the cancelled job still runs: {job}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(job["state"], "cancelled", "{job}");
    assert_eq!(
        json(&srv, rgw, &["snapshot", "list", "--remote", "rgw"]),
        serde_json::json!([])
    );
    // To its end, through the CLI (which follows the job).
    let report = json(&srv, rgw, &["snapshot", "push", "vm@s", "--remote", "rgw"]);
    assert!(report["bytes_sent"].as_u64().expect("bytes_sent") > 0);
    let jobs = json(&srv, rgw, &["job", "list"]);
    let done = &jobs.as_array().expect("jobs")[1];
    assert_eq!(done["state"], "succeeded", "{jobs}");
    assert_eq!(done["bytes_done"], done["bytes_total"], "{jobs}");
    assert_eq!(done["result"]["snapshot"], "vm@s", "{jobs}");
    // The metrics count the push and the failed (cancelled) one.
    let metrics = run(
        "curl",
        &[
            "-s",
            "-S",
            &format!("http://{}/metrics", srv.http.as_deref().expect("API")),
        ],
    );
    for line in [
        "ibid_remote_pushes_total 1\n",
        "ibid_remote_push_failures_total 1\n",
        "ibid_remote_last_push_seconds{volume=\"vm\"} ",
    ] {
        assert!(metrics.contains(line), "no {line:?} in the metrics");
    }
    let (status, v) = api_call(
        &srv,
        "POST",
        &format!("/api/v1/jobs/{id}/cancel"),
        Some("{}"),
    );
    assert_eq!((status, v["code"].as_str()), (409, Some("finished")));
}

/// A schedule every 2 s keeping 2 snapshots here and 1 in the remote: after 4 runs the pool
/// holds the 2 newest `auto-` snapshots (a snapshot made by hand is never deleted), the remote
/// the newest one, and the schedule is listed with its runs.
fn schedules_snapshot_push_and_keep_the_newest(rgw: &Rgw) {
    let srv = Server::start(&["--no-default-volume"]);
    add_remote(&srv, rgw, "rgw", "sched");
    ok(&srv, rgw, &["volume", "create", "v", "--size", "16M"]);
    write_random(&srv.url("v"), 0, 4 * MIB);
    ok(&srv, rgw, &["snapshot", "create", "v@manual"]);
    let set = json(
        &srv,
        rgw,
        &[
            "schedule",
            "set",
            "v",
            "--every",
            "2s",
            "--keep",
            "2",
            "--remote",
            "rgw",
            "--keep-remote",
            "1",
        ],
    );
    assert_eq!(set["every_s"], 2, "{set}");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let list = json(&srv, rgw, &["schedule", "list"]);
        if list[0]["runs"].as_u64().expect("runs") >= 4 {
            assert_eq!(list[0]["last_error"], Value::Null, "{list}");
            break;
        }
        assert!(Instant::now() < deadline, "4 runs not done in 60 s: {list}");
        std::thread::sleep(Duration::from_millis(200));
    }
    // The runner may be in its next run: stop the schedule, then look.
    ok(&srv, rgw, &["schedule", "remove", "v"]);
    std::thread::sleep(Duration::from_secs(3));
    let mut local = names(&json(&srv, rgw, &["snapshot", "list", "v"]));
    local.sort();
    assert_eq!(local.len(), 3, "{local:?}");
    assert_eq!(local[2], "manual", "{local:?}");
    assert!(
        local[..2].iter().all(|n| n.starts_with("auto-")),
        "{local:?}"
    );
    let remote = names(&json(&srv, rgw, &["snapshot", "list", "--remote", "rgw"]));
    assert_eq!(
        remote,
        [local[1].as_str()],
        "the newest is kept in the remote"
    );
    // The first remote deletion was followed by a GC of the remote (the next ones wait an
    // hour), and it left the bucket clean.
    let metrics = run(
        "curl",
        &[
            "-s",
            "-S",
            &format!("http://{}/metrics", srv.http.as_deref().expect("API")),
        ],
    );
    assert!(
        metrics.contains("ibid_remote_scheduled_gcs_total 1\n"),
        "no scheduled GC in the metrics"
    );
    let v = json(&srv, rgw, &["remote", "verify", "rgw"]);
    assert_eq!(v["ok"], true, "{v}");
}

/// A scheduled push the remote refuses (another host's GC of it holds its lock) is tried again
/// for the same snapshot, and lands once the remote is free — not an hour later at the
/// schedule's next run.
fn a_failed_scheduled_push_is_tried_again(rgw: &Rgw) {
    let srv = Server::start(&["--no-default-volume"]);
    add_remote(&srv, rgw, "rgw", "retry");
    ok(&srv, rgw, &["volume", "create", "v", "--size", "16M"]);
    write_random(&srv.url("v"), 0, MIB);
    let lock = format!(
        "{}/{}/{}/retry/locks/gc-elsewhere-1-0",
        rgw.endpoint, rgw.bucket, rgw.run
    );
    let body = r#"{"kind":"gc","host":"elsewhere","pid":1,"started_unix_s":0}"#;
    s3(rgw, "PUT", &lock, Some(body));
    ok(
        &srv,
        rgw,
        &[
            "schedule", "set", "v", "--every", "1h", "--keep", "2", "--remote", "rgw",
        ],
    );
    let waiting = wait_for_schedule(&srv, rgw, "a failed push waiting", |s| {
        s["push_retry_snapshot"].is_string()
    });
    let snapshot = waiting["push_retry_snapshot"]
        .as_str()
        .expect("snapshot")
        .to_string();
    let error = waiting["last_error"].as_str().expect("an error");
    assert!(error.contains("garbage collection"), "{waiting}");
    assert!(waiting["push_retry_unix_s"].is_u64(), "{waiting}");
    s3(rgw, "DELETE", &lock, None);
    let done = wait_for_schedule(&srv, rgw, "the push tried again", |s| {
        s["push_retry_snapshot"].is_null()
    });
    assert_eq!(
        (&done["runs"], &done["last_error"]),
        (&Value::from(1), &Value::Null),
        "{done}"
    );
    assert!(done["last_push_unix_s"].is_u64(), "{done}");
    let remote = names(&json(&srv, rgw, &["snapshot", "list", "--remote", "rgw"]));
    assert_eq!(remote, [snapshot.as_str()], "{remote:?}");
    ok(&srv, rgw, &["schedule", "remove", "v"]);
}

/// The `name` of each entry of a `snapshot list` answer.
fn names(list: &Value) -> Vec<String> {
    list.as_array()
        .expect("a list")
        .iter()
        .map(|s| s["name"].as_str().expect("name").to_string())
        .collect()
}

/// Polls `schedule list` until its first schedule passes `done` (within 60 s); that schedule.
fn wait_for_schedule(srv: &Server, rgw: &Rgw, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let list = json(srv, rgw, &["schedule", "list"]);
        if done(&list[0]) {
            return list[0].clone();
        }
        assert!(Instant::now() < deadline, "{what}: not in 60 s: {list}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// An S3 request to the gateway, signed by curl (`--aws-sigv4`), with `body` if given.
fn s3(rgw: &Rgw, method: &str, url: &str, body: Option<&str>) {
    let user = format!("{}:{}", rgw.key, rgw.secret);
    let mut args = vec![
        "-sS",
        "--fail",
        "-X",
        method,
        "--aws-sigv4",
        "aws:amz:us-east-1:s3",
    ];
    // RGW wants the payload's hash header; curl 7.88 does not send it by itself.
    args.extend(["-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD"]);
    args.extend(["--user", &user, url]);
    if let Some(body) = body {
        args.extend(["--data-binary", body]);
    }
    run("curl", &args);
}

/// After a restart that cut a job off: (the interrupted job, the job running it again) once
/// the second has ended.
fn jobs_after_restart(srv: &Server, rgw: &Rgw) -> (Value, Value) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let jobs = json(srv, rgw, &["job", "list"]);
        let list = jobs.as_array().expect("jobs");
        let cut = list.iter().find(|j| j["state"] == "interrupted");
        let again = list.iter().find(|j| {
            j["target"] == cut.map_or(Value::Null, |c| c["target"].clone())
                && j["state"] != "interrupted"
        });
        if let (Some(cut), Some(again)) = (cut, again) {
            if again["state"] != "running" {
                return (cut.clone(), again.clone());
            }
        }
        assert!(Instant::now() < deadline, "no job ran again: {jobs}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Writes `len` bytes of seeded random data (the same for the same seed) at `offset` of
/// `url` and flushes, with nbdsh.
fn write_seeded(url: &str, offset: u64, len: u64, seed: u64) {
    run(
        "nbdsh",
        &[
            "-u",
            url,
            "-c",
            &format!(
                "import random; h.pwrite(random.Random({seed}).randbytes({len}), {offset}); h.flush()"
            ),
        ],
    );
}

/// The restore view of volume `name` (null once complete).
fn restoring(srv: &Server, rgw: &Rgw, name: &str) -> Value {
    json(srv, rgw, &["volume", "describe", name])["restoring"].clone()
}

/// An instant restore answers once the volume is usable: a host writes into it (whole chunks
/// and a few sectors of one not fetched yet) and flushes while the background fetch crawls;
/// snapshots of it wait (409 `restoring`). kill -9 of the server: after the restart the
/// restore resumes by itself, keeps the host's flushed writes, and the volume equals the
/// source with the same writes (qemu-img compare, which reads what is still missing and
/// relies on block status showing it as data); once complete, the pool verifies, snapshots
/// work, and nothing of the restore is left in the pool directory.
fn instant_restores_serve_at_once_and_survive_kill_9(rgw: &Rgw) {
    let size = 96 * MIB;
    let a = Server::start(&["--no-default-volume"]);
    add_remote(&a, rgw, "rgw", "instant");
    fill(&a, rgw, "vm", size);
    ok(&a, rgw, &["snapshot", "create", "vm@s"]);
    json(&a, rgw, &["snapshot", "push", "vm@s", "--remote", "rgw"]);
    let b = Server::start(&["--no-default-volume"]);
    add_remote(&b, rgw, "rgw", "instant");
    let started = Instant::now();
    let r = json(
        &b,
        rgw,
        &[
            "volume",
            "restore",
            "r",
            "--remote",
            "rgw",
            "--snapshot",
            "vm@s",
            "--instant",
            "--fill-rate",
            "1M",
        ],
    );
    eprintln!(
        "instant restore answered in {:.2} s: {r}",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(r["instant"], true, "{r}");
    assert_eq!(r["job"]["kind"], "restore", "{r}");
    let view = restoring(&b, rgw, "r");
    assert_eq!(view["snapshot"], "vm@s", "{view}");
    assert!(
        view["bytes_present"].as_u64().expect("present")
            < view["bytes_total"].as_u64().expect("total"),
        "{view}"
    );
    // The same writes on the source volume (after its snapshot) and on the restored one.
    for url in [a.url("vm"), b.url("r")] {
        write_seeded(&url, 10 * MIB, 2 * MIB, 1);
        write_seeded(&url, 50 * MIB + 3 * 512, 5 * 512, 2);
    }
    let out = ibid(&b, rgw, &["snapshot", "create", "r@x"]);
    assert_eq!(
        out.status.code(),
        Some(4),
        "a snapshot of a volume being restored"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("restoring"));
    let dir = b.kill();
    let b = Server::start_in(dir, &["--no-default-volume"]);
    // Resumed at 1 MiB/s. Its fill cancelled, the restore goes on (fetching on access) and
    // its fill can be started again, at another rate, once at a time.
    eprintln!("after the restart: {}", restoring(&b, rgw, "r"));
    let running = |b: &Server| -> Option<Value> {
        let jobs = json(b, rgw, &["job", "list"]);
        jobs.as_array()
            .expect("jobs")
            .iter()
            .find(|j| j["state"] == "running" && j["kind"] == "restore")
            .cloned()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let fill_job = loop {
        if let Some(j) = running(&b) {
            break j;
        }
        assert!(Instant::now() < deadline, "the fill did not resume");
        std::thread::sleep(Duration::from_millis(100));
    };
    let id = fill_job["id"].to_string();
    ok(&b, rgw, &["job", "cancel", &id]);
    while running(&b).is_some() {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        !restoring(&b, rgw, "r").is_null(),
        "cancelled before the end"
    );
    let again = json(&b, rgw, &["volume", "fill", "r", "--fill-rate", "0"]);
    assert_eq!(again["kind"], "restore", "{again}");
    assert_eq!(
        ibid(&b, rgw, &["volume", "fill", "r"]).status.code(),
        Some(4),
        "a second fill while one runs"
    );
    assert_eq!(
        ibid(&b, rgw, &["volume", "fill", "nope"]).status.code(),
        Some(3)
    );
    assert_same(&a.url("vm"), &b.url("r"));
    let deadline = Instant::now() + Duration::from_secs(120);
    let job = loop {
        let jobs = json(&b, rgw, &["job", "list"]);
        let last = jobs
            .as_array()
            .expect("jobs")
            .last()
            .expect("a job")
            .clone();
        if last["state"] != "running" {
            break last;
        }
        assert!(
            Instant::now() < deadline,
            "the restore did not complete: {jobs}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(job["state"], "succeeded", "{job}");
    assert_eq!(job["result"]["instant"], true, "{job}");
    assert!(restoring(&b, rgw, "r").is_null());
    assert_same(&a.url("vm"), &b.url("r"));
    ok(&b, rgw, &["snapshot", "create", "r@x"]);
    let v = json(&b, rgw, &["pool", "verify"]);
    assert_eq!(v["ok"], true, "{v}");
    let kept = std::fs::read_to_string(b.pool_dir().join("instant-restores.json")).expect("file");
    assert!(!kept.contains("\"r\""), "{kept}");
    let marks: Vec<_> = std::fs::read_dir(b.pool_dir().join("instant-restores"))
        .expect("marks dir")
        .collect();
    assert!(marks.is_empty(), "{marks:?}");
}
