//! The `ibid` CLI against a captive `ibid serve`: every command with human and `--json` output,
//! data written through NBD with qemu-io, and every error path exiting with its documented code.

mod common;

use common::{run, Server};
use serde_json::Value;
use std::io::{Read, Write};
use std::process::{Command, Output};

/// Runs `ibid ARGS` with a clean environment (no IBID_SERVER, no IBID_API_TOKEN).
fn ibid_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ibid"));
    cmd.args(args)
        .env_remove("IBID_SERVER")
        .env_remove("IBID_API_TOKEN");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run ibid");
    eprintln!("ibid {} -> {}", args.join(" "), out.status);
    out
}

/// Runs `ibid ARGS --server http://ADDR` against `srv`.
fn ibid(srv: &Server, args: &[&str]) -> Output {
    let url = server_url(srv);
    let mut all = args.to_vec();
    all.extend(["--server", &url]);
    ibid_env(&all, &[])
}

fn server_url(srv: &Server) -> String {
    format!("http://{}", srv.http.as_deref().expect("API running"))
}

/// Runs a command that must succeed; returns its stdout.
fn ok(srv: &Server, args: &[&str]) -> String {
    let out = ibid(srv, args);
    assert_eq!(out.status.code(), Some(0), "ibid {args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command with `--json` that must succeed; returns its parsed stdout.
fn json(srv: &Server, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let stdout = ok(srv, &all);
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("ibid {args:?}: {e}: {stdout}"))
}

/// Runs a command that must fail with `exit` and API code `code`; returns its stderr.
fn fails(srv: &Server, args: &[&str], exit: i32, code: &str) -> String {
    let out = ibid(srv, args);
    check_failure(&out, args, exit, code)
}

fn check_failure(out: &Output, args: &[&str], exit: i32, code: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(exit),
        "ibid {args:?}: {}",
        text(out)
    );
    assert!(
        stderr.starts_with("ibid: ") && stderr.trim_end().ends_with(&format!("({code})")),
        "ibid {args:?}: stderr {stderr:?}, wanted 'ibid: ... ({code})'"
    );
    assert!(out.stdout.is_empty(), "ibid {args:?} printed on failure");
    stderr
}

fn text(out: &Output) -> String {
    format!(
        "{}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn names(list: &Value) -> Vec<&str> {
    list.as_array()
        .expect("array")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect()
}

#[test]
fn volume_commands_print_units_and_json() {
    let srv = Server::start(&["--no-default-volume", "--capacity", "8G"]);
    let v = json(
        &srv,
        &[
            "volume",
            "create",
            "vm1",
            "--size",
            "1G",
            "--format",
            "eagerzeroedthick",
        ],
    );
    assert_eq!(
        (
            v["name"].as_str(),
            v["format"].as_str(),
            v["size_bytes"].as_u64()
        ),
        (Some("vm1"), Some("eagerzeroedthick"), Some(1 << 30)),
        "{v}"
    );
    assert!(v["reserved_bytes"].as_u64() >= Some(1 << 30), "{v}");
    let out = ok(&srv, &["volume", "create", "vm2", "--size", "64M"]);
    assert!(out.contains("64 MiB") && out.contains("thin"), "{out}");
    // `1.5 GiB` with a space and the IEC suffix parses too.
    let v = json(&srv, &["volume", "create", "vm3", "--size", "1.5 GiB"]);
    assert_eq!(v["size_bytes"], 3u64 << 29);
    assert_eq!(
        names(&json(&srv, &["volume", "list"])),
        ["vm1", "vm2", "vm3"]
    );
    let out = ok(&srv, &["volume", "list"]);
    for want in [
        "NAME",
        "vm1",
        "eagerzeroedthick",
        "1 GiB",
        "64 MiB",
        "1.5 GiB",
    ] {
        assert!(out.contains(want), "{want:?} missing from:\n{out}");
    }
    let out = ok(&srv, &["volume", "describe", "vm1"]);
    for want in [
        "format:",
        "eagerzeroedthick",
        "1 GiB (1073741824 bytes)",
        "262144 of 4 KiB",
        "mapped:",
        "tbz:",
        "unique:",
        "shared:",
        "physical:",
        "reserved:",
        "snapshots: none",
    ] {
        assert!(out.contains(want), "{want:?} missing from:\n{out}");
    }
    // Resize answers 204; the CLI shows the volume as it now is.
    let v = json(&srv, &["volume", "resize", "vm2", "--size", "128M"]);
    assert_eq!(v["size_bytes"], 128u64 << 20);
    // Conversions: format, reserve, eagerzero, inflate.
    let v = json(&srv, &["volume", "format", "vm2", "zeroedthick"]);
    assert_eq!(v["format"], "lazyzeroedthick");
    let v = json(&srv, &["volume", "eagerzero", "vm2"]);
    assert_eq!(v["format"], "eagerzeroedthick");
    let v = json(&srv, &["volume", "reserve", "vm3"]);
    assert_eq!(v["format"], "lazyzeroedthick");
    ok(&srv, &["volume", "format", "vm3", "thin"]);
    let out = ok(&srv, &["volume", "inflate", "vm3"]);
    assert!(out.contains("eagerzeroedthick"), "{out}");
    let v = json(&srv, &["volume", "delete", "vm3"]);
    assert_eq!(v["deleted"], "vm3");
    assert!(ok(&srv, &["volume", "delete", "vm2"]).contains("deleted volume vm2"));
    assert_eq!(names(&json(&srv, &["volume", "list"])), ["vm1"]);
}

#[test]
fn snapshots_clones_and_copies_share_data_written_through_nbd() {
    let srv = Server::start(&["--no-default-volume", "--volume", "vm1=1G"]);
    run(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x42 0 1M", &srv.url("vm1")],
    );
    let s = json(&srv, &["snapshot", "create", "vm1", "golden"]);
    assert_eq!(
        (
            s["volume"].as_str(),
            s["name"].as_str(),
            s["mapped_blocks"].as_u64()
        ),
        (Some("vm1"), Some("golden"), Some(256)),
        "{s}"
    );
    ok(&srv, &["snapshot", "create", "vm1@second"]);
    let out = ok(&srv, &["snapshot", "list"]);
    assert!(
        out.contains("vm1@golden") && out.contains("vm1@second") && out.contains("1 MiB"),
        "{out}"
    );
    assert_eq!(
        names(&json(&srv, &["snapshot", "list", "vm1"])),
        ["golden", "second"]
    );
    // A fast clone of the snapshot and a full clone of the live volume.
    let c = json(&srv, &["volume", "clone", "vm1@golden", "c1"]);
    assert_eq!(
        (c["name"].as_str(), c["mapped_blocks"].as_u64()),
        (Some("c1"), Some(256))
    );
    let c = json(&srv, &["volume", "clone", "vm1", "c2", "--full"]);
    assert_eq!(c["size_bytes"], 1u64 << 30);
    for clone in ["c1", "c2"] {
        run(
            "qemu-io",
            &["-f", "raw", "-c", "read -P 0x42 0 1M", &srv.url(clone)],
        );
    }
    // Every 4 KiB block of vm1 is the same 0x42 block, shared with its snapshots and clones.
    let d = json(&srv, &["volume", "describe", "vm1"]);
    assert_eq!(d["mapped_blocks"], 256, "{d}");
    assert_eq!(d["blocks"], 262_144, "{d}");
    assert_eq!(
        (d["unique_blocks"].as_u64(), d["shared_blocks"].as_u64()),
        (Some(0), Some(256)),
        "{d}"
    );
    assert_eq!(d["distinct_chunks"], 1, "{d}");
    assert_eq!(d["snapshots"].as_array().map(Vec::len), Some(2), "{d}");
    // New data in the clone is its own; the rest stays shared.
    run(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x17 0 64k", &srv.url("c1")],
    );
    let d = json(&srv, &["volume", "describe", "c1"]);
    assert_eq!(
        (
            d["mapped_blocks"].as_u64(),
            d["unique_blocks"].as_u64(),
            d["shared_blocks"].as_u64()
        ),
        (Some(256), Some(16), Some(240)),
        "{d}"
    );
    // A range copy from a snapshot into another volume, by reference.
    ok(&srv, &["volume", "create", "dst", "--size", "4M"]);
    let r = json(
        &srv,
        &[
            "volume",
            "copy",
            "vm1@golden",
            "dst",
            "--length",
            "1M",
            "--offset",
            "1M",
        ],
    );
    assert_eq!(
        (
            r["length"].as_u64(),
            r["shared_bytes"].as_u64(),
            r["data_bytes"].as_u64()
        ),
        (Some(1 << 20), Some(1 << 20), Some(0)),
        "{r}"
    );
    let out = ok(&srv, &["volume", "copy", "vm1", "dst", "--length", "512K"]);
    assert!(out.contains("copied 512 KiB from vm1 to dst"), "{out}");
    run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "read -P 0x42 1M 1M",
            "-c",
            "read -P 0x42 0 512k",
            &srv.url("dst"),
        ],
    );
    // Deleting snapshots, then the volume; the clones keep their data.
    assert_eq!(
        json(&srv, &["snapshot", "delete", "vm1", "golden"])["deleted"],
        "vm1@golden"
    );
    assert!(ok(&srv, &["snapshot", "delete", "vm1@second"]).contains("deleted snapshot vm1@second"));
    ok(&srv, &["volume", "delete", "vm1"]);
    run(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x42 64k 960k", &srv.url("c1")],
    );
}

