//! `GET /metrics` of a running `ibid serve`, scraped with curl and checked by a strict parser of
//! the Prometheus text format: I/O through qemu-io (NBD and iSCSI) moves the counters by exactly
//! what was sent, and the soft threshold shows up in the metrics and the API and clears when a
//! volume is deleted.

mod common;

use common::{output, run, Server};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// One sample line.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A parsed, validated exposition page.
struct Page {
    samples: Vec<Sample>,
}

impl Page {
    /// Whether some sample named `name` has labels including `labels`.
    fn any(&self, name: &str, labels: &[(&str, &str)]) -> bool {
        self.samples.iter().any(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
    }

    /// The value of the one sample named `name` whose labels include `labels`.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let found: Vec<&Sample> = self
            .samples
            .iter()
            .filter(|s| s.name == name)
            .filter(|s| {
                labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .collect();
        assert!(found.len() <= 1, "{name} {labels:?} matches {found:?}");
        found.first().map(|s| s.value)
    }

    /// Like [`Page::get`], failing the test if the sample is missing.
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels)
            .unwrap_or_else(|| panic!("no sample {name} {labels:?}"))
    }
}

/// Parses the text format 0.0.4, failing the test on anything malformed: every sample is
/// `name{labels} value` under a family opened by `# HELP` then `# TYPE`, families are
/// contiguous and declared once, counters end in `_total` and are non-negative, histogram
/// buckets are cumulative, end at `le="+Inf"`, and that bucket equals `_count`.
fn parse(text: &str) -> Page {
    let mut types: HashMap<String, String> = HashMap::new();
    let mut help: Option<String> = None;
    let mut current: Option<String> = None;
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').expect("HELP text");
            assert!(!text.is_empty(), "empty HELP for {name}");
            assert!(!types.contains_key(name), "{name} declared twice");
            help = Some(name.to_string());
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE kind");
            assert_eq!(
                help.as_deref(),
                Some(name),
                "TYPE {name} without HELP just before"
            );
            assert!(
                ["counter", "gauge", "histogram"].contains(&kind),
                "{name}: type {kind}"
            );
            if kind == "counter" {
                assert!(name.ends_with("_total"), "counter {name} without _total");
            }
            types.insert(name.to_string(), kind.to_string());
            current = Some(name.to_string());
            continue;
        }
        assert!(!line.starts_with('#') && !line.is_empty(), "line {line:?}");
        let s = parse_sample(line);
        let family = current
            .as_deref()
            .unwrap_or_else(|| panic!("{line}: no family"));
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| s.name.strip_suffix(suffix))
            .filter(|_| types.get(family).map(String::as_str) == Some("histogram"));
        assert_eq!(
            base.unwrap_or(&s.name),
            family,
            "{line}: outside its family"
        );
        if types[family] == "counter" {
            assert!(s.value >= 0.0, "{line}: negative counter");
        }
        samples.push(s);
    }
    let page = Page { samples };
    check_histograms(&page, &types);
    page
}

/// `name{k="v",...} value` (no timestamp: ibid never sends one).
fn parse_sample(line: &str) -> Sample {
    let name_end = line
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or_else(|| panic!("{line}: no value"));
    let name = &line[..name_end];
    assert!(
        name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_'),
        "{line}: bad name"
    );
    assert!(name.starts_with("ibid_"), "{line}: not an ibid_ metric");
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(mut l) = rest.strip_prefix('{') {
        while !l.starts_with('}') {
            let (k, v) = l
                .split_once("=\"")
                .unwrap_or_else(|| panic!("{line}: label"));
            assert!(
                k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "{line}"
            );
            let mut value = String::new();
            let mut chars = v.char_indices();
            let end = loop {
                match chars.next() {
                    Some((i, '"')) => break i,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, c @ ('\\' | '"'))) => value.push(c),
                        other => panic!("{line}: bad escape {other:?}"),
                    },
                    Some((_, c)) => value.push(c),
                    None => panic!("{line}: unterminated label value"),
                }
            };
            assert!(labels.insert(k.to_string(), value).is_none(), "{line}");
            l = &v[end + 1..];
            l = l.strip_prefix(',').unwrap_or(l);
        }
        rest = &l[1..];
    }
    let value = rest.strip_prefix(' ').unwrap_or_else(|| panic!("{line}"));
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().unwrap_or_else(|e| panic!("{line}: value: {e}")),
    };
    Sample {
        name: name.to_string(),
        labels,
        value,
    }
}

/// A series' labels (without `le`), and its buckets as (bound, cumulative count).
type Buckets = BTreeMap<Vec<(String, String)>, Vec<(f64, f64)>>;

