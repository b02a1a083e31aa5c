//! The web dashboard in a real browser (Debian's headless Chromium through chromedriver)
//! against a real `ibid serve`, with real NBD clients checking what the clicks did.

mod common;
mod webdriver;

use common::{api_call_as, run, Server};
use serde_json::json;
use std::sync::{RwLock, RwLockReadGuard};
use std::time::Duration;
use webdriver::{Driver, Session};

/// The timed page-load test measures with this held for writing; every other test holds it
/// for reading, so the timing is taken with no other server or browser of this binary busy
/// beside it (on two cores, the parallel web tests made it 1.5-2x slower).
static TIMING: RwLock<()> = RwLock::new(());

/// Held for a whole test that must not run while the timed test measures.
fn shared() -> RwLockReadGuard<'static, ()> {
    TIMING.read().unwrap_or_else(|e| e.into_inner())
}

const TOKEN: &str = "web-test-token";
const HOSTILE: &str = "<img src=x onerror=alert(1)>";
const WAIT: Duration = Duration::from_secs(15);

fn base(srv: &Server) -> String {
    format!("http://{}", srv.http.as_deref().expect("API running"))
}

/// Fails on any console entry of level SEVERE or WARNING except the API's expected refusals
/// (Chromium logs every 4xx answer of a fetch: the 401 before login, the 400 of a bad name).
fn assert_console_clean(s: &Session, expected_statuses: &[u16]) {
    let bad: Vec<(String, String)> = s
        .console()
        .into_iter()
        .filter(|(level, msg)| {
            let expected = msg.contains("/api/v1/")
                && expected_statuses
                    .iter()
                    .any(|c| msg.contains(&format!("status of {c} ")));
            (level == "SEVERE" || level == "WARNING") && !expected
        })
        .collect();
    assert!(bad.is_empty(), "browser console: {bad:#?}");
}

/// Every form field has a label and every button and link a name a screen reader can say.
fn assert_labelled(s: &Session, page: &str) {
    let unlabelled = s.script(
        "const out = [];
         for (const el of document.querySelectorAll('main input, main select, dialog input')) {
           if (!(el.labels && el.labels.length) && !el.getAttribute('aria-label')) out.push(el.outerHTML);
         }
         for (const el of document.querySelectorAll('button, a[href]')) {
           const name = (el.getAttribute('aria-label') || el.textContent || '').trim();
           if (!name) out.push(el.outerHTML);
         }
         return out;",
        &[],
    );
    assert_eq!(unlabelled, json!([]), "{page}: elements without a name");
}

/// Presses Tab until the element with `id` has the focus (at most `max` presses).
fn tab_to(s: &Session, id: &str, max: usize) {
    for _ in 0..max {
        if s.script(
            "return document.activeElement && document.activeElement.id",
            &[],
        ) == json!(id)
        {
            return;
        }
        s.press("\u{E004}");
    }
    panic!("#{id} not reached with {max} Tab presses");
}

/// Waits until the dashboard shows the page of `route` (e.g. `/volumes/web1`), data loaded.
fn wait_page(s: &Session, route: &str) {
    s.wait_until(
        &format!("page {route}"),
        &format!(
            "return document.querySelector('#main').dataset.route === {}",
            json!(route)
        ),
        WAIT,
    );
}

fn screenshots_dir() -> Option<std::path::PathBuf> {
    std::env::var_os("IBID_WEB_SCREENSHOTS").map(std::path::PathBuf::from)
}

