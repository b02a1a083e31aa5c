//! fjall vs redb on ibid's metadata access pattern (project issue 2).
//!
//! `kvstore-bench all [--blocks N] [--runs R] [--stores fjall,redb,redb-qr] [--dir D]` runs every
//! measurement R times per store, each run in a fresh child process (so RSS is per store), and
//! prints a table of median [min..max]. See docs/kv-store-choice.md for what each row means.

mod stores;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use stores::{map_key, ChunkRec, Fjall, Hash, Kv, Pending, Redb};

/// Blocks per durable commit during bulk ingest (~64k dirty blocks).
const BATCH: u64 = 64 * 1024;
/// Block cache given to each store (same for both).
const CACHE_BYTES: u64 = 256 << 20;

struct Args(Vec<String>);

impl Args {
    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .position(|a| a == name)
            .and_then(|i| self.0.get(i + 1))
            .map(String::as_str)
    }
    fn num(&self, name: &str, default: u64) -> u64 {
        self.get(name)
            .map(|v| v.parse().expect("number"))
            .unwrap_or(default)
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = Args(argv.clone());
    match argv.first().map(String::as_str) {
        Some("all") => all(&args),
        Some("run") => run(&args),
        Some("kill-child") => kill_child(&args),
        Some("open") => {
            // Times an open of an existing store (diagnostics).
            let t = Instant::now();
            let kv = open_store(
                args.get("--store").expect("--store"),
                Path::new(args.get("--dir").expect("--dir")),
            );
            println!(
                "open {:.1} ms counts {:?}",
                t.elapsed().as_secs_f64() * 1e3,
                kv.counts()
            );
        }
        _ => {
            eprintln!("usage: kvstore-bench all [--blocks N] [--runs R] [--stores fjall,redb,redb-qr] [--dir D]");
            std::process::exit(2);
        }
    }
}

// ---------------------------------------------------------------- helpers

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// A bijection on [0, 2^bits): random-looking order in which every block is written once.
fn permute(i: u64, bits: u32) -> u64 {
    let mask = (1u64 << bits) - 1;
    let sh = bits.div_ceil(2);
    let mut x = i & mask;
    for m in [
        0x9E37_79B9_7F4A_7C15u64,
        0xBF58_476D_1CE4_E5B9,
        0x94D0_49BB_1331_11EB,
    ] {
        x = x.wrapping_mul(m) & mask;
        x ^= x >> sh;
    }
    x
}

fn fingerprint(id: u64) -> Hash {
    *blake3::hash(&id.to_le_bytes()).as_bytes()
}

fn chunk_rec(id: u64, refcount: u32) -> ChunkRec {
    let mut r = [0u8; 32];
    r[0..8].copy_from_slice(&(id / 1024).to_le_bytes()); // segment id
    r[8..16].copy_from_slice(&((id % 1024) * 4096).to_le_bytes()); // offset
    r[16..20].copy_from_slice(&4096u32.to_le_bytes()); // length
    r[20..24].copy_from_slice(&(id as u32).wrapping_mul(0x9E37_79B1).to_le_bytes()); // crc32c
    r[24..28].copy_from_slice(&refcount.to_le_bytes());
    r
}

fn open_store(kind: &str, dir: &Path) -> Box<dyn Kv> {
    match kind {
        "fjall" => Box::new(Fjall::open(dir, CACHE_BYTES)),
        "redb" => Box::new(Redb::open(dir, CACHE_BYTES as usize, false).0),
        "redb-qr" => Box::new(Redb::open(dir, CACHE_BYTES as usize, true).0),
        other => panic!("unknown store {other}"),
    }
}

fn status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("status");
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let md = e.metadata().expect("md");
            if md.is_dir() {
                total += disk_bytes(&e.path());
            } else {
                total += md.blocks() * 512;
            }
        }
    }
    total
}