/// Buckets cumulative with increasing bounds, the last `+Inf` and equal to `_count`.
fn check_histograms(page: &Page, types: &HashMap<String, String>) {
    for (family, _) in types.iter().filter(|(_, k)| *k == "histogram") {
        let mut series = Buckets::new();
        for s in page
            .samples
            .iter()
            .filter(|s| s.name == format!("{family}_bucket"))
        {
            let mut key: Vec<_> = s.labels.clone().into_iter().collect();
            key.retain(|(k, _)| k != "le");
            let le = match s.labels["le"].as_str() {
                "+Inf" => f64::INFINITY,
                v => v.parse().expect("le"),
            };
            series.entry(key).or_default().push((le, s.value));
        }
        for (key, buckets) in series {
            for w in buckets.windows(2) {
                assert!(w[0].0 < w[1].0, "{family} {key:?}: bounds not increasing");
                assert!(w[0].1 <= w[1].1, "{family} {key:?}: not cumulative");
            }
            let (le, inf) = *buckets.last().expect("buckets");
            assert_eq!(le, f64::INFINITY, "{family} {key:?}: no +Inf bucket");
            let labels: Vec<(&str, &str)> =
                key.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            assert_eq!(inf, page.value(&format!("{family}_count"), &labels));
            assert!(page.value(&format!("{family}_sum"), &labels) >= 0.0);
        }
    }
}

/// Scrapes `/metrics`, checking the content type, and parses it.
fn scrape(srv: &Server) -> Page {
    let url = format!(
        "http://{}/metrics",
        srv.http.as_deref().expect("API running")
    );
    let out = run("curl", &["-s", "-S", "-f", "-w", "\n%{content_type}", &url]);
    let (text, content_type) = out.rsplit_once('\n').expect("content type");
    assert_eq!(content_type, "text/plain; version=0.0.4; charset=utf-8");
    assert!(text.ends_with('\n'), "a page ends with a newline");
    parse(text)
}

/// `GET /api/v1/pool`.
fn api_pool(srv: &Server) -> serde_json::Value {
    let url = format!("http://{}/api/v1/pool", srv.http.as_deref().expect("API"));
    serde_json::from_str(&run("curl", &["-s", "-S", "-f", &url])).expect("JSON")
}

/// Scrapes until `f` holds (space figures follow the background commit, about a second).
fn scrape_until(srv: &Server, what: &str, f: impl Fn(&Page) -> bool) -> Page {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let page = scrape(srv);
        if f(&page) {
            return page;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

const REQUESTS: &str = "ibid_volume_requests_total";
const BYTES: &str = "ibid_volume_bytes_total";
const ERRORS: &str = "ibid_volume_errors_total";
const LATENCY_COUNT: &str = "ibid_volume_request_duration_seconds_count";

/// Requests, bytes and errors of one op, and that the histogram counted every request.
fn io(page: &Page, volume: &str, protocol: &str, op: &str) -> (f64, Option<f64>, f64) {
    let l = [("volume", volume), ("protocol", protocol), ("op", op)];
    let requests = page.value(REQUESTS, &l);
    assert_eq!(page.value(LATENCY_COUNT, &l), requests, "{l:?}");
    (requests, page.get(BYTES, &l), page.value(ERRORS, &l))
}

/// qemu-io over NBD: one 1 MiB write, one 1 MiB read, a 256 KiB write-zeroes, a 512 KiB
/// discard and a flush move the counters by exactly those requests and bytes; the space
/// figures follow.
#[test]
fn nbd_io_moves_the_counters_exactly() {
    let srv = Server::start(&["--no-default-volume", "--volume", "vm=64M"]);
    let page = scrape(&srv);
    assert_eq!(page.value("ibid_pool_volumes", &[]), 1.0);
    assert_eq!(
        page.value("ibid_volume_size_bytes", &[("volume", "vm")]),
        (64 << 20) as f64
    );
    assert!(!page.any(REQUESTS, &[("volume", "vm")]), "no I/O yet");
    run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x17 0 1M",
            "-c",
            "read -P 0x17 0 1M",
            "-c",
            "write -z 1M 256K",
            "-c",
            "discard 0 512K",
            "-c",
            "flush",
            &srv.url("vm"),
        ],
    );
    // A flush only journals; pool figures follow at the next (background) commit.
    let page = scrape_until(&srv, "mapped blocks and chunks after the commit", |p| {
        p.get("ibid_volume_mapped_blocks", &[("volume", "vm")]) == Some(128.0)
            && p.get("ibid_pool_unique_chunks", &[]) == Some(1.0)
    });
    let mib = (1u64 << 20) as f64;
    assert_eq!(io(&page, "vm", "nbd", "write"), (1.0, Some(mib), 0.0));
    assert_eq!(io(&page, "vm", "nbd", "read"), (1.0, Some(mib), 0.0));
    assert_eq!(
        io(&page, "vm", "nbd", "write_zeroes"),
        (2.0, Some(0.75 * mib), 0.0)
    );
    // The flush asked for, and the one qemu always sends when it closes the export.
    assert_eq!(io(&page, "vm", "nbd", "flush"), (2.0, None, 0.0));
    assert_eq!(io(&page, "vm", "nbd", "copy"), (0.0, Some(0.0), 0.0));
    assert!(!page.any(REQUESTS, &[("protocol", "iscsi")]));
    assert_eq!(
        page.value("ibid_pool_logical_written_bytes", &[]),
        0.5 * mib
    );
    assert_eq!(page.value("ibid_pool_unique_chunks", &[]), 1.0);
    assert_eq!(page.value("ibid_pool_soft_threshold_exceeded", &[]), 0.0);
    assert_eq!(page.value("ibid_pool_soft_threshold_ratio", &[]), 0.8);
    assert_eq!(
        page.value("ibid_pool_data_reduction_ratio", &[]),
        page.value("ibid_pool_logical_written_bytes", &[])
            / page.value("ibid_pool_physical_bytes", &[])
    );
}