/// The dashboard end to end in Chromium: token login; create a volume and see it with nbdinfo;
/// hostile names (refused volume name, accepted iSCSI initiator name) shown as text; snapshot and clone in the UI and the clone's data read over
/// NBD; range copy, resize and format conversion; delete with a confirmation that names what
/// is lost; nonzero IOPS on the charts while
/// fio writes; the soft-threshold banner; keyboard reachability, labels, a 390-px phone; and
/// no errors in the browser console.
#[test]
fn dashboard_in_chromium() {
    let _quiet = shared();
    common::require("chromium");
    common::require("chromedriver");
    let srv = Server::start(&[
        "--no-default-volume",
        "--capacity",
        "1G",
        "--api-token",
        TOKEN,
    ]);
    let driver = Driver::start();
    let s = driver.session(1280, 800);
    let url = base(&srv);

    // Token login: a wrong token is refused, the right one opens the overview.
    s.goto(&format!("{url}/"));
    let field = s.wait_for("#login[open] #login-token", WAIT);
    s.type_into(&field, "wrong");
    s.click(&s.wait_for("#login-form button[type=submit]", WAIT));
    s.wait_until(
        "wrong token refused",
        "return document.querySelector('#login-error').textContent.includes('refused')",
        WAIT,
    );
    s.type_into(&field, TOKEN);
    s.click(&s.wait_for("#login-form button[type=submit]", WAIT));
    wait_page(&s, "/");
    assert!(s.find("#login[open]").is_none(), "login dialog still open");
    // All is well: the banner says nothing.
    assert_eq!(
        s.script("return document.querySelector('#health').hidden", &[]),
        json!(true)
    );
    assert_labelled(&s, "overview");
    let overview = s.text_of("main");
    assert!(
        overview.contains("dedup 1 × compression 1")
            && overview.contains("Thin provisioning saves"),
        "{overview}"
    );

    // Create a volume in the UI; nbdinfo sees it.
    s.goto(&format!("{url}/#/volumes"));
    wait_page(&s, "/volumes");
    s.type_into(&s.wait_for("#new-name", WAIT), "web1");
    s.type_into(&s.wait_for("#new-size", WAIT), "64M");
    s.click(&s.wait_for("#create-volume", WAIT));
    s.wait_for("tr[data-volume=\"web1\"]", WAIT);
    // Its space figures (describe's) fill in: nothing written yet.
    s.wait_until(
        "web1's physical space in the table",
        "const c = document.querySelector('tr[data-volume=\"web1\"] td[data-col=\"physical\"]'); return c && c.textContent === '0 B'",
        WAIT,
    );
    let info = run("nbdinfo", &["--json", &srv.url("web1")]);
    let info: serde_json::Value = serde_json::from_str(&info).expect("nbdinfo JSON");
    assert_eq!(
        info["exports"][0]["export-size"],
        json!(64u64 << 20),
        "{info}"
    );
    assert_labelled(&s, "volumes");

    // A hostile name: refused by the engine (names are [A-Za-z0-9._-]), and the error that
    // quotes it is shown as text, not markup.
    s.type_into(&s.wait_for("#new-name", WAIT), HOSTILE);
    s.click(&s.wait_for("#create-volume", WAIT));
    s.wait_until(
        "the hostile name quoted as text",
        &format!(
            "return document.querySelector('main form .error').textContent.includes({})",
            json!(HOSTILE)
        ),
        WAIT,
    );
    // The same name in the address: a "not found" page quoting it.
    s.goto(&format!("{url}/#/volumes/{}", percent(HOSTILE)));
    s.wait_until(
        "the hostile name in the address quoted as text",
        &format!(
            "return document.querySelector('main').textContent.includes({})",
            json!(HOSTILE)
        ),
        WAIT,
    );
    assert_eq!(
        s.script("return document.querySelectorAll('img').length", &[]),
        json!(0)
    );
    assert!(!s.alert_open(), "the hostile name ran a script");

    // A hostile string the array does accept: an iSCSI initiator's name, shown among the
    // volume's clients while it is connected.
    let initiator = format!("iqn.2026-01.example.evil:{HOSTILE}");
    let mut iscsi = std::process::Command::new("qemu-io")
        .args([
            "--image-opts",
            &format!(
                "driver=iscsi,transport=tcp,portal={},target={},lun=0,initiator-name={initiator}",
                srv.iscsi.as_deref().expect("iSCSI target"),
                common::IQN
            ),
            "-c",
            "read 0 4k",
            "-c",
            "sleep 20000",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start qemu-io");
    let deadline = std::time::Instant::now() + WAIT;
    while api_call_as(&srv, Some(TOKEN), "GET", "/api/v1/volumes/web1", None).1["clients"]
        .as_array()
        .is_none_or(Vec::is_empty)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the iSCSI client never showed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    s.goto(&format!("{url}/#/volumes/web1"));
    wait_page(&s, "/volumes/web1");
    assert!(
        s.text_of("main").contains(&initiator),
        "{}",
        s.text_of("main")
    );
    assert_eq!(
        s.script("return document.querySelectorAll('img').length", &[]),
        json!(0)
    );
    assert!(!s.alert_open(), "the initiator name ran a script");
    let _ = iscsi.kill();
    let _ = iscsi.wait();

    // Data in web1, then a snapshot and a clone of it, both made in the UI.
    run(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0xab 0 1M", &srv.url("web1")],
    );
    let (status, _) = api_call_as(
        &srv,
        Some(TOKEN),
        "PATCH",
        "/api/v1/volumes/web1/qos",
        Some(r#"{"write_iops": 5000}"#),
    );
    assert_eq!(status, 200);
    // (The page shows web1 already: load it again.)
    s.refresh();
    wait_page(&s, "/volumes/web1");
    assert_labelled(&s, "volume");
    assert!(
        s.text_of("main").contains("write IOPS 5,000"),
        "{}",
        s.text_of("main")
    );
    s.type_into(&s.wait_for("#snap-name", WAIT), "s1");
    s.click(&s.wait_for("#act-snapshot button[type=submit]", WAIT));
    s.wait_for("tr[data-snapshot=\"s1\"]", WAIT);
    // Overwrite the live volume: the clone of s1 must still read 0xab.
    run(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0xcd 0 1M", &srv.url("web1")],
    );

    // The capacity bar splits the data: s1 alone keeps web1's old data now (snapshot-only),
    // web1's new data is its own (unique). "Recompute now" asks for the breakdown at once.
    s.goto(&format!("{url}/#/"));
    wait_page(&s, "/");
    s.click(&s.wait_for("#breakdown-now", WAIT));
    s.wait_until(
        "snapshot-only and unique data in the capacity bar",
        "const part = (p) => document.querySelector(`.legend li[data-part=\"${p}\"]`);
         const some = (p) => part(p) && !part(p).textContent.includes(': 0 B');
         return some('snap') && some('uniq') && document.querySelector('.bar .seg.snap') !== null",
        WAIT,
    );
    let (_, pool) = api_call_as(&srv, Some(TOKEN), "GET", "/api/v1/pool", None);
    let b = &pool["breakdown"];
    assert!(b["snapshot_only_chunks"].as_u64() >= Some(1), "{pool}");
    assert!(b["unique_chunks"].as_u64() >= Some(1), "{pool}");
    let split: u64 = ["unique", "shared", "snapshot_only"]
        .iter()
        .map(|k| b[format!("{k}_physical_bytes")].as_u64().expect("bytes"))
        .sum();
    assert_eq!(
        split,
        pool["physical_bytes"].as_u64().expect("physical"),
        "{pool}"
    );
    assert!(
        s.text_of("#breakdown-age").contains("computed"),
        "{}",
        s.text_of("#breakdown-age")
    );

    // The volume table: web1's unique and shared space (from the same breakdown, for every
    // row), its LUN, and a schedule set below.
    s.goto(&format!("{url}/#/volumes"));
    wait_page(&s, "/volumes");
    let (_, web1) = api_call_as(&srv, Some(TOKEN), "GET", "/api/v1/volumes/web1", None);
    let cell = |col: &str| s.text_of(&format!("tr[data-volume=\"web1\"] td[data-col=\"{col}\"]"));
    assert_eq!(cell("unique"), "1 MiB");
    assert_eq!(cell("lun"), web1["lun"].to_string());

    // LUNs on the volume page: move web1 to LUN 9, export s1 read-only and read it over
    // iSCSI with qemu-io.
    s.goto(&format!("{url}/#/volumes/web1"));
    wait_page(&s, "/volumes/web1");
    s.type_into(&s.wait_for("#lun-to", WAIT), "9");
    s.click(&s.wait_for("#act-iscsi-lun button[type=submit]", WAIT));
    s.wait_until(
        "LUN 9 shown",
        "return document.querySelector('#volume-lun')?.textContent === '9'",
        WAIT,
    );
    let (_, web1) = api_call_as(&srv, Some(TOKEN), "GET", "/api/v1/volumes/web1", None);
    assert_eq!(web1["lun"], json!(9), "{web1}");
    s.click(&s.wait_for(
        "button[aria-label=\"Export snapshot s1 as an iSCSI LUN\"]",
        WAIT,
    ));
    s.wait_until(
        "s1's LUN shown",
        "return document.querySelector('tr[data-snapshot=\"s1\"] td[data-col=\"lun\"]')?.textContent.includes('read-only')",
        WAIT,
    );
    let (_, snaps) = api_call_as(
        &srv,
        Some(TOKEN),
        "GET",
        "/api/v1/volumes/web1/snapshots",
        None,
    );
    let snap_lun = snaps[0]["lun"].as_u64().expect("s1 exported");
    assert!(
        s.text_of("tr[data-snapshot=\"s1\"]")
            .contains(&snap_lun.to_string()),
        "{}",
        s.text_of("tr[data-snapshot=\"s1\"]")
    );
    let read = run(
        "qemu-io",
        &[
            "-r",
            "--image-opts",
            &format!(
                "driver=iscsi,transport=tcp,portal={},target={},lun={snap_lun}",
                srv.iscsi.as_deref().expect("iSCSI target"),
                common::IQN
            ),
            "-c",
            "read -P 0xab 0 1M",
        ],
    );
    assert!(
        !read.contains("verification failed") && read.contains("read 1048576"),
        "{read}"
    );

    // A snapshot schedule set in the UI, shown with its next run.
    s.type_into(&s.wait_for("#schedule-every-input", WAIT), "1h");
    s.type_into(&s.wait_for("#schedule-keep-input", WAIT), "24");
    s.click(&s.wait_for("#act-schedule button[type=submit]", WAIT));
    s.wait_until(
        "the schedule shown",
        "return document.querySelector('#schedule-every')?.textContent.startsWith('1h (keeps 24')
           && document.querySelector('#schedule-next')?.textContent.length > 0",
        WAIT,
    );
    let (_, sched) = api_call_as(
        &srv,
        Some(TOKEN),
        "GET",
        "/api/v1/volumes/web1/schedule",
        None,
    );
    assert_eq!(
        (sched["every_s"].as_u64(), sched["keep"].as_u64()),
        (Some(3600), Some(24)),
        "{sched}"
    );
    s.goto(&format!("{url}/#/volumes"));
    wait_page(&s, "/volumes");
    assert!(
        cell("schedule").starts_with("every 1h, keep 24"),
        "{}",
        cell("schedule")
    );
    s.goto(&format!("{url}/#/volumes/web1"));
    wait_page(&s, "/volumes/web1");

    s.type_into(&s.wait_for("#clone-name", WAIT), "web1-clone");
    s.click(&s.wait_for("#clone-source option[value=\"s1\"]", WAIT));
    s.click(&s.wait_for("#act-clone button[type=submit]", WAIT));
    s.wait_until(
        "the clone's page",
        "return location.hash === '#/volumes/web1-clone' && document.querySelector('#nbd-url')",
        WAIT,
    );
    let read = run(
        "qemu-io",
        &[
            "-r",
            "-f",
            "raw",
            "-c",
            "read -P 0xab 0 1M",
            &srv.url("web1-clone"),
        ],
    );
    assert!(!read.contains("verification failed"), "{read}");

    // Range copy, resize and format conversion in the UI, on the clone.
    wait_page(&s, "/volumes/web1-clone");
    s.type_into(&s.wait_for("#copy-source", WAIT), "web1@s1");
    s.type_into(&s.wait_for("#copy-offset", WAIT), "2M");
    s.type_into(&s.wait_for("#copy-length", WAIT), "1M");
    s.click(&s.wait_for("#act-range-copy button[type=submit]", WAIT));
    s.wait_until(
        "the copy reported",
        "return document.querySelector('#toast').textContent.startsWith('Copied 1 MiB')",
        WAIT,
    );
    let read = run(
        "qemu-io",
        &[
            "-r",
            "-f",
            "raw",
            "-c",
            "read -P 0xab 2M 1M",
            &srv.url("web1-clone"),
        ],
    );
    assert!(!read.contains("verification failed"), "{read}");
    wait_page(&s, "/volumes/web1-clone");
    s.type_into(&s.wait_for("#resize-size", WAIT), "128M");
    s.click(&s.wait_for("#act-resize button[type=submit]", WAIT));
    s.wait_until(
        "the new size shown",
        "return document.querySelector('main .page > p.muted')?.textContent.includes('128 MiB')",
        WAIT,
    );
    let info = run("nbdinfo", &["--size", &srv.url("web1-clone")]);
    assert_eq!(info.trim(), (128u64 << 20).to_string());
    wait_page(&s, "/volumes/web1-clone");
    s.click(&s.wait_for("#format-to option[value=\"eagerzeroedthick\"]", WAIT));
    s.click(&s.wait_for("#act-format button[type=submit]", WAIT));
    s.wait_until(
        "the new format shown",
        "return document.querySelector('main .page > p.muted')?.textContent.startsWith('eagerzeroedthick')",
        WAIT,
    );
    let (_, v) = api_call_as(&srv, Some(TOKEN), "GET", "/api/v1/volumes/web1-clone", None);
    assert_eq!(v["format"], "eagerzeroedthick", "{v}");

    // Delete with confirmation, reached by keyboard: the dialog names what is lost and
    // deletes only once the name is typed.
    wait_page(&s, "/volumes/web1-clone");
    tab_to(&s, "delete-volume", 200);
    s.press("\u{E007}"); // Enter
    s.wait_for("#confirm[open]", WAIT);
    let body = s.text_of("#confirm-body");
    assert!(
        body.contains("web1-clone") && body.contains("128 MiB"),
        "{body}"
    );
    assert_eq!(
        s.script("return document.querySelector('#confirm-ok').disabled", &[]),
        json!(true)
    );
    s.type_into(&s.wait_for("#confirm-input", WAIT), "web1-clone");
    s.click(&s.wait_for("#confirm-ok", WAIT));
    s.wait_until(
        "back at the list",
        "return location.hash === '#/volumes'",
        WAIT,
    );
    let (status, _) = api_call_as(&srv, Some(TOKEN), "GET", "/api/v1/volumes/web1-clone", None);
    assert_eq!(status, 404);

    // Charts: nonzero IOPS while fio writes over NBD.
    s.goto(&format!("{url}/#/"));
    wait_page(&s, "/");
    let mut fio = std::process::Command::new("fio")
        .args([
            "--name=w",
            "--ioengine=nbd",
            &format!("--uri={}", srv.url("web1")),
            "--rw=randwrite",
            "--bs=4k",
            "--size=32M",
            "--iodepth=4",
            "--time_based",
            "--runtime=8",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start fio");
    let iops = s.wait_until(
        "nonzero IOPS on the overview",
        "const n = Number(document.querySelector('#pool-now').dataset.iops); return n > 0 ? n : 0",
        WAIT,
    );
    assert!(iops.as_f64().unwrap_or(0.0) > 0.0, "{iops}");
    // The three charts are drawn; the 24 h range shows the writes too (the minute so far).
    assert_eq!(
        s.script(
            "return document.querySelectorAll('.plot canvas').length",
            &[]
        ),
        json!(3)
    );
    s.click(&s.wait_for("button[data-range=\"86400\"]", WAIT));
    s.wait_until(
        "the 24 h range with nonzero IOPS",
        "const b = document.querySelector('button[data-range=\"86400\"]');
         const n = Number(document.querySelector('#pool-now').dataset.iops);
         return b && b.getAttribute('aria-pressed') === 'true' && n > 0",
        WAIT,
    );
    s.click(&s.wait_for("button[data-range=\"900\"]", WAIT));
    wait_page(&s, "/");
    if let Some(dir) = screenshots_dir() {
        std::thread::sleep(Duration::from_secs(3));
        s.screenshot(&dir.join("dashboard-overview.png"));
        s.goto(&format!("{url}/#/volumes"));
        wait_page(&s, "/volumes");
        s.screenshot(&dir.join("dashboard-volumes.png"));
        s.goto(&format!("{url}/#/volumes/web1"));
        wait_page(&s, "/volumes/web1");
        std::thread::sleep(Duration::from_secs(1));
        s.screenshot(&dir.join("dashboard-volume.png"));
    }
    assert!(fio.wait().expect("fio").success());

    // The soft-threshold banner: a thick volume reserves ~20 % of the 1 GiB pool; a 15 %
    // threshold set in the UI is passed.
    s.goto(&format!("{url}/#/volumes"));
    wait_page(&s, "/volumes");
    s.type_into(&s.wait_for("#new-name", WAIT), "thick");
    s.type_into(&s.wait_for("#new-size", WAIT), "128M");
    s.click(&s.wait_for("#new-format option[value=\"lazyzeroedthick\"]", WAIT));
    s.click(&s.wait_for("#create-volume", WAIT));
    s.wait_for("tr[data-volume=\"thick\"]", WAIT);
    s.goto(&format!("{url}/#/pool"));
    wait_page(&s, "/pool");
    assert_labelled(&s, "pool");
    // Every figure as text, the breakdown's included (no "[object Object]").
    let figures = s.text_of("main");
    assert!(
        figures.contains("breakdown unique physical bytes") && !figures.contains("[object"),
        "{figures}"
    );
    s.type_into(&s.wait_for("#pool-soft", WAIT), "15");
    s.click(&s.wait_for("#act-settings button[type=submit]", WAIT));
    let banner = s.wait_until(
        "the soft-threshold banner",
        "const b = document.querySelector('#health'); return !b.hidden && b.textContent",
        WAIT,
    );
    assert!(
        banner
            .as_str()
            .is_some_and(|b| b.contains("soft threshold of 15 %")),
        "{banner}"
    );
    if let Some(dir) = screenshots_dir() {
        s.screenshot(&dir.join("dashboard-pool.png"));
    }

    // Signing out forgets the token: the login comes back.
    s.click(&s.wait_for("#sign-out:not([hidden])", WAIT));
    s.wait_for("#login[open]", WAIT);
    let field = s.wait_for("#login-token", WAIT);
    s.type_into(&field, TOKEN);
    s.click(&s.wait_for("#login-form button[type=submit]", WAIT));
    wait_page(&s, "/pool");

    // A 390-pixel-wide phone: nothing wider than the screen.
    s.set_viewport(390, 844);
    for (hash, name) in [
        ("#/", "overview"),
        ("#/volumes", "volumes"),
        ("#/volumes/web1", "volume"),
    ] {
        s.goto(&format!("{url}/{hash}"));
        wait_page(&s, &hash[1..]);
        let overflow = s.script(
            "return document.documentElement.scrollWidth - window.innerWidth",
            &[],
        );
        assert!(
            overflow.as_i64().is_some_and(|o| o <= 0),
            "{hash}: {overflow} px too wide"
        );
        if let Some(dir) = screenshots_dir() {
            s.screenshot(&dir.join(format!("dashboard-phone-{name}.png")));
        }
    }

    // The 401 before login, the 400 of the hostile name, the 404 of its page.
    assert_console_clean(&s, &[401, 400, 404]);
}

/// Percent-encodes everything but letters and digits.
fn percent(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Runs `curl` with `args` against the server; returns (status, headers lower-cased, body).
fn curl(args: &[&str]) -> (u16, String, String) {
    let mut all = vec!["-s", "-S", "-i"];
    all.extend_from_slice(args);
    let out = run("curl", &all);
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_string())
}

fn code_of(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["code"].as_str().map(str::to_string))
        .unwrap_or_default()
}

/// What a hostile page can send, sent with curl: a rebound name, form and `no-cors` posts,
/// a foreign `Origin`, a cross-site fetch, a CORS preflight. Each is refused and changes
/// nothing; the server's own kind of request still works; every answer carries the CSP.
#[test]
fn hostile_requests_are_refused() {
    let _quiet = shared();
    let srv = Server::start(&["--no-default-volume", "--http-allowed-host", "array.test"]);
    let addr = srv.http.clone().expect("API");
    let port = addr.rsplit(':').next().expect("port").to_string();
    let url = base(&srv);
    let volumes = format!("{url}/api/v1/volumes");
    let body = r#"{"name":"evil","size":"1M"}"#;

    // DNS rebinding: evil.test resolves to the server, but its Host is refused everywhere.
    let rebind = format!("evil.test:{port}:127.0.0.1");
    for path in ["/", "/app.js", "/api/v1/volumes", "/metrics"] {
        let (status, _, b) = curl(&[
            "--resolve",
            &rebind,
            &format!("http://evil.test:{port}{path}"),
        ]);
        assert_eq!(
            (status, code_of(&b)),
            (403, "forbidden_host".into()),
            "{path}"
        );
    }
    // A name given with --http-allowed-host is served.
    let allowed = format!("array.test:{port}:127.0.0.1");
    let (status, _, _) = curl(&[
        "--resolve",
        &allowed,
        &format!("http://array.test:{port}/api/v1/pool"),
    ]);
    assert_eq!(status, 200);

    // Requests a page on another site can send without a preflight: refused.
    for (what, args) in [
        (
            "form post (text/plain)",
            vec!["-H", "content-type: text/plain", "-d", body],
        ),
        ("form post (urlencoded)", vec!["-d", "name=evil&size=1M"]),
        (
            "JSON without the header",
            vec!["-H", "content-type: application/json", "-d", body],
        ),
        (
            "the header but text/plain",
            vec![
                "-H",
                "x-ibid-request: 1",
                "-H",
                "content-type: text/plain",
                "-d",
                body,
            ],
        ),
        (
            "foreign Origin",
            vec![
                "-H",
                "x-ibid-request: 1",
                "-H",
                "content-type: application/json",
                "-H",
                "origin: http://evil.test",
                "-d",
                body,
            ],
        ),
        (
            "Sec-Fetch-Site: cross-site",
            vec![
                "-H",
                "x-ibid-request: 1",
                "-H",
                "content-type: application/json",
                "-H",
                "sec-fetch-site: cross-site",
                "-d",
                body,
            ],
        ),
    ] {
        let mut a = args.clone();
        a.push(&volumes);
        let (status, _, b) = curl(&a);
        assert!(status == 403 || status == 415, "{what}: {status} {b}");
        assert!(
            ["cross_site", "unsupported_media_type"].contains(&code_of(&b).as_str()),
            "{what}: {b}"
        );
    }
    // A CORS preflight gets no grant.
    let (status, head, _) = curl(&[
        "-X",
        "OPTIONS",
        "-H",
        "origin: http://evil.test",
        "-H",
        "access-control-request-method: POST",
        "-H",
        "access-control-request-headers: content-type, x-ibid-request",
        &volumes,
    ]);
    assert_eq!(status, 403);
    assert!(!head.contains("access-control-allow"), "{head}");
    // Nothing was created; a DELETE without the header changes nothing either.
    let (status, _) = api_call_as(
        &srv,
        None,
        "POST",
        "/api/v1/volumes",
        Some(r#"{"name":"ok","size":"1M"}"#),
    );
    assert_eq!(status, 201);
    let (status, _, _) = curl(&["-X", "DELETE", &format!("{volumes}/ok")]);
    assert_eq!(status, 403);
    let (_, list) = api_call_as(&srv, None, "GET", "/api/v1/volumes", None);
    let names: Vec<&str> = list
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(names, ["ok"]);

    // The page: a CSP allowing this origin's scripts only, no framing, no sniffing.
    let (status, head, html) = curl(&[&format!("{url}/")]);
    assert_eq!(status, 200);
    assert!(
        head.contains("content-security-policy: default-src 'none'; script-src 'self';"),
        "{head}"
    );
    assert!(
        !head.contains("unsafe-inline") && !head.contains("unsafe-eval"),
        "{head}"
    );
    assert!(
        head.contains("x-frame-options: deny") && head.contains("x-content-type-options: nosniff")
    );
    assert!(html.contains("<script src=\"/app.js\""), "{html}");
}

/// The same attacks from a real browser: a page on another origin (served here on another
/// port) posts a form, sends a `no-cors` fetch and a fetch with the custom header, and a
/// rebound name (`--host-resolver-rules`) loads the dashboard. None gets through.
#[test]
fn hostile_page_in_chromium_changes_nothing() {
    let _quiet = shared();
    common::require("chromium");
    common::require("chromedriver");
    let srv = Server::start(&["--no-default-volume"]);
    let api = format!("{}/api/v1/volumes", base(&srv));
    let page = format!(
        r#"<!doctype html><title>start</title>
<form id="f" method="POST" action="{api}" enctype="text/plain"><input name='{{"name":"csrf1","size":"1M","x":"' value='"}}'></form>
<script>
fetch({api:?}, {{method: 'POST', mode: 'no-cors', headers: {{'Content-Type': 'text/plain'}}, body: '{{"name":"csrf2","size":"1M"}}'}})
  .catch(() => null)
  .then(() => fetch({api:?}, {{method: 'POST', headers: {{'Content-Type': 'application/json', 'X-Ibid-Request': '1'}}, body: '{{"name":"csrf3","size":"1M"}}'}}))
  .then(r => {{ document.title = 'read ' + r.status; }}, () => {{ document.title = 'blocked'; }})
  .finally(() => setTimeout(() => document.getElementById('f').submit(), 1500));
</script>"#
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let evil = format!(
        "http://localhost:{}/",
        listener.local_addr().expect("addr").port()
    );
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for conn in listener.incoming().take(4) {
            let Ok(mut c) = conn else { continue };
            let mut buf = [0u8; 4096];
            let _ = c.read(&mut buf);
            let _ = write!(
                c,
                "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{page}",
                page.len()
            );
        }
    });
    let driver = Driver::start();
    let port = srv
        .http
        .as_deref()
        .expect("API")
        .rsplit(':')
        .next()
        .expect("port")
        .to_string();
    let s = driver.session_with(
        1280,
        800,
        &["--host-resolver-rules=MAP evil.test 127.0.0.1"],
    );
    s.goto(&evil);
    s.wait_until(
        "the hostile page's fetch with the header blocked (no CORS grant)",
        "return document.title === 'blocked'",
        WAIT,
    );
    // The form post lands on the API's refusal.
    s.wait_until(
        "the form post answered",
        "return location.href.includes('/api/v1/volumes') && document.body.textContent.includes('cross_site')",
        WAIT,
    );
    // DNS rebinding in the browser: the dashboard under a rebound name is refused.
    s.goto(&format!("http://evil.test:{port}/"));
    s.wait_until(
        "the rebound name refused",
        "return document.body.textContent.includes('forbidden_host')",
        WAIT,
    );
    let (_, list) = api_call_as(&srv, None, "GET", "/api/v1/volumes", None);
    assert_eq!(list, json!([]), "a hostile request created a volume");
}

/// Sends one JSON request with `agent` (the header state changes need included); fails the
/// test unless the answer is 2xx.
fn post_json(agent: &ureq::Agent, url: &str, body: &serde_json::Value) {
    let r = agent
        .post(url)
        .header("content-type", "application/json")
        .header("x-ibid-request", "1")
        .send(body.to_string())
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    assert!(r.status().is_success(), "POST {url}: {}", r.status());
}

/// The issue's goal: with 1,000 volumes and 10,000 snapshots the overview shows its data
/// within 300 ms of navigation (server time included) in headless Chromium; the volume table
/// of 1,000 rows too. Measured three times each after a warm-up; the figures are printed
/// (docs/ARCHITECTURE.md records them), and the test fails above 1 s (a loaded CI machine
/// gets slack, a regression does not).
#[test]
fn overview_renders_fast_with_1000_volumes_and_10000_snapshots() {
    common::require("chromium");
    common::require("chromedriver");
    let srv = Server::start(&["--no-default-volume"]);
    let url = base(&srv);
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .new_agent();
    let started = std::time::Instant::now();
    for i in 0..1000 {
        post_json(
            &agent,
            &format!("{url}/api/v1/volumes"),
            &json!({"name": format!("vm{i:04}"), "size": "10G"}),
        );
    }
    for j in 0..10_000 {
        post_json(
            &agent,
            &format!("{url}/api/v1/volumes/vm{:04}/snapshots", j % 1000),
            &json!({"name": format!("s{}", j / 1000)}),
        );
    }
    eprintln!(
        "created 1000 volumes and 10000 snapshots in {:?}",
        started.elapsed()
    );
    // The space breakdown behind the capacity bar, on this catalog (empty volumes: the cost
    // of walking 1,000 stacks; data adds the map entries read).
    let (status, b) = common::api_call(&srv, "POST", "/api/v1/pool/breakdown", Some("{}"));
    assert_eq!(status, 200, "{b}");
    eprintln!("space breakdown: {} ms", b["took_ms"]);
    let driver = Driver::start();
    let s = driver.session(1280, 800);
    let _alone = TIMING.write().unwrap_or_else(|e| e.into_inner());
    for (route, goal_ms) in [("/", 300.0), ("/volumes", 300.0)] {
        let mut ready = Vec::new();
        let mut paint = Vec::new();
        for round in 0..4 {
            s.goto("about:blank");
            s.goto(&format!("{url}/#{route}"));
            wait_page(&s, route);
            let v = s.script(
                "const r = performance.getEntriesByName(arguments[0])[0];
                 const p = performance.getEntriesByName('first-contentful-paint')[0];
                 return [r ? r.startTime : null, p ? p.startTime : null];",
                &[json!(format!("ibid-ready {route}"))],
            );
            if round > 0 {
                ready.push(v[0].as_f64().expect("ready mark"));
                paint.push(v[1].as_f64().unwrap_or(f64::NAN));
            }
        }
        ready.sort_by(f64::total_cmp);
        eprintln!(
            "{route}: data shown after {ready:?} ms (median {:.0}, goal {goal_ms}), first paint {paint:?} ms",
            ready[1]
        );
        assert!(ready[1] <= 1000.0, "{route}: {ready:?} ms");
    }
    assert_console_clean(&s, &[]);
}

/// The charts' data through the real server: qemu-io's writes appear in the pool's 1-second
/// series, in the volume's series and in the sparkline figures; windows out of range and
/// unknown parameters are refused with JSON errors.
#[test]
fn stats_history_follows_real_io() {
    let _quiet = shared();
    let srv = Server::start(&["--no-default-volume", "--volume", "h1=64M"]);
    std::thread::sleep(Duration::from_millis(1500));
    run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x5a 0 8M",
            "-c",
            "read 0 4M",
            &srv.url("h1"),
        ],
    );
    let wrote = |v: &serde_json::Value, col: &str| {
        v[col]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x.as_f64().is_some_and(|x| x > 0.0)))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let (status, pool) =
            api_call_as(&srv, None, "GET", "/api/v1/stats/history?seconds=300", None);
        assert_eq!(status, 200, "{pool}");
        let (_, vol) = api_call_as(&srv, None, "GET", "/api/v1/stats/history?volume=h1", None);
        let (_, all) = api_call_as(&srv, None, "GET", "/api/v1/stats/volumes", None);
        let done = wrote(&pool, "write_bytes_per_s")
            && wrote(&pool, "read_iops")
            && wrote(&vol, "write_iops")
            && all["volumes"]["h1"]
                .as_array()
                .is_some_and(|a| !a.is_empty());
        if done {
            assert_eq!(pool["interval_s"], 1);
            assert_eq!(vol["interval_s"], 5);
            let n = pool["t"].as_array().map_or(0, Vec::len);
            for col in [
                "read_iops",
                "write_iops",
                "read_latency_us",
                "write_latency_us",
            ] {
                assert_eq!(pool[col].as_array().map_or(0, Vec::len), n, "{col}");
            }
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no I/O in the history: {pool} {vol} {all}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    for (path, code) in [
        ("/api/v1/stats/history?seconds=0", "invalid_argument"),
        ("/api/v1/stats/history?seconds=86401", "invalid_argument"),
        ("/api/v1/stats/history?window=5", "bad_request"),
        ("/api/v1/stats/volumes?seconds=901", "invalid_argument"),
    ] {
        let (status, v) = api_call_as(&srv, None, "GET", path, None);
        assert_eq!(
            (status, v["code"].as_str()),
            (400, Some(code)),
            "{path}: {v}"
        );
    }
}

/// A failed pool (an fsync under the pool fails with EIO, so the engine stops writing): the
/// dashboard shows a dedicated red banner saying what failed and what to do, not the API's
/// raw error; the API answers 503 `pool_failed`.
#[test]
fn failed_pool_banner_in_chromium() {
    let _quiet = shared();
    common::require("chromium");
    common::require("chromedriver");
    common::require("fusermount");
    let fs = common::FaultFs::mount();
    let dir = tempfile::tempdir_in(&fs.mount).expect("tempdir on faultfs");
    let srv = Server::start_in(dir, &["--no-default-volume", "--volume", "f1=16M"]);
    let driver = Driver::start();
    let s = driver.session(1280, 800);
    let url = base(&srv);
    s.goto(&format!("{url}/"));
    wait_page(&s, "/");
    assert_eq!(
        s.script("return document.querySelector('#health').hidden", &[]),
        json!(true)
    );

    // A write whose flush meets EIO: the pool fails.
    fs.fail("fsync", "pool");
    let out = std::process::Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            "write -P 0x5a 0 64k",
            "-c",
            "flush",
            &srv.url("f1"),
        ])
        .output()
        .expect("run qemu-io");
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("Input/output error") || said.contains("EIO"),
        "{said}"
    );
    fs.heal();
    let (status, body) = common::api_call(&srv, "GET", "/api/v1/pool", None);
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("pool_failed")),
        "{body}"
    );

    let banner = s.wait_until(
        "the failed-pool banner",
        "const b = document.querySelector('#health');
         return !b.hidden && b.classList.contains('failed') && b.textContent",
        WAIT,
    );
    let banner = banner.as_str().unwrap_or_default().to_string();
    assert!(
        banner.contains("The pool has failed")
            && banner.contains("What failed:")
            && banner.contains("What to do:")
            && banner.contains("ibid pool verify"),
        "{banner}"
    );
    // The reason is the engine's, without the API's generic wrapping.
    assert!(!banner.contains("cannot be read"), "{banner}");
    let red = s.script(
        "return getComputedStyle(document.querySelector('#health')).backgroundColor",
        &[],
    );
    assert_eq!(red, json!("rgb(185, 28, 28)"));
    if let Some(dir) = screenshots_dir() {
        s.screenshot(&dir.join("dashboard-failed-pool.png"));
    }
    // Chromium logs the 503 answers of the pool poll.
    assert_console_clean(&s, &[503]);
    drop(s);
    // A failed pool does not close cleanly: kill the server, then unmount.
    drop(srv.kill());
}