fn result(name: &str, value: f64) {
    println!("RESULT {name} {value:.3}");
    std::io::stdout().flush().ok();
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// Ingests `n` unique blocks: per block one dedup lookup (a miss), one map insert, one chunk
/// insert, one dedup insert; durable commit every `BATCH` blocks. Calls `on_commit(total)` after
/// each durable commit. Returns elapsed time.
fn ingest(
    kv: &dyn Kv,
    layer: u64,
    first_chunk: u64,
    n: u64,
    random: bool,
    mut on_commit: impl FnMut(u64),
) -> Duration {
    let bits = 64 - (n.max(2) - 1).leading_zeros();
    let t = Instant::now();
    let mut p = Pending::default();
    let mut view = kv.view();
    let mut i = 0;
    let mut next = 0u64;
    while i < n {
        let block = if random {
            // Permutation of [0, 2^bits), skipping values >= n so each block is written once.
            loop {
                let b = permute(next, bits);
                next += 1;
                if b < n {
                    break b;
                }
            }
        } else {
            i
        };
        let id = first_chunk + i;
        let h = fingerprint(id);
        if view.dedup_get(&h).is_some() {
            panic!("unexpected dedup hit");
        }
        p.map.push((map_key(layer, block), id));
        p.chunks.push((id, chunk_rec(id, 1)));
        p.dedup.push((h, id));
        i += 1;
        if p.map.len() as u64 == BATCH || i == n {
            drop(view);
            kv.commit(&p);
            p.clear();
            on_commit(i);
            view = kv.view();
        }
    }
    t.elapsed()
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

// ---------------------------------------------------------------- one run of one store

fn run(args: &Args) {
    let kind = args.get("--store").expect("--store").to_string();
    let base = PathBuf::from(args.get("--dir").expect("--dir"));
    let n = args.num("--blocks", 4 << 20);
    let seed = args.num("--seed", 1);
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("mkdir");
    let seq_dir = base.join("seq");
    let rand_dir = base.join("rand");
    let mut rng = Rng(seed);

    // (a) bulk ingest, sequential map keys.
    let kv = open_store(&kind, &seq_dir);
    let el = ingest(&*kv, 1, 0, n, false, |_| {});
    result("a_ingest_seq_blocks_per_s", n as f64 / el.as_secs_f64());
    result(
        "g_rss_after_seq_ingest_mib",
        status_kib("VmRSS:") as f64 / 1024.0,
    );
    // Open after a plain drop (fjall: journal replay), then after a clean close.
    drop(kv);
    let t = Instant::now();
    let kv = open_store(&kind, &seq_dir);
    result("f_open_after_drop_ms", t.elapsed().as_secs_f64() * 1e3);
    let t = Instant::now();
    kv.clean_close();
    result("f_clean_close_ms", t.elapsed().as_secs_f64() * 1e3);
    drop(kv);
    result("g_disk_seq_mib", mib(disk_bytes(&seq_dir)));

    // (f) open after clean close.
    let t = Instant::now();
    let kv = open_store(&kind, &seq_dir);
    result("f_open_clean_ms", t.elapsed().as_secs_f64() * 1e3);

    // (d) point reads, random, warm store. Warm-up pass first.
    let reads = (n / 4).max(1);
    let keys: Vec<_> = (0..reads).map(|_| map_key(1, rng.next() % n)).collect();
    for c in keys.chunks(1024) {
        kv.map_get_many(c);
    }
    let t = Instant::now();
    let mut hits = 0;
    for c in keys.chunks(1024) {
        hits += kv.map_get_many(c);
    }
    assert_eq!(hits as u64, reads);
    result(
        "d_map_get_1thread_per_s",
        reads as f64 / t.elapsed().as_secs_f64(),
    );
    let t = Instant::now();
    std::thread::scope(|s| {
        let kvr = &*kv;
        for th in 0..2 {
            let keys = &keys;
            s.spawn(move || {
                let mut h = 0;
                // Each thread reads the whole key list, in a different order of chunks.
                let chunks: Vec<_> = keys.chunks(1024).collect();
                for j in 0..chunks.len() {
                    let c = chunks[(j + th * chunks.len() / 2) % chunks.len()];
                    h += kvr.map_get_many(c);
                }
                assert_eq!(h as u64, reads);
            });
        }
    });
    result(
        "d_map_get_2threads_per_s",
        2.0 * reads as f64 / t.elapsed().as_secs_f64(),
    );
    let probes = 200_000.min(n);
    let present: Vec<_> = (0..probes).map(|_| fingerprint(rng.next() % n)).collect();
    let absent: Vec<_> = (0..probes)
        .map(|_| fingerprint(n + 1_000_000_000 + rng.next() % n))
        .collect();
    let t = Instant::now();
    let mut h = 0;
    for c in present.chunks(1024) {
        h += kv.dedup_get_many(c);
    }
    assert_eq!(h as u64, probes);
    result(
        "d_dedup_get_present_per_s",
        probes as f64 / t.elapsed().as_secs_f64(),
    );
    let t = Instant::now();
    let mut h = 0;
    for c in absent.chunks(1024) {
        h += kv.dedup_get_many(c);
    }
    assert_eq!(h, 0);
    result(
        "d_dedup_get_absent_per_s",
        probes as f64 / t.elapsed().as_secs_f64(),
    );

    // (e) range scan of n/4 (1 M at 4 M) entries, then range delete of the next n/4.
    let q = n / 4;
    let t = Instant::now();
    let c = kv.map_scan(map_key(1, 0), map_key(1, q));
    assert_eq!(c as u64, q);
    result("e_scan_1M_ms", t.elapsed().as_secs_f64() * 1e3);
    let t = Instant::now();
    let c = kv.map_delete_range(map_key(1, q), map_key(1, 2 * q));
    assert_eq!(c as u64, q);
    result("e_delete_range_1M_ms", t.elapsed().as_secs_f64() * 1e3);

    // (c) small durable commits on the warm store: random 4 KiB overwrites (map RMW + chunk
    // refcount RMW) of new unique data, batches of 1, 8, 64 blocks, fsync each.
    let mut next_chunk = n + 10_000_000;
    for (size, count) in [(1u64, 1000usize), (8, 500), (64, 200)] {
        let mut lat = Vec::with_capacity(count);
        for _ in 0..count {
            let t = Instant::now();
            let mut p = Pending::default();
            {
                let view = kv.view();
                for _ in 0..size {
                    let block = 2 * q + rng.next() % (n - 2 * q);
                    let k = map_key(1, block);
                    if let Some(old) = view.map_get(&k) {
                        if let Some(rec) = view.chunk_get(old) {
                            let rc = u32::from_le_bytes(rec[24..28].try_into().expect("4"));
                            let mut rec = rec;
                            rec[24..28].copy_from_slice(&rc.saturating_sub(1).to_le_bytes());
                            p.chunks.push((old, rec));
                        }
                    }
                    let id = next_chunk;
                    next_chunk += 1;
                    let h = fingerprint(id);
                    assert!(view.dedup_get(&h).is_none());
                    p.map.push((k, id));
                    p.chunks.push((id, chunk_rec(id, 1)));
                    p.dedup.push((h, id));
                }
            }
            kv.commit(&p);
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        lat.sort_by(f64::total_cmp);
        result(&format!("c_commit_{size}blk_p50_us"), pct(&lat, 0.50));
        result(&format!("c_commit_{size}blk_p99_us"), pct(&lat, 0.99));
        result(&format!("c_commit_{size}blk_max_us"), pct(&lat, 1.0));
    }
    result(
        "g_rss_end_of_reads_mib",
        status_kib("VmRSS:") as f64 / 1024.0,
    );
    drop(kv);

    // (b) bulk ingest, random map keys, fresh store.
    let kv = open_store(&kind, &rand_dir);
    let el = ingest(&*kv, 1, 0, n, true, |_| {});
    result("b_ingest_rand_blocks_per_s", n as f64 / el.as_secs_f64());
    drop(kv);
    result("g_disk_rand_mib", mib(disk_bytes(&rand_dir)));
    result("g_rss_peak_hwm_mib", status_kib("VmHWM:") as f64 / 1024.0);

    // (f) kill -9 during ingest: a child continues ingesting into the n-block store (new layer
    // 2, sequential), we SIGKILL it after it reported two durable commits plus a random delay.
    let exe = std::env::current_exe().expect("exe");
    let mut child = Command::new(exe)
        .args(["kill-child", "--store", &kind, "--dir"])
        .arg(&rand_dir)
        .args(["--start", &n.to_string(), "--blocks", &(n * 4).to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut reported = 0u64;
    let mut commits = 0;
    for l in lines.by_ref() {
        let l = l.expect("line");
        if let Some(v) = l.strip_prefix("committed ") {
            reported = v.parse().expect("num");
            commits += 1;
            if commits == 2 {
                break;
            }
        }
    }
    std::thread::sleep(Duration::from_millis(rng.next() % 400));
    unsafe {
        libc::kill(child.id() as i32, libc::SIGKILL);
    }
    child.wait().expect("wait");
    // Lines the child printed before it died, if any.
    for l in lines.map_while(Result::ok) {
        if let Some(v) = l.strip_prefix("committed ") {
            reported = v.parse().expect("num");
        }
    }
    let t = Instant::now();
    let kv = open_store(&kind, &rand_dir);
    result("f_open_after_kill9_ms", t.elapsed().as_secs_f64() * 1e3);
    // Consistency: all three tables hold exactly the same whole number of committed batches,
    // at least everything the child reported durable, and layer 2 is exactly blocks 0..k.
    let (m, c, d) = kv.counts();
    let extra = (m as u64).saturating_sub(n);
    let layer2 = kv.map_scan(map_key(2, 0), map_key(3, 0)) as u64;
    let ok =
        m == c && c == d && extra == layer2 && extra >= reported && extra.is_multiple_of(BATCH);
    let lost_in_flight = extra.saturating_sub(reported);
    if !ok {
        eprintln!("INCONSISTENT after kill: map {m} chunks {c} dedup {d} layer2 {layer2} reported {reported}");
    }
    result("f_kill9_consistent", if ok { 1.0 } else { 0.0 });
    result("f_kill9_blocks_beyond_reported", lost_in_flight as f64);
    drop(kv);
    if std::env::var_os("KVBENCH_KEEP").is_none() {
        let _ = std::fs::remove_dir_all(&base);
    }
}

fn kill_child(args: &Args) {
    let kind = args.get("--store").expect("--store").to_string();
    let dir = PathBuf::from(args.get("--dir").expect("--dir"));
    let start = args.num("--start", 0);
    let n = args.num("--blocks", 1 << 20);
    let kv = open_store(&kind, &dir);
    let mut out = std::io::stdout();
    ingest(&*kv, 2, start, n, false, |total| {
        writeln!(out, "committed {total}").ok();
        out.flush().ok();
    });
}

// ---------------------------------------------------------------- orchestration

fn all(args: &Args) {
    let n = args.num("--blocks", 4 << 20);
    let runs = args.num("--runs", 3);
    let stores: Vec<String> = args
        .get("--stores")
        .unwrap_or("fjall,redb")
        .split(',')
        .map(str::to_string)
        .collect();
    let dir = PathBuf::from(args.get("--dir").unwrap_or("/var/tmp/kvbench"));
    let exe = std::env::current_exe().expect("exe");
    let mut res: BTreeMap<String, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    for r in 0..runs {
        for s in &stores {
            eprintln!("run {}/{runs} store {s} blocks {n}", r + 1);
            let t = Instant::now();
            let out = Command::new(&exe)
                .args(["run", "--store", s, "--blocks", &n.to_string()])
                .args(["--seed", &(r + 1).to_string(), "--dir"])
                .arg(dir.join(s))
                .stderr(Stdio::inherit())
                .output()
                .expect("run child");
            assert!(out.status.success(), "child failed for {s}");
            for l in String::from_utf8_lossy(&out.stdout).lines() {
                let f: Vec<_> = l.split_whitespace().collect();
                if f.len() == 3 && f[0] == "RESULT" {
                    let name = f[1].to_string();
                    if !order.contains(&name) {
                        order.push(name.clone());
                    }
                    res.entry(name)
                        .or_default()
                        .entry(s.clone())
                        .or_default()
                        .push(f[2].parse().expect("num"));
                }
            }
            eprintln!("  took {:.1} s", t.elapsed().as_secs_f64());
        }
    }
    order.sort();
    println!(
        "blocks={n} runs={runs} batch={BATCH} cache={}MiB  cells: median [min..max] over runs",
        CACHE_BYTES >> 20
    );
    print!("| {:<32} |", "metric");
    for s in &stores {
        print!(" {s:>26} |");
    }
    println!();
    print!("|{}|", "-".repeat(34));
    for _ in &stores {
        print!("{}|", "-".repeat(28));
    }
    println!();
    for name in &order {
        print!("| {name:<32} |");
        for s in &stores {
            let mut v = res[name].get(s).cloned().unwrap_or_default();
            v.sort_by(f64::total_cmp);
            let cell = if v.is_empty() {
                "-".to_string()
            } else {
                format!(
                    "{} [{}..{}]",
                    fmt(v[v.len() / 2]),
                    fmt(v[0]),
                    fmt(v[v.len() - 1])
                )
            };
            print!(" {cell:>26} |");
        }
        println!();
    }
}

fn fmt(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}
