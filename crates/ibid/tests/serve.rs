//! `ibid serve` starting and stopping as an operator sees it: a start that fails (a port in use,
//! a volume that cannot be created) leaves no new pool directory behind and leaves an existing
//! pool as it was; logs carry colour codes on a terminal only.

mod common;

use common::{output, run, Server};
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

/// `ibid serve --data DIR ARGS` on ephemeral ports, expected to fail; returns its stderr.
fn serve_fails(data: &Path, args: &[&str]) -> String {
    let data = data.display().to_string();
    let mut all = vec!["serve", "--data", &data];
    for (flag, default) in [
        ("--nbd", "127.0.0.1:0"),
        ("--iscsi", "127.0.0.1:0"),
        ("--http", "127.0.0.1:0"),
    ] {
        if !args.contains(&flag) {
            all.extend([flag, default]);
        }
    }
    all.extend(args);
    let out = output(env!("CARGO_BIN_EXE_ibid"), &all);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "ibid {all:?}: {stderr}");
    stderr
}

#[test]
fn a_start_that_fails_leaves_no_new_pool_behind() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken_addr = taken.local_addr().expect("addr").to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = dir.path().join("pool");
    for (flag, what) in [("--nbd", "NBD"), ("--iscsi", "iSCSI"), ("--http", "HTTP")] {
        let err = serve_fails(&pool, &[flag, &taken_addr]);
        assert!(
            err.contains(&format!("listen for {what} on {taken_addr}")),
            "{flag}: {err}"
        );
        assert!(!pool.exists(), "{flag}: {} was left behind", pool.display());
    }
    // A volume that cannot be created fails the start after the pool was made: it goes again.
    let err = serve_fails(&pool, &["--volume", "odd=1000"]);
    assert!(err.contains("create volume odd"), "{err}");
    assert!(err.contains("volume size 1000 bytes"), "{err}");
    assert!(!pool.exists(), "{} was left behind", pool.display());
    // In a directory that already existed (with a file of its own), only what serve added goes.
    std::fs::create_dir(&pool).expect("mkdir");
    std::fs::write(pool.join("notes.txt"), "mine").expect("write");
    serve_fails(&pool, &["--volume", "odd=1000"]);
    let left: Vec<_> = std::fs::read_dir(&pool)
        .expect("read dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(left, ["notes.txt"]);
    std::fs::remove_dir_all(&pool).expect("clean up");
    // A file where the pool directory should be: the start fails and the file stays.
    std::fs::write(&pool, "not a pool").expect("write");
    let err = serve_fails(&pool, &[]);
    assert!(err.contains("open pool in"), "{err}");
    assert!(!err.contains("could not remove"), "{err}");
    assert_eq!(
        std::fs::read_to_string(&pool).expect("still there"),
        "not a pool"
    );
    std::fs::remove_file(&pool).expect("clean up");
    // An existing pool is never removed: a failed start leaves it, and it serves again.
    let srv = Server::start(&["--no-default-volume", "--volume", "keep=1M"]);
    let kept = srv.stop();
    let err = serve_fails(&kept.path().join("pool"), &["--nbd", &taken_addr]);
    assert!(err.contains("listen for NBD"), "{err}");
    let srv = Server::start_in(kept, &[]);
    let info = run("nbdinfo", &["--size", &srv.url("keep")]);
    assert_eq!(info.trim(), "1048576");
}

/// Starts `ibid serve` with RUST_LOG=info and stderr piped, stops it with SIGTERM, returns what
/// it logged.
fn serve_logs_through_a_pipe() -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = Command::new(env!("CARGO_BIN_EXE_ibid"))
        .args(["serve", "--data"])
        .arg(dir.path().join("pool"))
        .args(["--nbd", "127.0.0.1:0", "--iscsi", "127.0.0.1:0"])
        .args(["--http", "127.0.0.1:0", "--no-default-volume"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ibid serve");
    // The banner comes after the signal handlers are installed: a SIGTERM sent earlier (a
    // fixed sleep on a loaded machine) would kill the server before it could log anything.
    // The reader stays open to the end: the banner goes on after its first line, and a
    // closed pipe would fail the server's next print.
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    let announced = loop {
        line.clear();
        match std::io::BufRead::read_line(&mut stdout, &mut line) {
            Ok(0) | Err(_) => break false,
            Ok(_) if line.contains("serving pool") => break true,
            Ok(_) => {}
        }
    };
    assert!(announced, "ibid serve ended before its banner");
    run("kill", &["-TERM", &child.id().to_string()]);
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).expect("read the banner");
    let mut logs = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut logs)
        .expect("read logs");
    assert!(child.wait().expect("wait").success(), "{logs}");
    logs
}

#[test]
fn logs_carry_colour_codes_on_a_terminal_only() {
    let logs = serve_logs_through_a_pipe();
    assert!(logs.contains("shutting down"), "{logs:?}");
    assert!(
        !logs.contains('\u{1b}'),
        "colour codes in piped logs: {logs:?}"
    );
    // The same server on a pseudo-terminal (script(1)) colours its log levels.
    common::require("script");
    let dir = tempfile::tempdir().expect("tempdir");
    // Its banner (stdout) goes to a file, polled for before the SIGTERM; its log (stderr)
    // stays on the terminal.
    let banner = dir.path().join("banner");
    let cmd = format!(
        "RUST_LOG=info {} serve --data {} --nbd 127.0.0.1:0 --iscsi 127.0.0.1:0 \
         --http 127.0.0.1:0 --no-default-volume > {banner} & pid=$!; i=0; \
         until grep -q 'serving pool' {banner} || [ $i -ge 600 ]; do i=$((i+1)); sleep 0.05; done; \
         kill -TERM $pid; wait $pid",
        env!("CARGO_BIN_EXE_ibid"),
        dir.path().join("pool").display(),
        banner = banner.display()
    );
    let out = output("script", &["-qec", &cmd, "/dev/null"]);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(shown.contains("shutting down"), "{shown:?}");
    assert!(
        shown.contains('\u{1b}'),
        "no colour on a terminal: {shown:?}"
    );
}