/// The dashboard's files go gzip-compressed to a client that accepts it (`curl
/// --compressed` decodes them back to the embedded files), plain to one that does not, with
/// `Vary: Accept-Encoding` either way and an ETag per representation; all compressed files
/// together stay under the issue's 300 KiB.
#[test]
fn assets_are_served_gzipped() {
    let _quiet = shared();
    let srv = Server::start(&["--no-default-volume"]);
    let url = base(&srv);
    let web = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("web");
    let mut compressed_total = 0;
    for (path, file) in [
        ("/", "index.html"),
        ("/app.js", "app.js"),
        ("/app.css", "app.css"),
        ("/vendor/uPlot.iife.min.js", "vendor/uPlot.iife.min.js"),
        ("/vendor/uPlot.min.css", "vendor/uPlot.min.css"),
    ] {
        let original = std::fs::read_to_string(web.join(file)).expect("asset");
        // Compressed: fewer bytes on the wire, the same file once decoded.
        let head = run(
            "curl",
            &[
                "-s",
                "-D",
                "-",
                "-o",
                "/dev/null",
                "-H",
                "Accept-Encoding: gzip",
                &format!("{url}{path}"),
            ],
        )
        .to_ascii_lowercase();
        assert!(head.starts_with("http/1.1 200"), "{path}: {head}");
        assert!(head.contains("content-encoding: gzip"), "{path}: {head}");
        assert!(head.contains("vary: accept-encoding"), "{path}: {head}");
        let size = run(
            "curl",
            &[
                "-s",
                "-H",
                "Accept-Encoding: gzip",
                "-o",
                "/dev/null",
                "-w",
                "%{size_download}",
                &format!("{url}{path}"),
            ],
        );
        let size: usize = size.trim().parse().expect("size");
        assert!(
            size < original.len() / 2,
            "{path}: {size} of {}",
            original.len()
        );
        compressed_total += size;
        let (_, _, decoded) = curl(&["--compressed", &format!("{url}{path}")]);
        assert_eq!(decoded, original, "{path} decoded");
        let etag_gz = head
            .lines()
            .find_map(|l| l.strip_prefix("etag: "))
            .expect("etag")
            .trim()
            .to_string();
        // Plain for a client that does not accept gzip (or refuses it with q=0).
        for accept in ["Accept-Encoding: identity", "Accept-Encoding: gzip;q=0"] {
            let (status, head, body) = curl(&["-H", accept, &format!("{url}{path}")]);
            assert_eq!(status, 200);
            assert!(
                !head.contains("content-encoding"),
                "{path} {accept}: {head}"
            );
            assert!(head.contains("vary: accept-encoding"), "{path}: {head}");
            assert_eq!(body, original, "{path} {accept}");
            assert!(
                !head.contains(&format!("etag: {etag_gz}")),
                "one ETag for both"
            );
        }
        // Revalidation: the compressed representation's ETag gives a 304.
        let (status, _, _) = curl(&[
            "-H",
            "Accept-Encoding: gzip",
            "-H",
            &format!("If-None-Match: {etag_gz}"),
            &format!("{url}{path}"),
        ]);
        assert_eq!(status, 304, "{path}");
    }
    println!("dashboard assets compressed on the wire: {compressed_total} bytes");
    assert!(compressed_total <= 300 << 10, "{compressed_total}");
}