#[test]
fn errors_exit_with_their_documented_codes() {
    let srv = Server::start(&[
        "--no-default-volume",
        "--capacity",
        "1G",
        "--volume",
        "v=1M",
    ]);
    fails(&srv, &["volume", "describe", "nope"], 3, "not_found");
    fails(&srv, &["volume", "delete", "nope"], 3, "not_found");
    fails(&srv, &["snapshot", "list", "nope"], 3, "not_found");
    fails(&srv, &["snapshot", "delete", "v@none"], 3, "not_found");
    fails(&srv, &["volume", "clone", "v@none", "c"], 3, "not_found");
    fails(&srv, &["volume", "copy", "nope", "v"], 3, "not_found");
    fails(
        &srv,
        &["volume", "create", "v", "--size", "1M"],
        4,
        "already_exists",
    );
    fails(&srv, &["volume", "clone", "v", "v"], 4, "already_exists");
    fails(
        &srv,
        &[
            "volume",
            "create",
            "big",
            "--size",
            "2G",
            "--format",
            "eagerzeroedthick",
        ],
        4,
        "cannot_reserve",
    );
    fails(&srv, &["volume", "eagerzero", "v"], 4, "wrong_format");
    fails(
        &srv,
        &["volume", "create", "bad/name", "--size", "1M"],
        2,
        "invalid_argument",
    );
    fails(
        &srv,
        &["volume", "create", "odd", "--size", "1000"],
        2,
        "invalid_argument",
    );
    fails(
        &srv,
        &["volume", "resize", "v", "--size", "512K"],
        2,
        "invalid_argument",
    );
    fails(&srv, &["snapshot", "create", "v"], 2, "usage");
    fails(&srv, &["pool", "set"], 2, "usage");
    // Parsed locally by clap: exit 2 with clap's message, nothing sent.
    for args in [
        &["volume", "create", "x", "--size", "10Q"][..],
        &["volume", "format", "v", "thick"],
        &["pool", "set", "--soft-threshold", "101"],
        &["volume", "frobnicate"],
    ] {
        let out = ibid(&srv, args);
        assert_eq!(out.status.code(), Some(2), "ibid {args:?}: {}", text(&out));
    }
    let out = ibid(&srv, &["volume", "create", "x", "--size", "10Q"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("10Q"),
        "{}",
        text(&out)
    );
    // Nothing above changed the pool.
    let list = json(&srv, &["volume", "list"]);
    assert_eq!(names(&list), ["v"]);
    assert_eq!(list[0]["size_bytes"], 1u64 << 20);
    assert_eq!(list[0]["format"], "thin");
}

#[test]
fn server_down_exits_6_and_ibid_server_env_is_used() {
    let srv = Server::start(&["--no-default-volume", "--volume", "v=1M"]);
    let addr = srv.http.clone().expect("API running");
    // IBID_SERVER, with and without the scheme.
    for server in [format!("http://{addr}"), addr.clone()] {
        let out = ibid_env(&["volume", "list", "--json"], &[("IBID_SERVER", &server)]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        let list: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(names(&list), ["v"]);
    }
    // --server wins over IBID_SERVER.
    let out = ibid_env(
        &["pool", "stats", "--server", &addr],
        &[("IBID_SERVER", "http://127.0.0.1:1")],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // A port nobody listens on: take a free one and close it.
    let free = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let down = format!("http://{}", free.local_addr().expect("addr"));
    drop(free);
    let args = ["volume", "list", "--server", &down];
    check_failure(&ibid_env(&args, &[]), &args, 6, "cannot_connect");
    let out = ibid_env(&["pool", "stats"], &[("IBID_SERVER", &down)]);
    check_failure(&out, &["pool", "stats"], 6, "cannot_connect");
}

#[test]
fn a_server_with_a_token_refuses_clients_without_it() {
    let srv = Server::start(&[
        "--no-default-volume",
        "--volume",
        "v=1M",
        "--api-token",
        "s3cret",
    ]);
    fails(&srv, &["volume", "list"], 7, "unauthorized");
    fails(
        &srv,
        &["volume", "list", "--token", "wrong"],
        7,
        "unauthorized",
    );
    fails(
        &srv,
        &["volume", "create", "x", "--size", "1M"],
        7,
        "unauthorized",
    );
    assert_eq!(
        names(&json(&srv, &["volume", "list", "--token", "s3cret"])),
        ["v"]
    );
    let args = ["volume", "list", "--json", "--server", &server_url(&srv)];
    let out = ibid_env(&args, &[("IBID_API_TOKEN", "s3cret")]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let out = ibid_env(&args, &[("IBID_API_TOKEN", "nope")]);
    assert_eq!(out.status.code(), Some(7), "{}", text(&out));
    // With --json the error is JSON too.
    let e: Value = serde_json::from_slice(&out.stderr).expect("a JSON error");
    assert_eq!(e["code"], "unauthorized", "{e}");
}

#[test]
fn pool_stats_and_settings() {
    let srv = Server::start(&["--no-default-volume", "--capacity", "4G"]);
    let s = json(&srv, &["pool", "stats"]);
    assert_eq!(s["capacity_bytes"], 4u64 << 30, "{s}");
    let s = json(
        &srv,
        &["pool", "set", "--capacity", "2G", "--soft-threshold", "85"],
    );
    assert_eq!(
        (
            s["capacity_bytes"].as_u64(),
            s["soft_threshold_pct"].as_u64()
        ),
        (Some(2 << 30), Some(85)),
        "{s}"
    );
    let out = ok(&srv, &["pool", "stats"]);
    for want in [
        "capacity:",
        "2 GiB",
        "soft threshold:",
        "85%",
        "free:",
        "data reduction:",
        "by sharing:",
    ] {
        assert!(out.contains(want), "{want:?} missing from:\n{out}");
    }
}

/// A fake API that answers `GET /api/v1/volumes` with `[]` after `delay`, once.
fn slow_server(delay: std::time::Duration) -> (String, std::thread::JoinHandle<()>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let thread = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().expect("accept");
        let mut buf = [0u8; 4096];
        let _ = conn.read(&mut buf);
        std::thread::sleep(delay);
        let _ = conn.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\
              connection: close\r\n\r\n[]",
        );
    });
    (addr, thread)
}

#[test]
fn a_slow_call_shows_a_spinner_on_a_terminal_only() {
    common::require("script");
    let delay = std::time::Duration::from_millis(2500);
    let on_terminal = |extra: &str| {
        let (addr, server) = slow_server(delay);
        let cmd = format!(
            "{} volume list --server {addr} {extra}",
            env!("CARGO_BIN_EXE_ibid")
        );
        // script(1) runs the command on a pseudo-terminal and copies what it shows.
        let out = run("script", &["-qec", &cmd, "/dev/null"]);
        server.join().expect("server");
        out
    };
    let out = on_terminal("");
    assert!(
        out.contains("listing volumes ("),
        "no spinner on a terminal: {out:?}"
    );
    assert!(out.contains("NAME"), "{out:?}");
    // --json on a terminal: the JSON alone.
    let out = on_terminal("--json");
    assert!(
        !out.contains("listing volumes"),
        "spinner with --json: {out:?}"
    );
    assert_eq!(out.trim(), "[]");
    // Through pipes: no spinner, stdout is the table alone.
    let (addr, server) = slow_server(delay);
    let out = ibid_env(&["volume", "list", "--server", &addr], &[]);
    server.join().expect("server");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(out.stderr.is_empty(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("NAME"));
}

#[test]
fn a_full_pool_exits_5() {
    // 40 MiB of incompressible data in a 64 MiB pool; an unaligned copy must write it all again.
    let srv = Server::start(&[
        "--no-default-volume",
        "--capacity",
        "64M",
        "--volume",
        "a=48M",
        "--volume",
        "b=48M",
    ]);
    let image = srv.dir.path().join("random.img");
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..40 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect();
    std::fs::write(&image, data).expect("write image");
    let image = image.to_str().expect("utf-8 path");
    run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            &format!("write -s {image} 0 40M"),
            &srv.url("a"),
        ],
    );
    fails(
        &srv,
        &[
            "volume",
            "copy",
            "a",
            "b",
            "--source-offset",
            "512",
            "--length",
            "40M",
        ],
        5,
        "no_space",
    );
}

