//! Disk formats and space through a running `ibid serve`: thin, lazy- and eager-zeroed thick
//! volumes and their conversions over the API, reservations holding when thin volumes fill the
//! pool (data written with real NBD clients), accounting to the block, the OpenAPI document,
//! and the bearer token.

mod common;

use common::{api_call as call, api_call_as, output, run, Server};
use serde_json::Value;
use std::path::Path;

const BLOCK: u64 = 4096;

/// Pool space a thick volume reserves per block (`ibid_engine::RESERVED_BYTES_PER_BLOCK`).
const RESERVED_PER_BLOCK: u64 = 4096 + 24 + 512;

/// Writes `len` bytes of incompressible pseudo-random data, different for each seed.
fn random_file(path: &Path, len: usize, seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut data = vec![0u8; len];
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    std::fs::write(path, data).expect("write data file");
}

/// Copies `file` onto the export at `url` with nbdcopy, then compares them with qemu-img.
fn copy_in_and_compare(file: &Path, url: &str) {
    let file = file.to_str().expect("path");
    run("nbdcopy", &[file, url]);
    run(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", file, url],
    );
}

fn ok(srv: &Server, method: &str, path: &str, body: Option<&str>, want: u16) -> Value {
    let (status, v) = call(srv, method, path, body);
    assert_eq!(status, want, "{method} {path}: {v}");
    v
}