/// qemu-io over iSCSI: the same volume's counters under `protocol="iscsi"`.
#[test]
fn iscsi_io_is_counted_under_its_protocol() {
    let srv = Server::start(&["--no-default-volume", "--volume", "lun0=16M"]);
    run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x33 0 1M",
            "-c",
            "read -P 0x33 0 1M",
            "-c",
            "flush",
            &srv.iscsi_url(0),
        ],
    );
    let page = scrape(&srv);
    let mib = (1u64 << 20) as f64;
    assert_eq!(io(&page, "lun0", "iscsi", "write"), (1.0, Some(mib), 0.0));
    let (reads, read_bytes, _) = io(&page, "lun0", "iscsi", "read");
    assert!(
        reads >= 1.0 && read_bytes >= Some(mib),
        "{reads} {read_bytes:?}"
    );
    assert!(io(&page, "lun0", "iscsi", "flush").0 >= 1.0);
    assert!(!page.any(REQUESTS, &[("protocol", "nbd")]));
}

/// Writes `len` bytes that neither deduplicate nor compress (nor match another seed's).
fn random_file(path: &std::path::Path, len: usize, seed: u64) {
    let mut x = seed | 1;
    let data: Vec<u8> = (0..len / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    std::fs::write(path, data).expect("write random file");
}

/// A small pool filled past 80 % shows the soft threshold in the metrics and the API; a write
/// that does not fit counts as one failed request; deleting the volume clears the threshold,
/// and the deleted volume's series leave the page.
#[test]
fn soft_threshold_shows_and_clears() {
    let srv = Server::start(&[
        "--no-default-volume",
        "--capacity",
        "32M",
        "--volume",
        "fill=64M",
    ]);
    let page = scrape(&srv);
    let capacity = page.value("ibid_pool_capacity_bytes", &[]);
    assert_eq!(capacity, (32 << 20) as f64);
    let free = page.value("ibid_pool_free_bytes", &[]);
    // Enough unique data to pass 80 % of capacity, well short of filling it.
    let fill = ((free - 0.1 * capacity) as usize) & !0xfffff;
    let work = tempfile::tempdir().expect("tempdir");
    let image = work.path().join("random.raw");
    random_file(&image, fill, 0x9e37_79b9_7f4a_7c15);
    run(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            image.to_str().expect("utf8"),
            &srv.url("fill"),
        ],
    );
    let page = scrape_until(&srv, "the soft threshold", |p| {
        p.value("ibid_pool_soft_threshold_exceeded", &[]) == 1.0
    });
    let used = page.value("ibid_pool_used_bytes", &[]);
    assert!(used >= 0.8 * capacity, "{used} of {capacity}");
    assert_eq!(
        io(&page, "fill", "nbd", "write").1,
        Some(fill as f64),
        "every byte written counted once"
    );
    assert_eq!(api_pool(&srv)["soft_threshold_exceeded"], true);
    // 8 MiB more unique data than is free: one NBD write that fails with ENOSPC.
    let (requests, bytes, errors) = io(&page, "fill", "nbd", "write");
    assert_eq!(errors, 0.0);
    let extra = work.path().join("extra.raw");
    random_file(&extra, 8 << 20, 0x2545_f491_4f6c_dd1d);
    let out = output(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            &format!("write -s {} 32M 8M", extra.to_str().expect("utf8")),
            &srv.url("fill"),
        ],
    );
    let said = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("No space left"), "{said}");
    let page = scrape(&srv);
    assert_eq!(
        io(&page, "fill", "nbd", "write"),
        (requests + 1.0, bytes, 1.0),
        "one more request, failed, no bytes"
    );
    let url = format!(
        "http://{}/api/v1/volumes/fill",
        srv.http.as_deref().expect("API")
    );
    run(
        "curl",
        &[
            "-s",
            "-S",
            "-f",
            "-X",
            "DELETE",
            "-H",
            "x-ibid-request: 1",
            &url,
        ],
    );
    let page = scrape_until(&srv, "the soft threshold to clear", |p| {
        p.value("ibid_pool_soft_threshold_exceeded", &[]) == 0.0
            && !p.any(REQUESTS, &[("volume", "fill")])
    });
    assert_eq!(page.value("ibid_pool_volumes", &[]), 0.0);
    assert_eq!(
        page.get("ibid_volume_size_bytes", &[("volume", "fill")]),
        None
    );
    assert_eq!(api_pool(&srv)["soft_threshold_exceeded"], false);
}