#[test]
fn client_options_go_before_or_after_the_group() {
    let srv = Server::start(&[
        "--no-default-volume",
        "--volume",
        "v=1M",
        "--api-token",
        "s3cret",
    ]);
    let url = server_url(&srv);
    for args in [
        &[
            "--server", &url, "--token", "s3cret", "--json", "volume", "list",
        ][..],
        &[
            "--json", "volume", "--server", &url, "list", "--token", "s3cret",
        ],
        &[
            "volume", "list", "--server", &url, "--token", "s3cret", "--json",
        ],
    ] {
        let out = ibid_env(args, &[]);
        assert_eq!(out.status.code(), Some(0), "ibid {args:?}: {}", text(&out));
        let list: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(names(&list), ["v"], "ibid {args:?}");
    }
    // They are the client commands' options: serve refuses them rather than ignoring them.
    let out = ibid_env(&["--json", "serve", "--data", "/nonexistent/pool"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--json is an option of the client"),
        "{}",
        text(&out)
    );
    assert!(!std::path::Path::new("/nonexistent/pool").exists());
}

/// Runs `ibid ARGS --json` that must fail with `exit` and `code`; returns the JSON error it
/// printed on stderr (stdout stays empty).
fn fails_json(srv: &Server, args: &[&str], exit: i32, code: &str) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = ibid(srv, &all);
    assert_eq!(
        out.status.code(),
        Some(exit),
        "ibid {all:?}: {}",
        text(&out)
    );
    assert!(out.stdout.is_empty(), "ibid {all:?}: {}", text(&out));
    let e: Value = serde_json::from_slice(&out.stderr)
        .unwrap_or_else(|e| panic!("ibid {all:?}: stderr is not JSON ({e}): {}", text(&out)));
    assert_eq!(
        (e["code"].as_str(), e["exit"].as_i64()),
        (Some(code), Some(i64::from(exit))),
        "{e}"
    );
    e
}