fn expect_error(srv: &Server, method: &str, path: &str, body: Option<&str>, want: (u16, &str)) {
    let (status, v) = call(srv, method, path, body);
    assert_eq!(
        (status, v["code"].as_str()),
        (want.0, Some(want.1)),
        "{method} {path}: {v}"
    );
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

#[test]
fn formats_are_created_in_constant_time_and_converted_as_metadata() {
    let srv = Server::start(&[
        "--no-default-volume",
        "--capacity",
        "3T",
        "--capacity-force",
    ]);
    let tib_blocks = (1u64 << 40) / BLOCK;
    let v = ok(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name":"thin","size":"1P"}"#),
        201,
    );
    assert_eq!(
        (v["format"].as_str(), v["reserved_bytes"].as_u64()),
        (Some("thin"), Some(0))
    );
    let v = ok(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name":"lazy","size":"1T","format":"lazyzeroedthick"}"#),
        201,
    );
    assert_eq!(v["tbz_blocks"], tib_blocks, "{v}");
    assert_eq!(v["reserved_bytes"], tib_blocks * RESERVED_PER_BLOCK, "{v}");
    let v = ok(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name":"eager","size":"1T","format":"eagerzeroedthick"}"#),
        201,
    );
    assert_eq!(
        (v["tbz_blocks"].as_u64(), v["blocks"].as_u64()),
        (Some(0), Some(tib_blocks))
    );
    let p = ok(&srv, "GET", "/api/v1/pool", None, 200);
    // Their blocks, and the pool's headroom for thick volumes' overwrites (16 Ki blocks).
    let headroom = (16 << 10) * RESERVED_PER_BLOCK;
    assert_eq!(
        (&p["reserved_bytes"], &p["overwrite_headroom_bytes"]),
        (
            &Value::from(2 * tib_blocks * RESERVED_PER_BLOCK + headroom),
            &Value::from(headroom)
        ),
        "{p}"
    );
    assert_eq!(p["thick_provisioned_bytes"], 2u64 << 40, "{p}");
    let sum = ["used_bytes", "reserved_bytes", "free_bytes"]
        .iter()
        .map(|k| p[k].as_u64().expect("number"))
        .sum::<u64>();
    assert_eq!(sum, p["capacity_bytes"].as_u64().expect("capacity"), "{p}");
    // Nothing was written to create them.
    let segments = srv.pool_dir().join("segments");
    let data_bytes: u64 = std::fs::read_dir(&segments)
        .map(|d| {
            d.filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0);
    assert!(
        data_bytes < 1 << 20,
        "creating volumes wrote {data_bytes} bytes"
    );

    // The pool cannot promise another terabyte, nor a petabyte.
    expect_error(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name":"more","size":"1T","format":"eagerzeroedthick"}"#),
        (409, "cannot_reserve"),
    );
    expect_error(
        &srv,
        "POST",
        "/api/v1/volumes/thin/inflate",
        None,
        (409, "cannot_reserve"),
    );
    expect_error(
        &srv,
        "POST",
        "/api/v1/volumes/thin/eagerzero",
        None,
        (409, "wrong_format"),
    );
    expect_error(
        &srv,
        "POST",
        "/api/v1/volumes/lazy/inflate",
        None,
        (409, "wrong_format"),
    );
    expect_error(
        &srv,
        "POST",
        "/api/v1/volumes/lazy/format",
        Some(r#"{"format":"thick"}"#),
        (400, "bad_request"),
    );
    expect_error(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name":"x","size":"1G","format":"sparse"}"#),
        (400, "bad_request"),
    );
    expect_error(
        &srv,
        "POST",
        "/api/v1/volumes/nope/eagerzero",
        None,
        (404, "not_found"),
    );
    // Conversions: vmkfstools -k, back to thin, reserve, and inflate once there is room.
    let v = ok(&srv, "POST", "/api/v1/volumes/lazy/eagerzero", None, 200);
    assert_eq!(
        (v["format"].as_str(), v["tbz_blocks"].as_u64()),
        (Some("eagerzeroedthick"), Some(0))
    );
    let v = ok(&srv, "POST", "/api/v1/volumes/eager/inflate", None, 200);
    assert_eq!(
        v["format"], "eagerzeroedthick",
        "inflating an eager volume changes nothing"
    );
    let v = ok(
        &srv,
        "POST",
        "/api/v1/volumes/eager/format",
        Some(r#"{"format":"thin"}"#),
        200,
    );
    assert_eq!(
        (v["format"].as_str(), v["reserved_bytes"].as_u64()),
        (Some("thin"), Some(0))
    );
    let v = ok(&srv, "POST", "/api/v1/volumes/eager/reserve", None, 200);
    assert_eq!(v["format"], "lazyzeroedthick");
    ok(
        &srv,
        "POST",
        "/api/v1/volumes/eager/format",
        Some(r#"{"format":"thin"}"#),
        200,
    );
    ok(
        &srv,
        "POST",
        "/api/v1/volumes/lazy/format",
        Some(r#"{"format":"thin"}"#),
        200,
    );
    ok(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name":"small","size":"1G"}"#),
        201,
    );
    let v = ok(&srv, "POST", "/api/v1/volumes/small/inflate", None, 200);
    assert_eq!(
        v["reserved_bytes"],
        (1u64 << 30) / BLOCK * RESERVED_PER_BLOCK
    );
    // Growing a thick volume reserves the difference; beyond the pool it is refused.
    ok(
        &srv,
        "POST",
        "/api/v1/volumes/small/resize",
        Some(r#"{"size":"2G"}"#),
        204,
    );
    let v = ok(&srv, "GET", "/api/v1/volumes/small", None, 200);
    assert_eq!(
        v["reserved_bytes"],
        (2u64 << 30) / BLOCK * RESERVED_PER_BLOCK,
        "{v}"
    );
    expect_error(
        &srv,
        "POST",
        "/api/v1/volumes/small/resize",
        Some(r#"{"size":"4T"}"#),
        (409, "cannot_reserve"),
    );
    // Formats survive a restart.
    let dir = srv.stop();
    let srv = Server::start_in(dir, &[]);
    let v = ok(&srv, "GET", "/api/v1/volumes/small", None, 200);
    assert_eq!(
        (v["format"].as_str(), v["size_bytes"].as_u64()),
        (Some("eagerzeroedthick"), Some(2 << 30))
    );
    // Clones are thin unless asked otherwise.
    let v = ok(
        &srv,
        "POST",
        "/api/v1/volumes/small/clone",
        Some(r#"{"name":"c"}"#),
        201,
    );
    assert_eq!(v["format"], "thin");
    let v = ok(
        &srv,
        "POST",
        "/api/v1/volumes/small/clone",
        Some(r#"{"name":"c2","format":"lazyzeroedthick"}"#),
        201,
    );
    assert_eq!(v["format"], "lazyzeroedthick");
    expect_error(
        &srv,
        "POST",
        "/api/v1/volumes/thin/clone",
        Some(r#"{"name":"c3","format":"eagerzeroedthick"}"#),
        (409, "cannot_reserve"),
    );
    expect_error(&srv, "GET", "/api/v1/volumes/c3", None, (404, "not_found"));
}

#[test]
fn pool_settings_are_adjustable_and_guarded() {
    let srv = Server::start(&["--no-default-volume", "--capacity", "1G"]);
    ok(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name":"t","size":"512M","format":"eagerzeroedthick"}"#),
        201,
    );
    expect_error(
        &srv,
        "PATCH",
        "/api/v1/pool",
        Some(r#"{"capacity":"256M"}"#),
        (409, "cannot_reserve"),
    );
    expect_error(
        &srv,
        "PATCH",
        "/api/v1/pool",
        Some(r#"{"soft_threshold_pct":0}"#),
        (400, "invalid_argument"),
    );
    expect_error(
        &srv,
        "PATCH",
        "/api/v1/pool",
        Some(r#"{"capacity":"lots"}"#),
        (400, "bad_request"),
    );
    expect_error(
        &srv,
        "PATCH",
        "/api/v1/pool",
        Some(r#"{"colour":"red"}"#),
        (422, "bad_request"),
    );
    let p = ok(&srv, "GET", "/api/v1/pool", None, 200);
    assert_eq!(
        (
            p["capacity_bytes"].as_u64(),
            p["soft_threshold_pct"].as_u64()
        ),
        (Some(1 << 30), Some(80))
    );
    assert_eq!(p["soft_threshold_exceeded"], false, "{p}");
    // 512 MiB and 64 MiB of overwrite headroom reserved (with their metadata allowance) of
    // 800 MiB is past 80 %.
    let p = ok(
        &srv,
        "PATCH",
        "/api/v1/pool",
        Some(r#"{"capacity":"800M"}"#),
        200,
    );
    assert_eq!(
        (
            p["capacity_bytes"].as_u64(),
            p["soft_threshold_exceeded"].as_bool()
        ),
        (Some(800 << 20), Some(true))
    );
    let p = ok(
        &srv,
        "PATCH",
        "/api/v1/pool",
        Some(r#"{"soft_threshold_pct":99}"#),
        200,
    );
    assert_eq!(p["soft_threshold_exceeded"], false, "{p}");
}

/// Thin volumes fill the pool through NBD until writes fail; the thick volume still takes
/// every one of its blocks, and once thin writes have filled the pool again, overwrites every
/// one with new data; unmapping thin data lets thin volumes write again.
#[test]
fn thick_volume_keeps_its_promise_when_thin_volumes_fill_the_pool() {
    let srv = Server::start(&[
        "--no-default-volume",
        "--capacity",
        "48M",
        "--volume",
        "thin=1G",
    ]);
    ok(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name":"thick","size":"8M","format":"eagerzeroedthick"}"#),
        201,
    );
    let files = tempfile::tempdir().expect("tempdir");
    let big = files.path().join("big");
    random_file(&big, 48 << 20, 1);
    let fill = output("nbdcopy", &[big.to_str().expect("path"), &srv.url("thin")]);
    assert!(
        !fill.status.success(),
        "48 MiB of unique data fit in a 48 MiB pool with 8 MiB reserved"
    );
    let p = ok(&srv, "GET", "/api/v1/pool", None, 200);
    assert!(
        p["free_bytes"].as_u64().expect("free") < 1 << 20,
        "the thin volume did not fill the pool: {p}"
    );
    let mine = files.path().join("mine");
    random_file(&mine, 8 << 20, 2);
    copy_in_and_compare(&mine, &srv.url("thick"));
    let v = ok(&srv, "GET", "/api/v1/volumes/thick", None, 200);
    assert_eq!(
        (v["mapped_blocks"].as_u64(), v["reserved_bytes"].as_u64()),
        (Some(2048), Some(0)),
        "{v}"
    );
    let p = ok(&srv, "GET", "/api/v1/pool", None, 200);
    assert_eq!(
        p["overwrite_headroom_bytes"],
        2048 * RESERVED_PER_BLOCK,
        "{p}"
    );
    // Thin writes of new data at new offsets take what is left until they fail.
    let refill = [
        "import os",
        "off = 512 << 20",
        "try:",
        "    while off < 1 << 30:",
        "        h.pwrite(os.urandom(256 << 10), off)",
        "        off += 256 << 10",
        "except nbd.Error as e:",
        "    print('full', e.errno)",
        "h.flush()",
    ]
    .join("\n");
    let out = output("nbdsh", &["-u", &srv.url("thin"), "-c", &refill]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("full ENOSPC"),
        "thin writes did not fill the pool again: {said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let newer = files.path().join("newer");
    random_file(&newer, 8 << 20, 4);
    copy_in_and_compare(&newer, &srv.url("thick"));
    // Unmap the thin data; thin writes work again, without a restart.
    run(
        "qemu-io",
        &["-f", "raw", "-c", "discard 0 1G", &srv.url("thin")],
    );
    let again = files.path().join("again");
    random_file(&again, 4 << 20, 3);
    run(
        "nbdcopy",
        &[again.to_str().expect("path"), &srv.url("thin")],
    );
}

/// Known data written through NBD (unique, duplicate, zero, compressible) shows up in
/// `describe` and the pool's statistics exactly.
#[test]
fn accounting_matches_the_data_written_to_the_block() {
    let srv = Server::start(&["--no-default-volume", "--volume", "acct=64M"]);
    let files = tempfile::tempdir().expect("tempdir");
    let unique = files.path().join("unique");
    random_file(&unique, 1 << 20, 7);
    let script = [
        format!(
            "data = open({:?}, 'rb').read()",
            unique.to_str().expect("path")
        ),
        "h.pwrite(data, 0)".into(),
        "h.pwrite(data, 1 << 20)".into(),
        "h.zero(1 << 20, 2 << 20)".into(),
        r"h.pwrite(b'\x42' * (1 << 20), 3 << 20)".into(),
        "h.pwrite(bytes(1 << 20), 4 << 20)".into(),
        "h.flush()".into(),
    ]
    .join("\n");
    run("nbdsh", &["-u", &srv.url("acct"), "-c", &script]);
    let v = ok(&srv, "GET", "/api/v1/volumes/acct", None, 200);
    // 256 unique + 256 duplicate + 256 of one compressible block; zeros take nothing.
    assert_eq!(v["mapped_blocks"], 768, "{v}");
    assert_eq!(v["distinct_chunks"], 257, "{v}");
    assert_eq!(
        (v["unique_blocks"].as_u64(), v["shared_blocks"].as_u64()),
        (Some(768), Some(0)),
        "{v}"
    );
    let p = ok(&srv, "GET", "/api/v1/pool", None, 200);
    assert_eq!(p["logical_written_bytes"], 768 * BLOCK, "{p}");
    assert_eq!(p["unique_chunks"], 257, "{p}");
    assert_eq!(p["unique_bytes"], 257 * BLOCK, "{p}");
    // Random blocks are stored whole (4 KiB + a 24-byte record header); the 0x42 block
    // compresses to a few dozen bytes.
    let physical = p["physical_bytes"].as_u64().expect("physical");
    let compressed = physical - 256 * (BLOCK + 24);
    assert!((25..=100).contains(&compressed), "physical {physical}: {p}");
    assert_eq!(v["physical_bytes"], physical, "{v}");
    let ratio = p["data_reduction_ratio"].as_f64().expect("ratio");
    assert!(
        (ratio - (768.0 * 4096.0) / physical as f64).abs() < 1e-9,
        "{p}"
    );
    // A clone shares every block and adds nothing.
    ok(
        &srv,
        "POST",
        "/api/v1/volumes/acct/clone",
        Some(r#"{"name":"twin"}"#),
        201,
    );
    let v = ok(&srv, "GET", "/api/v1/volumes/acct", None, 200);
    assert_eq!(
        (v["unique_blocks"].as_u64(), v["shared_blocks"].as_u64()),
        (Some(0), Some(768)),
        "{v}"
    );
    let p2 = ok(&srv, "GET", "/api/v1/pool", None, 200);
    assert_eq!(
        (
            p2["physical_bytes"].as_u64(),
            p2["logical_written_bytes"].as_u64()
        ),
        (Some(physical), Some(2 * 768 * BLOCK))
    );
    // A range copy through the API shares blocks too, and reads back through NBD.
    ok(
        &srv,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name":"dst","size":"64M"}"#),
        201,
    );
    let r = ok(
        &srv,
        "POST",
        "/api/v1/volumes/dst/copy",
        Some(r#"{"source":"acct","source_offset":"3M","offset":"8M","length":"1M"}"#),
        200,
    );
    assert_eq!(
        (r["shared_bytes"].as_u64(), r["data_bytes"].as_u64()),
        (Some(1 << 20), Some(0)),
        "{r}"
    );
    let r = ok(
        &srv,
        "POST",
        "/api/v1/volumes/dst/copy",
        Some(r#"{"source":"acct","source_offset":512,"offset":512,"length":"1M"}"#),
        200,
    );
    assert_eq!(
        (r["shared_bytes"].as_u64(), r["data_bytes"].as_u64()),
        (Some((1 << 20) - 4096), Some(4096)),
        "{r}"
    );
    // Offsets with different alignments inside a block are copied as data, correctly.
    let r = ok(
        &srv,
        "POST",
        "/api/v1/volumes/dst/copy",
        Some(r#"{"source":"acct","source_offset":"3M","offset":"16M","length":"1M"}"#),
        200,
    );
    assert_eq!(r["shared_bytes"], 1 << 20, "{r}");
    let r = ok(
        &srv,
        "POST",
        "/api/v1/volumes/dst/copy",
        Some(r#"{"source":"dst","source_offset":"16M","offset":"20971008","length":"1M"}"#),
        200,
    );
    assert_eq!(
        (r["shared_bytes"].as_u64(), r["data_bytes"].as_u64()),
        (Some(0), Some(1 << 20)),
        "{r}"
    );
    run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "read -P 0x42 20971008 1M",
            &srv.url("dst"),
        ],
    );
    run(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x42 8M 1M", &srv.url("dst")],
    );
    expect_error(
        &srv,
        "POST",
        "/api/v1/volumes/dst/copy",
        Some(r#"{"source":"acct","source_offset":"63M","offset":0,"length":"2M"}"#),
        (400, "out_of_range"),
    );
    expect_error(
        &srv,
        "POST",
        "/api/v1/volumes/dst/copy",
        Some(r#"{"source":"nope"}"#),
        (404, "not_found"),
    );
}

/// Every operation the OpenAPI document lists is routed (an unrouted path answers the JSON
/// error 404 `no API route ...`, a routed one with another method 405 `method_not_allowed`).
#[test]
fn openapi_document_describes_the_routes() {
    let srv = Server::start(&["--no-default-volume"]);
    let doc = ok(&srv, "GET", "/api/v1/openapi.json", None, 200);
    assert_eq!(doc["openapi"], "3.0.3");
    let paths = doc["paths"].as_object().expect("paths");
    let mut operations = 0;
    for (path, item) in paths {
        for (method, op) in item.as_object().expect("path item") {
            let concrete = path.replace("{name}", "nope").replace("{snapshot}", "nope");
            let body = matches!(method.as_str(), "post" | "patch").then_some("{}");
            let (status, v) = call(&srv, &method.to_uppercase(), &concrete, body);
            assert!(
                v.is_object() || v.is_array(),
                "{method} {path} answered {status} without a JSON body"
            );
            let unrouted = v["code"] == "method_not_allowed"
                || v["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("no API route"));
            assert!(!unrouted, "{method} {path} is not routed: {status} {v}");
            assert!(
                op["summary"].is_string() && op["responses"].is_object(),
                "{method} {path}"
            );
            operations += 1;
        }
    }
    assert!(operations >= 17, "only {operations} operations documented");
    // Every route the server has is documented: a few undocumented guesses are not routed.
    for path in [
        "/api/v1/volumes/nope/snapshot",
        "/api/v1/pools",
        "/api/v2/pool",
    ] {
        let (status, v) = call(&srv, "GET", path, None);
        assert_eq!(
            (status, v["code"].as_str()),
            (404, Some("not_found")),
            "{path}"
        );
        assert!(
            v["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("no API route")),
            "{path}: {v}"
        );
    }
}

#[test]
fn api_token_is_required_when_configured_and_off_loopback() {
    let srv = Server::start(&["--no-default-volume", "--api-token", "s3cret"]);
    for token in [None, Some("wrong"), Some("s3cre"), Some("s3crett")] {
        let (status, v) = api_call_as(&srv, token, "GET", "/api/v1/pool", None);
        assert_eq!(
            (status, v["code"].as_str()),
            (401, Some("unauthorized")),
            "{token:?}: {v}"
        );
        let (status, _) = api_call_as(
            &srv,
            token,
            "POST",
            "/api/v1/volumes",
            Some(r#"{"name":"x","size":"1G"}"#),
        );
        assert_eq!(status, 401);
    }
    let (status, v) = api_call_as(&srv, Some("s3cret"), "GET", "/api/v1/volumes", None);
    assert_eq!(
        (status, v.as_array().map(Vec::len)),
        (200, Some(0)),
        "nothing was created: {v}"
    );
    // Listening beyond loopback without a token is refused at start.
    let dir = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ibid"))
        .args([
            "serve",
            "--nbd",
            "127.0.0.1:0",
            "--iscsi",
            "off",
            "--http",
            "0.0.0.0:0",
            "--data",
        ])
        .arg(dir.path().join("pool"))
        .env_remove("IBID_API_TOKEN")
        .output()
        .expect("run ibid serve");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bearer token"), "{err}");
}
