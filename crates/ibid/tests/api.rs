//! The HTTP API of a running `ibid serve`, driven with curl: volumes, snapshots, clones and
//! pool statistics, and every error path answering a precise JSON error with a 4xx status.

mod common;

use common::{run, Server};
use serde_json::Value;

fn call(srv: &Server, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    common::api_call(srv, method, path, body)
}

#[test]
fn volumes_snapshots_and_clones_through_the_api() {
    let srv = Server::start(&["--no-default-volume"]);
    let (status, v) = call(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name":"vm1","size":"1G"}"#),
    );
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["size_bytes"], 1u64 << 30);
    let (status, v) = call(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name":"vm2","size":1048576}"#),
    );
    assert_eq!((status, v["size_bytes"].as_u64()), (201, Some(1 << 20)));
    // Data through NBD, then a snapshot, a clone of it, and a fast clone of the live volume.
    run(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x42 0 1M", &srv.url("vm1")],
    );
    let (status, s) = call(
        &srv,
        "POST",
        "/api/v1/volumes/vm1/snapshots",
        Some(r#"{"name":"golden"}"#),
    );
    assert_eq!(status, 201, "{s}");
    assert_eq!(s["mapped_blocks"], 256);
    let (status, _) = call(
        &srv,
        "POST",
        "/api/v1/volumes/vm1/clone",
        Some(r#"{"name":"c1","snapshot":"golden"}"#),
    );
    assert_eq!(status, 201);
    let (status, _) = call(
        &srv,
        "POST",
        "/api/v1/volumes/vm1/clone",
        Some(r#"{"name":"c2","full":true}"#),
    );
    assert_eq!(status, 201);
    // A full clone in the background is a job (kind clone) whose result is the new volume.
    let (status, job) = call(
        &srv,
        "POST",
        "/api/v1/volumes/vm1/clone",
        Some(r#"{"name":"c3","full":true,"background":true}"#),
    );
    assert_eq!(
        (status, job["kind"].as_str()),
        (202, Some("clone")),
        "{job}"
    );
    let job = loop {
        let (_, j) = call(&srv, "GET", &format!("/api/v1/jobs/{}", job["id"]), None);
        if j["state"] != "running" {
            break j;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(job["state"], "succeeded", "{job}");
    assert_eq!(job["result"]["name"], "c3", "{job}");
    assert_eq!(job["bytes_done"], job["bytes_total"], "{job}");
    let (status, e) = call(
        &srv,
        "POST",
        "/api/v1/volumes/vm1/clone",
        Some(r#"{"name":"c4","background":true}"#),
    );
    assert_eq!(
        (status, e["code"].as_str()),
        (400, Some("bad_request")),
        "{e}"
    );
    let (status, _) = call(&srv, "DELETE", "/api/v1/volumes/c3", None);
    assert_eq!(status, 204);
    run(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x42 0 1M", &srv.url("c1")],
    );
    run(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x42 0 1M", &srv.url("c2")],
    );
    let (_, list) = call(&srv, "GET", "/api/v1/volumes", None);
    let names: Vec<&str> = list
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(names, ["c1", "c2", "vm1", "vm2"]);
    let (status, d) = call(&srv, "GET", "/api/v1/volumes/vm1", None);
    assert_eq!(status, 200);
    assert_eq!(
        (d["mapped_blocks"].as_u64(), d["exclusive_blocks"].as_u64()),
        (Some(256), Some(0)),
        "{d}"
    );
    assert_eq!(d["snapshots"][0]["name"], "golden");
    let (_, p) = call(&srv, "GET", "/api/v1/pool", None);
    assert_eq!(p["logical_written_bytes"], 3u64 << 20, "{p}");
    assert_eq!(
        p["unique_chunks"], 1,
        "one 0x42 block shared by everything: {p}"
    );
    // Resize, delete a snapshot and a volume.
    assert_eq!(
        call(
            &srv,
            "POST",
            "/api/v1/volumes/vm2/resize",
            Some(r#"{"size":"2M"}"#)
        )
        .0,
        204
    );
    assert_eq!(
        call(&srv, "GET", "/api/v1/volumes/vm2", None).1["size_bytes"],
        2u64 << 20
    );
    assert_eq!(
        call(&srv, "DELETE", "/api/v1/volumes/vm1/snapshots/golden", None).0,
        204
    );
    assert_eq!(call(&srv, "DELETE", "/api/v1/volumes/vm1", None).0, 204);
    run(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x42 0 1M", &srv.url("c1")],
    );
}

#[test]
fn bad_requests_get_precise_json_errors_and_change_nothing() {
    let srv = Server::start(&["--no-default-volume", "--volume", "v=1M"]);
    let cases: [(&str, &str, Option<&str>, u16, &str); 11] = [
        ("GET", "/api/v1/volumes/nope", None, 404, "not_found"),
        ("GET", "/api/v1/pool?sync=maybe", None, 400, "bad_request"),
        ("GET", "/api/v1/pool?fresh=1", None, 400, "bad_request"),
        (
            "POST",
            "/api/v1/volumes",
            Some(r#"{"name":"v","size":"1M"}"#),
            409,
            "already_exists",
        ),
        (
            "POST",
            "/api/v1/volumes",
            Some(r#"{"name":"bad/name","size":"1M"}"#),
            400,
            "invalid_argument",
        ),
        (
            "POST",
            "/api/v1/volumes",
            Some(r#"{"name":"odd","size":1000}"#),
            400,
            "invalid_argument",
        ),
        (
            "POST",
            "/api/v1/volumes",
            Some(r#"{"name":"x","size":"10Q"}"#),
            400,
            "bad_request",
        ),
        (
            "POST",
            "/api/v1/volumes/v/resize",
            Some(r#"{"size":"512K"}"#),
            400,
            "invalid_argument",
        ),
        (
            "DELETE",
            "/api/v1/volumes/v/snapshots/none",
            None,
            404,
            "not_found",
        ),
        (
            "POST",
            "/api/v1/volumes/v/clone",
            Some(r#"{"name":"v"}"#),
            409,
            "already_exists",
        ),
        (
            "POST",
            "/api/v1/volumes/v/clone",
            Some(r#"{"name":"c","snapshot":"none"}"#),
            404,
            "not_found",
        ),
    ];
    for (method, path, body, want_status, want_code) in cases {
        let (status, v) = call(&srv, method, path, body);
        assert_eq!(
            (status, v["code"].as_str()),
            (want_status, Some(want_code)),
            "{method} {path}: {v}"
        );
        assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    // Malformed JSON is refused by the framework with a 4xx, and nothing changed.
    let (status, _) = call(&srv, "POST", "/api/v1/volumes", Some("{not json"));
    assert!((400..500).contains(&status), "{status}");
    let (_, list) = call(&srv, "GET", "/api/v1/volumes", None);
    assert_eq!(list.as_array().map(Vec::len), Some(1));
    assert_eq!(list[0]["size_bytes"], 1u64 << 20);
}

/// Sends raw bytes to the API (its `host: x` line replaced by the server's address and the
/// header state changes need), then reads until the server closes the connection (at most 15 s);
/// returns what it answered and how long that took.
fn raw_http(srv: &Server, request: &[u8]) -> (String, std::time::Duration) {
    use std::io::{Read, Write};
    let mut conn =
        std::net::TcpStream::connect(srv.http.as_deref().expect("API running")).expect("connect");
    conn.set_read_timeout(Some(std::time::Duration::from_secs(15)))
        .expect("timeout");
    let started = std::time::Instant::now();
    // The server refuses requests for other hosts, and state changes without its header.
    let host = format!(
        "host: {}\r\nx-ibid-request: 1\r\n",
        srv.http.as_deref().expect("API running")
    );
    let request = String::from_utf8_lossy(request).replace("host: x\r\n", &host);
    conn.write_all(request.as_bytes()).expect("send");
    let mut answer = Vec::new();
    let _ = conn.read_to_end(&mut answer);
    (
        String::from_utf8_lossy(&answer).into_owned(),
        started.elapsed(),
    )
}

/// The JSON body of a raw HTTP answer.
fn raw_json(answer: &str) -> Value {
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer:?}"))
}

#[test]
fn unknown_routes_oversized_bodies_and_stalled_requests_get_json_errors() {
    let srv = Server::start(&[
        "--no-default-volume",
        "--volume",
        "v=1M",
        "--http-timeout",
        "2",
    ]);
    // Unknown routes and methods: the API's JSON error shape, not an empty 404.
    // (`/` is the web dashboard.)
    for path in ["/api/v1/nope", "/api/v2/volumes", "/nope"] {
        let (status, v) = call(&srv, "GET", path, None);
        assert_eq!(
            (status, v["code"].as_str()),
            (404, Some("not_found")),
            "{v}"
        );
        assert!(
            v["message"].as_str().is_some_and(|m| m.contains(path)),
            "{v}"
        );
    }
    let (status, v) = call(&srv, "PUT", "/api/v1/volumes", Some("{}"));
    assert_eq!(
        (status, v["code"].as_str()),
        (405, Some("method_not_allowed")),
        "{v}"
    );
    // A body above 64 KiB: 413 with the JSON error, and nothing created.
    let padding = "x".repeat(80 << 10);
    let body = format!(r#"{{"name":"big","size":"1M","pad":"{padding}"}}"#);
    let (status, v) = call(&srv, "POST", "/api/v1/volumes", Some(&body));
    assert_eq!(
        (status, v["code"].as_str()),
        (413, Some("too_large")),
        "{v}"
    );
    // Declared far above the limit: refused at once, before any of it is read.
    let (answer, _) = raw_http(
        &srv,
        b"POST /api/v1/volumes HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
          content-length: 1000000000\r\n\r\n{",
    );
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer:?}");
    assert_eq!(raw_json(&answer)["code"], "too_large");
    // A body that stops arriving: 408 after the request timeout (2 s here), JSON.
    let (answer, took) = raw_http(
        &srv,
        b"POST /api/v1/volumes HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
          content-length: 100\r\n\r\n{\"name\":",
    );
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert_eq!(raw_json(&answer)["code"], "timeout");
    assert!(took >= std::time::Duration::from_millis(1900), "{took:?}");
    assert!(took < std::time::Duration::from_secs(10), "{took:?}");
    // Headers that stop arriving: the connection is closed after the timeout.
    let (answer, took) = raw_http(&srv, b"GET /api/v1/pool HTTP/1.1\r\nhost: x\r\n");
    assert!(!answer.contains("200 OK"), "{answer:?}");
    assert!(took >= std::time::Duration::from_millis(1900), "{took:?}");
    assert!(took < std::time::Duration::from_secs(10), "{took:?}");
    // Nothing above changed the pool, and the API still answers.
    let (status, list) = call(&srv, "GET", "/api/v1/volumes", None);
    assert_eq!(status, 200);
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
}

/// `GET /api/v1/pool` commits first (exact figures); `?sync=false` answers the last
/// committed figures without a commit — counted by the commits metric (each exact answer
/// takes one, empty or not; the background's own come once a second).
#[test]
fn pool_stats_without_sync_make_no_commit() {
    let srv = Server::start(&["--no-default-volume", "--volume", "v=1M"]);
    let commits = || -> u64 {
        let page = common::run(
            "curl",
            &[
                "-s",
                "-S",
                &format!("http://{}/metrics", srv.http.as_deref().expect("API")),
            ],
        );
        page.lines()
            .find_map(|l| l.strip_prefix("ibid_pool_commits_total ")?.parse().ok())
            .expect("ibid_pool_commits_total on /metrics")
    };
    let exact = |path: &str| {
        let (status, v) = call(&srv, "GET", path, None);
        assert_eq!(status, 200, "{path}: {v}");
        v
    };
    let c0 = commits();
    exact("/api/v1/pool");
    let mut synced = Value::Null;
    for _ in 0..9 {
        synced = exact("/api/v1/pool?sync=true");
    }
    let c1 = commits();
    assert!(c1 >= c0 + 10, "ten exact answers, {} commits", c1 - c0);
    let started = std::time::Instant::now();
    let mut last = Value::Null;
    for _ in 0..10 {
        last = exact("/api/v1/pool?sync=false");
    }
    let c2 = commits();
    // The background's commits meanwhile: one a second, and one more either side.
    let background = started.elapsed().as_secs() + 2;
    assert!(
        c2 - c1 <= background,
        "ten answers without sync, {} commits in {:?}",
        c2 - c1,
        started.elapsed()
    );
    // Nothing was written: the figures are those of the exact answer.
    for key in [
        "physical_bytes",
        "provisioned_bytes",
        "logical_written_bytes",
        "volumes",
    ] {
        assert_eq!(last[key], synced[key], "{key}");
    }
}