/// A snapshot schedule whose runs fail (its snapshot names are taken: snapshots named as its
/// next runs' were made first) brings up the health banner naming the volume and the error.
#[test]
fn failing_schedule_in_health_banner() {
    let _quiet = shared();
    common::require("chromium");
    common::require("chromedriver");
    let srv = Server::start(&["--no-default-volume", "--volume", "sch=16M"]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    // The names the runner gives its snapshots (`auto-YYYYMMDDTHHMMSSZ`, UTC), taken for the
    // next two minutes.
    for t in now..now + 120 {
        let name = run(
            "date",
            &["-u", "-d", &format!("@{t}"), "+auto-%Y%m%dT%H%M%SZ"],
        );
        let body = json!({ "name": name.trim() }).to_string();
        let (status, v) =
            common::api_call(&srv, "POST", "/api/v1/volumes/sch/snapshots", Some(&body));
        assert_eq!(status, 201, "{v}");
    }
    let driver = Driver::start();
    let s = driver.session(1280, 800);
    s.goto(&format!("{}/", base(&srv)));
    wait_page(&s, "/");
    assert_eq!(
        s.script("return document.querySelector('#health').hidden", &[]),
        json!(true)
    );
    let (status, v) = common::api_call(
        &srv,
        "PUT",
        "/api/v1/volumes/sch/schedule",
        Some(r#"{"every_s": 1, "keep": 100}"#),
    );
    assert_eq!(status, 200, "{v}");
    let banner = s.wait_until(
        "the failing schedule in the banner",
        "const b = document.querySelector('#health');
         return !b.hidden && b.textContent.includes('snapshot schedule of sch failed') && b.textContent",
        WAIT,
    );
    // The engine's error, as the API has it (each run names its own second's snapshot).
    let (_, sched) = common::api_call(&srv, "GET", "/api/v1/volumes/sch/schedule", None);
    let error = sched["last_error"].as_str().expect("a failed run");
    let why = "already has a snapshot named \"auto-";
    assert!(error.contains(why), "{error}");
    assert!(banner.as_str().is_some_and(|b| b.contains(why)), "{banner}");
    // Without a failure, the banner goes: the schedule removed.
    let (status, _) = common::api_call(&srv, "DELETE", "/api/v1/volumes/sch/schedule", None);
    assert_eq!(status, 204);
    s.wait_until(
        "the banner gone",
        "return document.querySelector('#health').hidden",
        WAIT,
    );
    assert_console_clean(&s, &[]);
}
