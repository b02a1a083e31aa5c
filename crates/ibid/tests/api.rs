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
    let cases: [(&str, &str, Option<&str>, u16, &str); 9] = [
        ("GET", "/api/v1/volumes/nope", None, 404, "not_found"),
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