#[test]
fn errors_speak_of_snapshots_in_binary_units_and_as_json_with_json() {
    let srv = Server::start(&[
        "--no-default-volume",
        "--volume",
        "v=16M",
        "--volume",
        "w=1M",
    ]);
    ok(&srv, &["snapshot", "create", "v@golden"]);
    let err = fails(&srv, &["snapshot", "delete", "v@nope"], 3, "not_found");
    assert!(err.contains(r#"no snapshot "nope" of volume "v""#), "{err}");
    let err = fails(&srv, &["snapshot", "delete", "nope@golden"], 3, "not_found");
    assert!(err.contains(r#"no volume named "nope""#), "{err}");
    let err = fails(&srv, &["volume", "clone", "v@nope", "c"], 3, "not_found");
    assert!(err.contains(r#"no snapshot "nope" of volume "v""#), "{err}");
    let err = fails(&srv, &["volume", "copy", "nope@x", "w"], 3, "not_found");
    assert!(err.contains(r#"no volume named "nope""#), "{err}");
    // A snapshot given where a volume is expected is named as such, and stays.
    let err = fails(
        &srv,
        &["volume", "delete", "v@golden"],
        2,
        "invalid_argument",
    );
    assert!(
        err.contains("v@golden is a snapshot, not a volume"),
        "{err}"
    );
    let err = fails(
        &srv,
        &["volume", "describe", "v@golden"],
        2,
        "invalid_argument",
    );
    assert!(err.contains("is a snapshot"), "{err}");
    assert_eq!(names(&json(&srv, &["snapshot", "list", "v"])), ["golden"]);
    let err = fails(
        &srv,
        &["snapshot", "create", "v", "golden"],
        4,
        "already_exists",
    );
    assert!(
        err.contains(r#"volume "v" already has a snapshot named "golden""#),
        "{err}"
    );
    // Sizes and offsets in binary units, with the exact bytes where they matter.
    let err = fails(
        &srv,
        &["volume", "copy", "v", "w", "--length", "17G"],
        2,
        "out_of_range",
    );
    assert!(
        err.contains(
            "offset 0 bytes + length 17 GiB (18253611008 bytes) is beyond the volume size 16 MiB"
        ),
        "{err}"
    );
    let err = fails(
        &srv,
        &["volume", "resize", "v", "--size", "8M"],
        2,
        "invalid_argument",
    );
    assert!(
        err.contains(r#"volume "v" is 16 MiB; shrinking it to 8 MiB would discard data"#),
        "{err}"
    );
    let err = fails(
        &srv,
        &["volume", "create", "x", "--size", "1.0001G"],
        2,
        "invalid_argument",
    );
    assert!(
        err.contains("volume size 1.0 GiB (1073849198 bytes): must be a positive multiple of 512"),
        "{err}"
    );
    // A capacity below what the pool holds: refused with both figures, and nothing changes
    // (not even the soft threshold given with it).
    ok(
        &srv,
        &[
            "volume",
            "create",
            "thick",
            "--size",
            "8M",
            "--format",
            "eagerzeroedthick",
        ],
    );
    let before = json(&srv, &["pool", "stats"]);
    let err = fails(
        &srv,
        &["pool", "set", "--capacity", "4M", "--soft-threshold", "85"],
        4,
        "cannot_reserve",
    );
    assert!(
        err.contains("capacity 4 MiB is below the ")
            && err.contains(" the pool already uses and reserves"),
        "{err}"
    );
    let after = json(&srv, &["pool", "stats"]);
    assert_eq!(
        (&after["capacity_bytes"], &after["soft_threshold_pct"]),
        (&before["capacity_bytes"], &before["soft_threshold_pct"])
    );
    assert_ne!(after["soft_threshold_pct"], 85);
    ok(&srv, &["volume", "delete", "thick"]);
    // With --json, the same errors are one JSON object on stderr.
    let e = fails_json(&srv, &["snapshot", "delete", "v@nope"], 3, "not_found");
    assert_eq!(e["message"], r#"no snapshot "nope" of volume "v""#);
    fails_json(&srv, &["snapshot", "create", "v"], 2, "usage");
    // Usage errors found by the argument parser too.
    let e = fails_json(
        &srv,
        &["volume", "create", "x", "--size", "10Q"],
        2,
        "usage",
    );
    assert!(
        e["message"].as_str().is_some_and(|m| m.contains("10Q")),
        "{e}"
    );
    fails_json(&srv, &["volume", "frobnicate"], 2, "usage");
    // Unreachable server.
    let free = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let down = format!("http://{}", free.local_addr().expect("addr"));
    drop(free);
    let out = ibid_env(&["volume", "list", "--json", "--server", &down], &[]);
    assert_eq!(out.status.code(), Some(6), "{}", text(&out));
    let e: Value = serde_json::from_slice(&out.stderr).expect("JSON error");
    assert_eq!(e["code"], "cannot_connect");
    // --help still prints help, not a JSON error.
    let out = ibid_env(&["volume", "--help", "--json"], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("Usage"));
    // Nothing above changed the pool.
    let list = json(&srv, &["volume", "list"]);
    assert_eq!(names(&list), ["v", "w"]);
    assert_eq!(list[0]["size_bytes"], 16u64 << 20);
}

/// A real client holding its connection open until dropped: a child process that waits for
/// its stdin to close.
struct Held(std::process::Child);

impl Held {
    fn start(cmd: &str, args: &[&str]) -> Held {
        common::require(cmd);
        // /usr/bin first, as common::output does: nbdsh needs the system Python's libnbd.
        let path = format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default());
        let child = Command::new(cmd)
            .args(args)
            .env("PATH", path)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {cmd}: {e}"));
        Held(child)
    }

    /// nbdsh connected to `url`, running `python` and then waiting.
    fn nbdsh(url: &str, python: &str) -> Held {
        let script = format!("import sys\n{python}\nsys.stdin.read()");
        Held::start("nbdsh", &["-u", url, "-c", &script])
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        for _ in 0..200 {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits (10 s at most) until the API lists `n` clients of `volume`; returns its description.
fn wait_for_clients(srv: &Server, volume: &str, n: usize) -> Value {
    let mut last = Value::Null;
    for _ in 0..200 {
        let (status, d) = common::api_call(srv, "GET", &format!("/api/v1/volumes/{volume}"), None);
        assert_eq!(status, 200, "{d}");
        if d["clients"].as_array().map(Vec::len) == Some(n) {
            return d;
        }
        last = d;
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("{volume} never had {n} clients: {last}");
}

#[test]
fn volumes_with_connected_clients_are_not_deleted_without_force() {
    let srv = Server::start(&[
        "--no-default-volume",
        "--volume",
        "vm1=16M",
        "--volume",
        "vm2=16M",
        "--volume",
        "vm3=16M",
    ]);
    // An NBD client (libnbd's nbdsh) that wrote a sector and holds its connection.
    let held = Held::nbdsh(&srv.url("vm1"), "h.pwrite(b'x' * 512, 0)");
    let d = wait_for_clients(&srv, "vm1", 1);
    let client = &d["clients"][0];
    assert_eq!(
        (client["protocol"].as_str(), client["export"].as_str()),
        (Some("nbd"), Some("vm1")),
        "{d}"
    );
    let remote = client["remote"].as_str().expect("remote").to_string();
    assert!(remote.starts_with("127.0.0.1:"), "{d}");
    let out = ok(&srv, &["volume", "describe", "vm1"]);
    assert!(out.contains(&format!("clients:   nbd {remote}")), "{out}");
    let list = json(&srv, &["volume", "list"]);
    let clients_of = |name: &str| {
        list.as_array()
            .expect("array")
            .iter()
            .find(|v| v["name"] == name)
            .and_then(|v| v["clients"].as_array())
            .map(Vec::len)
    };
    assert_eq!((clients_of("vm1"), clients_of("vm2")), (Some(1), Some(0)));
    // Deleting it is refused, by the CLI (exit 4) and the API (409), naming the client.
    let err = fails(&srv, &["volume", "delete", "vm1"], 4, "in_use");
    assert!(err.contains(&format!("nbd {remote}")), "{err}");
    assert!(err.contains("--force"), "{err}");
    let (status, v) = common::api_call(&srv, "DELETE", "/api/v1/volumes/vm1", None);
    assert_eq!((status, v["code"].as_str()), (409, Some("in_use")), "{v}");
    let (status, v) = common::api_call(&srv, "DELETE", "/api/v1/volumes/vm1?force=maybe", None);
    assert_eq!(
        (status, v["code"].as_str()),
        (400, Some("bad_request")),
        "{v}"
    );
    // Once the client has gone, the volume (with its data) deletes without --force.
    drop(held);
    wait_for_clients(&srv, "vm1", 0);
    run(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x78 0 512", &srv.url("vm1")],
    );
    wait_for_clients(&srv, "vm1", 0);
    assert!(ok(&srv, &["volume", "delete", "vm1"]).contains("deleted volume vm1"));
    // A client of a snapshot holds the snapshot, and the volume it would go with.
    ok(&srv, &["snapshot", "create", "vm2@s"]);
    let held = Held::nbdsh(&srv.url("vm2@s"), "h.pread(512, 0)");
    let d = wait_for_clients(&srv, "vm2", 1);
    assert_eq!(d["clients"][0]["export"], "vm2@s", "{d}");
    assert!(ok(&srv, &["volume", "describe", "vm2"]).contains("on vm2@s"));
    fails(&srv, &["snapshot", "delete", "vm2@s"], 4, "in_use");
    fails(&srv, &["volume", "delete", "vm2"], 4, "in_use");
    ok(&srv, &["snapshot", "delete", "vm2@s", "--force"]);
    wait_for_clients(&srv, "vm2", 0);
    ok(&srv, &["volume", "delete", "vm2"]);
    drop(held);
    // An iSCSI session (qemu-io through libiscsi) that has opened vm3's LUN.
    let lun = u64_of(&json(&srv, &["volume", "describe", "vm3"]), "lun");
    let _held = Held::start("qemu-io", &["-f", "raw", &srv.iscsi_url(lun)]);
    let d = wait_for_clients(&srv, "vm3", 1);
    let client = &d["clients"][0];
    assert_eq!(client["protocol"], "iscsi", "{d}");
    assert!(
        client["initiator"]
            .as_str()
            .is_some_and(|i| i.starts_with("iqn.")),
        "{d}"
    );
    let err = fails(&srv, &["volume", "delete", "vm3"], 4, "in_use");
    assert!(err.contains("iscsi 127.0.0.1:"), "{err}");
    // --force deletes it under the connected client.
    let v = json(&srv, &["volume", "delete", "vm3", "--force"]);
    assert_eq!(v["deleted"], "vm3");
    assert_eq!(names(&json(&srv, &["volume", "list"])), Vec::<&str>::new());
}

/// The README's eager-zeroed example fits a pool made on a machine with ~60 GiB free once the
/// release build has taken its share (55 GiB here), and creating a thick volume says what it
/// reserves and why; the example's old size is refused with the reason.
#[test]
fn the_readme_eager_example_fits_and_thick_volumes_explain_their_reservation() {
    let readme = include_str!("../../../README.md");
    let example = "ibid volume create vm1 --size 40G --format eagerzeroedthick";
    assert!(readme.contains(example), "the README's example changed");
    assert!(readme.contains(r#""size":"40G","format":"eagerzeroedthick""#));
    // Forced: the machine running the test may have less than 55 GiB free.
    let srv = Server::start(&[
        "--no-default-volume",
        "--capacity",
        "55G",
        "--capacity-force",
    ]);
    let args: Vec<&str> = example.split(' ').skip(1).collect();
    let out = ok(&srv, &args);
    for want in [
        "reserved: 45.2 GiB (4632 bytes per 4 KiB block without data: 13 % over its size",
        "overwrite headroom",
        "72.4 MiB at most",
    ] {
        assert!(out.contains(want), "{want:?} missing from:\n{out}");
    }
    // The pool's view: the volume's reservation plus the headroom.
    let s = json(&srv, &["pool", "stats"]);
    assert_eq!(
        s["reserved_bytes"].as_u64(),
        Some(((40u64 << 30) / 4096 + 16384) * 4632),
        "{s}"
    );
    assert_eq!(
        s["overwrite_headroom_bytes"].as_u64(),
        Some(16384 * 4632),
        "{s}"
    );
    // 50 GiB eager needs 56.6 GiB: refused, and the message says how reservations are sized.
    ok(&srv, &["volume", "delete", "vm1"]);
    let err = fails(
        &srv,
        &[
            "volume",
            "create",
            "vm1",
            "--size",
            "50G",
            "--format",
            "eagerzeroedthick",
        ],
        4,
        "cannot_reserve",
    );
    for want in [
        "the pool cannot reserve 56.6 GiB (60788441088 bytes)",
        "4632 bytes per 4 KiB block without data",
    ] {
        assert!(err.contains(want), "{want:?} missing from {err}");
    }
    // A thin volume reserves nothing and says nothing of it.
    let out = ok(&srv, &["volume", "create", "t", "--size", "50G"]);
    assert!(
        out.contains("reserved: 0 B") && !out.contains("headroom"),
        "{out}"
    );
}

/// Segment files (`*.seg`) under `dir`, sorted by name (the oldest first).
fn segment_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("read dir") {
            let path = e.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|x| x == "seg") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// Reads each 4 KiB block of `url` with libnbd (nbdsh) and compares it with `image`: one line
/// per block, `ok`, `WRONG` or `error ERRNO` (the name, e.g. `EIO`).
fn read_blocks_with_nbdsh(url: &str, image: &std::path::Path, blocks: usize) -> Vec<String> {
    let script = format!(
        "import nbd\n\
         exp = open({image:?}, 'rb').read()\n\
         for i in range({blocks}):\n\
         \x20   try:\n\
         \x20       got = h.pread(4096, i * 4096)\n\
         \x20       print('ok' if got == exp[i * 4096:(i + 1) * 4096] else 'WRONG')\n\
         \x20   except nbd.Error as e:\n\
         \x20       print('error', e.errno)\n",
        image = image.display().to_string()
    );
    run("nbdsh", &["-u", url, "-c", &script])
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn pool_verify_finds_flipped_bytes_online_and_offline_and_the_block_reads_as_eio() {
    let srv = Server::start(&["--no-default-volume", "--volume", "v=1M"]);
    // 8 blocks of incompressible data, written through NBD.
    let image = srv.dir.path().join("data.img");
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let data: Vec<u8> = (0..8 * 4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    std::fs::write(&image, data).expect("write image");
    let image_arg = format!("write -s {} 0 32k", image.display());
    run("qemu-io", &["-f", "raw", "-c", &image_arg, &srv.url("v")]);
    let out = ok(&srv, &["pool", "verify"]);
    assert!(out.contains("no problems found"), "{out}");
    let report = json(&srv, &["pool", "verify"]);
    assert_eq!(
        (report["ok"].as_bool(), report["chunks"].as_u64()),
        (Some(true), Some(8)),
        "{report}"
    );
    // Offline, on the stopped pool: the same verdict.
    let dir = srv.stop();
    let pool_dir = dir.path().join("pool");
    let pool_arg = pool_dir.display().to_string();
    let out = ibid_env(&["pool", "verify", "--data", &pool_arg], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("offline"));
    // Flip one byte inside the first record's payload (after the 64-byte segment header and
    // the 24-byte record header).
    let segment = segment_files(&pool_dir)
        .into_iter()
        .next()
        .expect("a segment file");
    let mut bytes = std::fs::read(&segment).expect("read segment");
    bytes[64 + 24 + 100] ^= 0x40;
    std::fs::write(&segment, bytes).expect("write segment");
    let out = ibid_env(&["pool", "verify", "--data", &pool_arg], &[]);
    let args = ["pool", "verify", "--data", &pool_arg];
    let err = check_failure(&out, &args, 8, "damaged");
    assert!(
        err.contains("found damage") && err.contains("checksum"),
        "{err}"
    );
    // Online, on the restarted server: the CLI (exit 8, JSON error with --json) and the API.
    let srv = Server::start_in(dir, &[]);
    let err = fails(&srv, &["pool", "verify"], 8, "damaged");
    assert!(err.contains("online") && err.contains("checksum"), "{err}");
    let online_err = err;
    let e = fails_json(&srv, &["pool", "verify"], 8, "damaged");
    assert!(
        e["message"]
            .as_str()
            .is_some_and(|m| m.contains("checksum")),
        "{e}"
    );
    let (status, v) = common::api_call(&srv, "POST", "/api/v1/pool/verify", None);
    assert_eq!((status, v["ok"].as_bool()), (200, Some(false)), "{v}");
    // Offline verify of a pool a server has open is refused, naming the way to do it.
    let out = ibid_env(&["pool", "verify", "--data", &pool_arg], &[]);
    let err = check_failure(&out, &args, 4, "in_use");
    assert!(err.contains("verify it online"), "{err}");
    // A reader of the damaged block gets EIO; every other block reads back exactly.
    let reads = read_blocks_with_nbdsh(&srv.url("v"), &image, 8);
    assert_eq!(reads.len(), 8, "{reads:?}");
    assert_eq!(
        reads.iter().filter(|r| *r == "error EIO").count(),
        1,
        "exactly one block fails, with EIO: {reads:?}"
    );
    assert_eq!(reads.iter().filter(|r| *r == "ok").count(), 7, "{reads:?}");
    // Verify named that very block as what the damaged chunk holds.
    let bad = reads
        .iter()
        .position(|r| r == "error EIO")
        .expect("the bad block");
    assert!(
        online_err.contains("1 damaged chunk: chunk ")
            && online_err.contains(&format!(") is block {bad} of \"v\"")),
        "{online_err}"
    );
    // The server is still up and the damage is still reported.
    fails(&srv, &["pool", "verify"], 8, "damaged");
    // The background scrub, asked for a pass now, finds the same damage and names the block.
    let out = ok(&srv, &["pool", "scrub"]);
    assert!(out.contains("scrub pass started"), "{out}");
    let mut st = Value::Null;
    for _ in 0..100 {
        let (status, s) = common::api_call(&srv, "GET", "/api/v1/pool/scrub", None);
        assert_eq!(status, 200, "{s}");
        if s["passes"].as_u64() >= Some(1) {
            st = s;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(st["checked_chunks"].as_u64(), Some(8), "{st}");
    assert_eq!(st["damaged"].as_array().map(Vec::len), Some(1), "{st}");
    let place = &st["damaged"][0]["places"][0];
    assert_eq!(
        (place["volume"].as_str(), place["block"].as_u64()),
        (Some("v"), Some(bad as u64)),
        "{st}"
    );
    let err = fails(&srv, &["pool", "scrub", "--status"], 8, "damaged");
    assert!(err.contains(&format!("block {bad} of \"v\"")), "{err}");
    let metrics = run(
        "curl",
        &[
            "-s",
            &format!("http://{}/metrics", srv.http.as_deref().expect("API")),
        ],
    );
    assert!(
        metrics.contains("ibid_scrub_damaged_chunks 1")
            && metrics.contains("ibid_scrub_passes_total 1")
            && metrics.contains("ibid_scrub_checked_chunks_total 8"),
        "{metrics}"
    );
}

/// fio's nbd engine: random 4 KiB writes at queue depth 8 on `volume`, `jobs` jobs (as many NBD
/// connections), for `seconds`; started now, joined by [`fio_write_iops`].
fn fio_random_writes(srv: &Server, volume: &str, jobs: u32, seconds: u32) -> std::process::Child {
    common::require("fio");
    Command::new("fio")
        .args([
            &format!("--name={volume}"),
            "--ioengine=nbd",
            &format!("--uri={}", srv.url(volume)),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=8",
            &format!("--numjobs={jobs}"),
            "--group_reporting",
            "--size=64M",
            "--time_based",
            &format!("--runtime={seconds}"),
            "--output-format=json",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start fio")
}

/// The write IOPS a fio run from [`fio_random_writes`] measured.
fn fio_write_iops(fio: std::process::Child) -> f64 {
    let out = fio.wait_with_output().expect("fio");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "fio: {text}");
    let v: Value = serde_json::from_str(&text[text.find('{').expect("fio json")..])
        .unwrap_or_else(|e| panic!("fio json: {e}: {text}"));
    assert_eq!(v["jobs"][0]["error"], 0, "{text}");
    v["jobs"][0]["write"]["iops"].as_f64().expect("iops")
}

/// One sample of the metrics page: `name{labels}` exactly as written there.
fn metric(srv: &Server, series: &str) -> Option<f64> {
    let page = run(
        "curl",
        &["-s", "-S", &format!("{}/metrics", server_url(srv))],
    );
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn qos_limits_a_volume_across_connections_and_protocols_and_survive_a_restart() {
    let srv = Server::start(&[]);
    // Set at creation: 200 writes a second. `fast` has no limit.
    let slow = json(
        &srv,
        &[
            "volume",
            "create",
            "slow",
            "--size",
            "1G",
            "--write-iops",
            "200",
        ],
    );
    assert_eq!(slow["qos"]["write_iops"], 200, "{slow}");
    assert_eq!(slow["qos"]["read_iops"], Value::Null, "{slow}");
    ok(&srv, &["volume", "create", "fast", "--size", "1G"]);
    // Both at once, two connections each: the limit holds for the volume as a whole, and
    // the unlimited volume runs at its own pace.
    let (slow_fio, fast_fio) = (
        fio_random_writes(&srv, "slow", 2, 4),
        fio_random_writes(&srv, "fast", 2, 4),
    );
    let (slow_iops, fast_iops) = (fio_write_iops(slow_fio), fio_write_iops(fast_fio));
    eprintln!("fio write IOPS: slow (limit 200) {slow_iops:.0}, fast (no limit) {fast_iops:.0}");
    assert!(
        (150.0..=230.0).contains(&slow_iops),
        "slow: {slow_iops} write IOPS under a limit of 200"
    );
    assert!(
        fast_iops > 3.0 * 230.0,
        "fast: {fast_iops} write IOPS next to the limited volume"
    );
    let throttled = r#"ibid_volume_throttled_requests_total{volume="slow"}"#;
    assert!(metric(&srv, throttled) > Some(0.0));
    assert_eq!(
        metric(
            &srv,
            r#"ibid_volume_throttled_requests_total{volume="fast"}"#
        ),
        Some(0.0)
    );
    assert_eq!(
        metric(
            &srv,
            r#"ibid_volume_qos_limit_iops{volume="slow",op="write"}"#
        ),
        Some(200.0)
    );

    // NBD and iSCSI share the volume's limit: with fio's four connections keeping `slow` at
    // its 200 writes a second, 100 iSCSI writes one at a time (alone, 20 of them pass in the
    // burst and the rest at 200 a second: ~0.5 s) get a share of the limit only, and together
    // they stay within it.
    let fio = fio_random_writes(&srv, "slow", 4, 4);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let iscsi = iscsi_writes(&srv, "slow", 100);
    let nbd_iops = fio_write_iops(fio);
    eprintln!(
        "slow (limit 200): fio {nbd_iops:.0} write IOPS while 100 iSCSI writes took {iscsi:?}"
    );
    assert!(
        iscsi > std::time::Duration::from_millis(900),
        "100 iSCSI writes took {iscsi:?} next to fio on a volume limited to 200 IOPS"
    );
    assert!(
        nbd_iops + 100.0 / 4.0 <= 230.0,
        "fio {nbd_iops} write IOPS and 100 iSCSI writes in 4 s under a limit of 200"
    );

    // A limit set at run time reaches a connection already open (libnbd, one write at a
    // time): unlimited first, then 20 writes a second.
    ok(&srv, &["volume", "create", "rt", "--size", "16M"]);
    let script = "import sys, time\n\
         buf = b'\\x01' * 4096\n\
         def writes(secs):\n\
         \x20   n, t0 = 0, time.monotonic()\n\
         \x20   while time.monotonic() - t0 < secs:\n\
         \x20       h.pwrite(buf, (n % 256) * 4096)\n\
         \x20       n += 1\n\
         \x20   return n\n\
         print(writes(0.5), flush=True)\n\
         sys.stdin.readline()\n\
         writes(0.3)\n\
         print(writes(1.0), flush=True)\n";
    let path = format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default());
    let mut nbdsh = Command::new("nbdsh")
        .args(["-u", &srv.url("rt"), "-c", script])
        .env("PATH", path)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start nbdsh");
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(
        nbdsh.stdout.take().expect("stdout"),
    ));
    let mut count = || -> u64 {
        let line = lines.next().expect("nbdsh output").expect("read nbdsh");
        line.trim()
            .parse()
            .unwrap_or_else(|e| panic!("{e}: {line:?}"))
    };
    let before = count();
    let set = json(&srv, &["volume", "qos", "rt", "--write-iops", "20"]);
    assert_eq!(set["qos"]["write_iops"], 20, "{set}");
    writeln!(nbdsh.stdin.as_mut().expect("stdin")).expect("signal nbdsh");
    let after = count();
    assert!(nbdsh.wait().expect("nbdsh").success());
    eprintln!("nbdsh writes: {before} in 0.5 s unlimited, {after} in 1 s at 20 IOPS");
    assert!(before >= 50, "{before} writes in 0.5 s before the limit");
    assert!(
        (10..=26).contains(&after),
        "{after} writes in 1 s at 20 IOPS"
    );

    // The same limit holds over iSCSI: 30 writes at 20 a second take over a second.
    let iscsi = iscsi_writes(&srv, "rt", 30);
    eprintln!("30 iSCSI writes at 20 IOPS: {iscsi:?}");
    assert!(
        iscsi > std::time::Duration::from_millis(1200),
        "30 iSCSI writes took {iscsi:?} under a limit of 20 IOPS"
    );

    // Bad values are refused whole, with a precise error, and change nothing.
    for (body, why) in [
        (
            r#"{"write_iops": 0}"#,
            "write_iops must be a whole number from 1",
        ),
        (r#"{"write_iops": -5}"#, "not -5"),
        (r#"{"read_mbps": 1.5}"#, "not 1.5"),
        (r#"{"total_iops": "100"}"#, "not \"100\""),
        (r#"{"write_mbps": 99999999999}"#, "from 1 to 1048576"),
        (
            r#"{"read_iops": 10, "iops": 10}"#,
            "unknown QoS limit \"iops\"",
        ),
        (r#"[1]"#, "QoS limits are a JSON object"),
    ] {
        let (status, e) = common::api_call(&srv, "PATCH", "/api/v1/volumes/slow/qos", Some(body));
        assert_eq!(status, 400, "{body}: {e}");
        assert_eq!(e["code"], "invalid_argument", "{body}: {e}");
        let message = e["message"].as_str().expect("message");
        assert!(message.contains(why), "{body}: {message}");
    }
    let (status, e) = common::api_call(
        &srv,
        "PATCH",
        "/api/v1/volumes/nope/qos",
        Some(r#"{"write_iops": 10}"#),
    );
    assert_eq!(
        (status, e["code"].as_str()),
        (404, Some("not_found")),
        "{e}"
    );
    let (status, e) = common::api_call(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name": "bad", "size": "1G", "qos": {"read_iops": 0}}"#),
    );
    assert_eq!(
        (status, e["code"].as_str()),
        (400, Some("invalid_argument")),
        "{e}"
    );
    fails(&srv, &["volume", "describe", "bad"], 3, "not_found");
    fails(
        &srv,
        &["volume", "qos", "slow", "--write-mbps", "0"],
        2,
        "invalid_argument",
    );
    // Nothing changed, not even the valid half of a refused patch.
    let shown = ok(&srv, &["volume", "qos", "slow"]);
    assert!(
        shown.contains("qos:") && shown.contains(" write 200 IOPS\n"),
        "{shown}"
    );
    let d = json(&srv, &["volume", "describe", "slow"]);
    assert_eq!(
        d["qos"],
        serde_json::json!({"read_iops": null, "write_iops": 200, "total_iops": null,
            "read_mbps": null, "write_mbps": null, "total_mbps": null}),
        "{d}"
    );
    assert!(d["qos_throttled_requests"].as_u64() > Some(0), "{d}");

    // Limits are kept with the pool: a restart finds them, and they can be cleared.
    ok(
        &srv,
        &[
            "volume",
            "qos",
            "fast",
            "--mbps",
            "100",
            "--read-iops",
            "500",
        ],
    );
    let srv = Server::start_in(srv.stop(), &[]);
    let qos = |name: &str| json(&srv, &["volume", "describe", name])["qos"].clone();
    assert_eq!(qos("slow")["write_iops"], 200);
    assert_eq!(qos("rt")["write_iops"], 20);
    assert_eq!(
        (
            qos("fast")["total_mbps"].as_u64(),
            qos("fast")["read_iops"].as_u64()
        ),
        (Some(100), Some(500))
    );
    assert_eq!(
        metric(
            &srv,
            r#"ibid_volume_qos_limit_bytes_per_second{volume="fast",op="total"}"#
        ),
        Some(100.0 * 1048576.0)
    );
    let capped = json(
        &srv,
        &[
            "volume",
            "create",
            "capped",
            "--size",
            "16M",
            "--max-iops",
            "500",
            "--max-mbps",
            "100",
        ],
    );
    assert_eq!(
        (
            capped["qos"]["total_iops"].as_u64(),
            capped["qos"]["total_mbps"].as_u64()
        ),
        (Some(500), Some(100)),
        "{capped}"
    );
    let cleared = json(
        &srv,
        &["volume", "qos", "fast", "--clear", "--write-iops", "1000"],
    );
    assert_eq!(
        cleared["qos"],
        serde_json::json!({"read_iops": null, "write_iops": 1000, "total_iops": null,
            "read_mbps": null, "write_mbps": null, "total_mbps": null})
    );
    // A deleted volume's limits do not pass to a new volume of the same name.
    ok(&srv, &["volume", "delete", "slow"]);
    let again = json(&srv, &["volume", "create", "slow", "--size", "1G"]);
    assert_eq!(again["qos"]["write_iops"], Value::Null, "{again}");
}

/// Writes `count` 4 KiB blocks, one at a time, to `volume` over iSCSI (qemu-io, one login);
/// returns how long that took.
fn iscsi_writes(srv: &Server, volume: &str, count: u64) -> std::time::Duration {
    let lun = u64_of(&json(srv, &["volume", "describe", volume]), "lun");
    let mut args: Vec<String> = vec!["-f".into(), "raw".into()];
    for i in 0..count {
        args.extend(["-c".to_string(), format!("write -P 7 {}k 4k", i * 4)]);
    }
    args.push(srv.iscsi_url(lun));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let start = std::time::Instant::now();
    run("qemu-io", &args);
    start.elapsed()
}

/// A field of `v` that must be an unsigned number.
fn u64_of(v: &Value, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} in {v}"))
}

/// A client command whose output pipe has closed (`ibid ... | head` after head has gone) ends
/// by SIGPIPE, as other command-line tools do, not with a panic.
#[test]
fn a_closed_output_pipe_ends_the_client_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let srv = Server::start(&[]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_ibid"))
        .args(["volume", "list", "--json", "--server", &server_url(&srv)])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run ibid");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.signal(), Some(13), "{:?} {stderr}", out.status);
}
