//! `ibid-bench`: measures the engine through its public API against the goals of issue 2
//! (`engine`), issue 3 (`sharing`: snapshots, clones, range copy) and issue 5 (`formats`:
//! creating and converting thin and thick volumes), and the metadata store alone for the row
//! shapes a pool format could use (`store-shapes`).
//!
//! `ibid-bench engine` prints one Markdown table: for each measurement the median of `--runs`
//! runs and the spread (min–max), next to the goal. `--quick` shrinks every size so the whole
//! command runs in seconds (the integration test uses it so the command cannot rot).

/// mimalloc, tuned by [`ibid_engine::allocator::tune`] (see `allocator.rs` for why).
#[global_allocator]
static GLOBAL: ibid_engine::allocator::Allocator = ibid_engine::allocator::Allocator;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use ibid_engine::{Pool, PoolConfig, Volume};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

mod checksum;
mod formats;
mod map_overwrites;
mod offload;
mod sharing;
mod simulate;
mod store_shapes;
mod store_space;
mod xcopy;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * 1024;
const BLOCK: usize = 4096;

#[derive(Parser)]
#[command(name = "ibid-bench", about = "ibid benchmarks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Benchmarks the engine API (issue 2, "Measure it").
    Engine(EngineArgs),
    /// Benchmarks snapshots, clones and range copy (issue 3, "Measure it").
    Sharing(sharing::SharingArgs),
    /// Benchmarks volume creation and format conversion (issue 5, "Measure it").
    Formats(formats::FormatsArgs),
    /// Measures the metadata store's cost per new block for today's row shapes and others.
    StoreShapes(store_shapes::StoreShapesArgs),
    /// The map's store work per random overwrite, deferred and straight into the B-tree.
    MapOverwrites(map_overwrites::MapOverwritesArgs),
    /// Where the bytes of a pool's metadata store file go, per table.
    StoreSpace(store_space::StoreSpaceArgs),
    /// Range copies in 4 MiB segments with several in flight, as ESXi sends EXTENDED COPY.
    Xcopy(xcopy::XcopyArgs),
    /// The deterministic simulator: random engine operations, power cuts, checks.
    Simulate(simulate::SimulateArgs),
    /// Push, restore and instant-restore first reads against an S3 store (Ceph RGW), beside
    /// the store's own PUTs and GETs of the same bytes.
    Offload(offload::OffloadArgs),
    /// The engine's CRC-32C per record and from memory, beside the `crc32c` crate's.
    Checksum(checksum::ChecksumArgs),
    /// Internal: writes to a pool until killed (the crash-recovery measurement).
    #[command(hide = true)]
    CrashChild {
        /// Pool directory.
        #[arg(long)]
        dir: PathBuf,
        /// First block index to write (keeps every round's blocks unique).
        #[arg(long)]
        seed: u64,
    },
}

#[derive(Args, Clone)]
struct EngineArgs {
    /// Tiny sizes and durations (finishes in seconds; for tests and smoke runs).
    #[arg(long)]
    quick: bool,
    /// Directory under which temporary pools are created (default: the system temp dir).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Runs of each throughput/latency measurement (median and spread are reported).
    #[arg(long)]
    runs: Option<usize>,
    /// MiB written by each sequential 1 MiB write test (zero test: 4×).
    #[arg(long)]
    seq_mib: Option<u64>,
    /// Threads issuing the sequential 1 MiB writes, each taking the next MiB in turn (1: one
    /// write in flight; 8: like an NBD client at queue depth 8).
    #[arg(long, default_value_t = 1)]
    seq_writers: usize,
    /// Threads for the random 4 KiB tests ("many in flight" on a synchronous API).
    #[arg(long, default_value_t = 32)]
    threads: usize,
    /// Seconds per random/latency test.
    #[arg(long)]
    secs: Option<f64>,
    /// Unique blocks for the dedup RAM and crash-open measurement (0 skips it).
    #[arg(long)]
    unique_blocks: Option<u64>,
    /// Crash/reopen rounds on the large pool.
    #[arg(long)]
    crash_rounds: Option<usize>,
    /// Only the throughput/latency tests whose name contains this (e.g. "duplicate"); for
    /// profiling one test with perf.
    #[arg(long)]
    only: Option<String>,
    /// Only the large-pool part (dedup RAM, open after crash).
    #[arg(long)]
    scale_only: bool,
    /// Skip the large-pool part.
    #[arg(long)]
    no_scale: bool,
    /// MiB of generated data the sequential tests write from (default: `--seq-mib`, so that
    /// nothing is generated in the timed part). Smaller, it lets `--seq-mib` exceed the RAM:
    /// past it the unique test copies each MiB and writes each block's index into its first
    /// 8 bytes (a 1 MiB copy per write, in the timed part), so its blocks stay unique and
    /// incompressible; the other tests repeat the data.
    #[arg(long)]
    seq_data_mib: Option<u64>,
    /// Runs the dedup index keeps before merging them into its B-tree (the pool default
    /// unless given; 1 writes every commit's keys into the B-tree, as before format 4).
    #[arg(long)]
    dedup_runs_max: Option<usize>,
}

/// The configuration of the benchmark's pools, set once from the options.
static POOL_CONFIG: std::sync::OnceLock<PoolConfig> = std::sync::OnceLock::new();

/// The configuration every pool of this benchmark is created and opened with.
fn pool_config() -> PoolConfig {
    POOL_CONFIG.get().cloned().unwrap_or_default()
}

struct Settings {
    base: PathBuf,
    runs: usize,
    seq_bytes: u64,
    /// Bytes of generated data the sequential tests write from (at most `seq_bytes`).
    seq_data_bytes: u64,
    seq_writers: usize,
    threads: usize,
    secs: f64,
    unique_blocks: u64,
    crash_rounds: usize,
    only: Option<String>,
}

impl Settings {
    fn from(a: &EngineArgs) -> Settings {
        let q = a.quick;
        let seq_mib = a.seq_mib.unwrap_or(if q { 16 } else { 2048 }).max(1);
        Settings {
            base: a.dir.clone().unwrap_or_else(std::env::temp_dir),
            runs: a.runs.unwrap_or(if q { 1 } else { 3 }),
            seq_bytes: seq_mib * MIB,
            seq_data_bytes: a.seq_data_mib.unwrap_or(seq_mib).clamp(1, seq_mib) * MIB,
            seq_writers: a.seq_writers.max(1),
            threads: a.threads,
            secs: a.secs.unwrap_or(if q { 0.3 } else { 8.0 }),
            unique_blocks: if a.no_scale {
                0
            } else {
                a.unique_blocks.unwrap_or(if q { 20_000 } else { 4 << 20 })
            },
            crash_rounds: a.crash_rounds.unwrap_or(if q { 1 } else { 3 }),
            only: a.only.clone(),
        }
    }
}

fn main() -> Result<()> {
    ibid_engine::allocator::tune();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Engine(a) => engine(&a),
        Cmd::Sharing(a) => sharing::sharing(&a),
        Cmd::Formats(a) => formats::formats(&a),
        Cmd::StoreShapes(a) => store_shapes::store_shapes(&a),
        Cmd::MapOverwrites(a) => map_overwrites::map_overwrites(&a),
        Cmd::StoreSpace(a) => store_space::store_space(&a),
        Cmd::Xcopy(a) => xcopy::xcopy(&a),
        Cmd::Simulate(a) => simulate::simulate(&a),
        Cmd::Offload(a) => offload::offload(&a),
        Cmd::Checksum(a) => checksum::checksum(&a),
        Cmd::CrashChild { dir, seed } => crash_child(&dir, seed),
    }
}

// ---------------------------------------------------------------- data

/// splitmix64: fast, deterministic, good enough to defeat dedup and LZ4.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A compressible but unique block: a 16-byte unique header, then a repeated pattern.
fn compressible_block(dst: &mut [u8], index: u64) {
    dst[..8].copy_from_slice(&index.to_le_bytes());
    dst[8..16].copy_from_slice(&(!index).to_le_bytes());
}

fn compressible_template(bytes: usize) -> Vec<u8> {
    let pat = b"ibid-bench compressible pattern. ";
    (0..bytes).map(|i| pat[i % pat.len()]).collect()
}

// ---------------------------------------------------------------- measurements

/// One run of one measurement.
#[derive(Clone, Copy, Default)]
struct Sample {
    mbps: f64,
    iops: f64,
    p50_us: f64,
    p99_us: f64,
    /// Process CPU time (all threads, user + system) during the test, in cores.
    cores: f64,
    /// MB moved per CPU-second: what one uncontended core would do (if the load is CPU-bound).
    mb_per_cpu_s: f64,
}

/// Process CPU seconds (user + system, all threads) so far.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Runs `f` and adds its CPU use to the sample.
fn with_cpu(f: impl FnOnce() -> Result<Sample>) -> Result<Sample> {
    let c0 = cpu_seconds();
    let t0 = Instant::now();
    let mut s = f()?;
    let cpu = cpu_seconds() - c0;
    let wall = t0.elapsed().as_secs_f64();
    s.cores = cpu / wall;
    s.mb_per_cpu_s = s.mbps * wall / cpu.max(1e-9);
    Ok(s)
}

fn sample(bytes: u64, elapsed: Duration, mut lat_ns: Vec<u64>) -> Sample {
    lat_ns.sort_unstable();
    let pct = |p: f64| -> f64 {
        if lat_ns.is_empty() {
            return 0.0;
        }
        let i = ((lat_ns.len() as f64 * p).ceil() as usize).clamp(1, lat_ns.len()) - 1;
        lat_ns[i] as f64 / 1000.0
    };
    let s = elapsed.as_secs_f64();
    Sample {
        mbps: bytes as f64 / s / 1e6,
        iops: lat_ns.len() as f64 / s,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        cores: 0.0,
        mb_per_cpu_s: 0.0,
    }
}

fn fresh_pool(base: &Path) -> Result<(tempfile::TempDir, Pool)> {
    std::fs::create_dir_all(base)?;
    let dir = tempfile::Builder::new()
        .prefix("ibid-bench-")
        .tempdir_in(base)?;
    let pool = Pool::create(dir.path().join("pool"), pool_config())?;
    Ok((dir, pool))
}

/// How [`seq_write`] treats offsets past the end of its data.
#[derive(Clone, Copy, PartialEq)]
enum Wrap {
    /// Write the data again (duplicates, or zeros again).
    Repeat,
    /// Write a copy with each block's index in its first 8 bytes (unique blocks).
    Unique,
}

/// Sequential 1 MiB writes of `data` (cycled to `total` bytes, as `wrap` says) from offset 0;
/// the final `sync` is inside the timed interval.
fn seq_write(
    pool: &Pool,
    vol: &Volume,
    data: &[u8],
    total: u64,
    writers: usize,
    wrap: Wrap,
) -> Result<Sample> {
    let next = AtomicU64::new(0);
    let t0 = Instant::now();
    let lats = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..writers)
            .map(|_| {
                scope.spawn(|| -> Result<Vec<u64>> {
                    let mut lat = Vec::new();
                    let mut copy = Vec::new();
                    loop {
                        let off = next.fetch_add(MIB, Ordering::Relaxed);
                        if off >= total {
                            return Ok(lat);
                        }
                        let src = (off % data.len() as u64) as usize;
                        let t = Instant::now();
                        let mut buf = &data[src..src + MIB as usize];
                        if wrap == Wrap::Unique && off >= data.len() as u64 {
                            copy.clear();
                            copy.extend_from_slice(buf);
                            for (i, block) in copy.chunks_exact_mut(BLOCK).enumerate() {
                                let index = off / BLOCK as u64 + i as u64;
                                block[..8].copy_from_slice(&(index | 1 << 63).to_le_bytes());
                            }
                            buf = &copy;
                        }
                        vol.write(off, buf, false)?;
                        lat.push(t.elapsed().as_nanos() as u64);
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("writer thread panicked"))
            .collect::<Result<Vec<_>>>()
    })?;
    pool.sync()?;
    Ok(sample(total, t0.elapsed(), lats.concat()))
}

/// [`seq_write`] of `data` with the first 8 bytes of every block changed: as unique and
/// incompressible, and no block equal to one `data` put in the pool.
fn seq_overwrite(pool: &Pool, vol: &Volume, data: &[u8], total: u64) -> Result<Sample> {
    let mut buf = vec![0u8; MIB as usize];
    let mut lat = Vec::with_capacity((total / MIB) as usize);
    let t0 = Instant::now();
    let mut off = 0u64;
    while off < total {
        let src = (off % data.len() as u64) as usize;
        buf.copy_from_slice(&data[src..src + MIB as usize]);
        for block in buf.chunks_exact_mut(BLOCK) {
            for b in &mut block[..8] {
                *b ^= 0xa5;
            }
        }
        let t = Instant::now();
        vol.write(off, &buf, false)?;
        lat.push(t.elapsed().as_nanos() as u64);
        off += MIB;
    }
    pool.sync()?;
    Ok(sample(total, t0.elapsed(), lat))
}

fn seq_read(vol: &Volume, total: u64) -> Result<Sample> {
    let mut buf = vec![0u8; MIB as usize];
    let mut lat = Vec::new();
    let t0 = Instant::now();
    let mut off = 0;
    while off < total {
        let t = Instant::now();
        vol.read(off, &mut buf)?;
        lat.push(t.elapsed().as_nanos() as u64);
        off += MIB;
    }
    Ok(sample(total, t0.elapsed(), lat))
}

/// `threads` threads each doing 4 KiB ops at random block offsets in `[0, blocks)` for `secs`.
fn random_4k(vol: &Volume, threads: usize, secs: f64, blocks: u64, write: bool) -> Result<Sample> {
    let stop = Duration::from_secs_f64(secs);
    let ops = AtomicU64::new(0);
    let t0 = Instant::now();
    let lats: Vec<Result<Vec<u64>>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|tid| {
                let vol = vol.clone();
                let ops = &ops;
                sc.spawn(move || -> Result<Vec<u64>> {
                    let mut rng = Rng(0x1234_5678 ^ ((tid as u64) << 40) ^ write as u64);
                    let mut buf = vec![0u8; BLOCK];
                    rng.fill(&mut buf);
                    let mut lat = Vec::new();
                    let mut n = 0u64;
                    while t0.elapsed() < stop {
                        let off = rng.below(blocks) * BLOCK as u64;
                        let t = Instant::now();
                        if write {
                            // Unique and incompressible: a random block with a unique stamp.
                            buf[..8].copy_from_slice(&(tid as u64).to_le_bytes());
                            buf[8..16].copy_from_slice(&n.to_le_bytes());
                            vol.write(off, &buf, false)?;
                        } else {
                            vol.read(off, &mut buf)?;
                        }
                        lat.push(t.elapsed().as_nanos() as u64);
                        n += 1;
                    }
                    ops.fetch_add(n, Ordering::Relaxed);
                    Ok(lat)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("bench thread panicked"))
            .collect()
    });
    let elapsed = t0.elapsed();
    let mut all = Vec::new();
    for l in lats {
        all.extend(l?);
    }
    let bytes = ops.load(Ordering::Relaxed) * BLOCK as u64;
    Ok(sample(bytes, elapsed, all))
}

/// QD1 4 KiB unique write followed by `flush`, timed as one operation.
fn write_flush(vol: &Volume, secs: f64, blocks: u64) -> Result<Sample> {
    let mut rng = Rng(42);
    let mut buf = vec![0u8; BLOCK];
    rng.fill(&mut buf);
    let mut lat = Vec::new();
    let stop = Duration::from_secs_f64(secs);
    let t0 = Instant::now();
    let mut n = 0u64;
    while t0.elapsed() < stop {
        let off = rng.below(blocks) * BLOCK as u64;
        buf[..8].copy_from_slice(&n.to_le_bytes());
        let t = Instant::now();
        vol.write(off, &buf, false)?;
        vol.flush()?;
        lat.push(t.elapsed().as_nanos() as u64);
        n += 1;
    }
    Ok(sample(n * BLOCK as u64, t0.elapsed(), lat))
}

// ---------------------------------------------------------------- reporting

#[derive(Clone, Copy)]
enum Goal {
    None,
    MbpsMin(f64),
    IopsMin(f64),
    P99MaxUs(f64),
}

struct Row {
    name: &'static str,
    samples: Vec<Sample>,
    goal: Goal,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn stat(samples: &[Sample], f: fn(&Sample) -> f64, digits: usize) -> String {
    let v: Vec<f64> = samples.iter().map(f).collect();
    let med = median(v.clone());
    if v.len() < 2 {
        return format!("{med:.digits$}");
    }
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{med:.digits$} ({lo:.digits$}–{hi:.digits$})")
}

fn verdict(goal: Goal, s: &[Sample]) -> String {
    let med = |f: fn(&Sample) -> f64| median(s.iter().map(f).collect());
    let (ok, text) = match goal {
        Goal::None => return "—".into(),
        Goal::MbpsMin(g) => {
            let m = med(|s| s.mbps);
            (m >= g, format!("≥ {g:.0} MB/s: {:.0} %", m / g * 100.0))
        }
        Goal::IopsMin(g) => {
            let m = med(|s| s.iops);
            (m >= g, format!("≥ {g:.0} IOPS: {:.0} %", m / g * 100.0))
        }
        Goal::P99MaxUs(g) => {
            let m = med(|s| s.p99_us);
            (m <= g, format!("p99 ≤ {g:.0} µs: {:.0} %", m / g * 100.0))
        }
    };
    format!("{} ({text})", if ok { "MET" } else { "MISSED" })
}

fn print_table(rows: &[Row]) {
    println!("| test | MB/s | IOPS | p50 µs | p99 µs | CPU cores | MB per CPU-s | goal |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in rows.iter().filter(|r| !r.samples.is_empty()) {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            r.name,
            stat(&r.samples, |s| s.mbps, 0),
            stat(&r.samples, |s| s.iops, 0),
            stat(&r.samples, |s| s.p50_us, 0),
            stat(&r.samples, |s| s.p99_us, 0),
            stat(&r.samples, |s| s.cores, 2),
            stat(&r.samples, |s| s.mb_per_cpu_s, 0),
            verdict(r.goal, &r.samples)
        );
    }
}

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * KIB)
}

fn uptime() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

// ---------------------------------------------------------------- the command

fn engine(a: &EngineArgs) -> Result<()> {
    let s = Settings::from(a);
    let mut config = PoolConfig::default();
    if let Some(n) = a.dedup_runs_max {
        config.dedup_runs_max = n;
    }
    let runs_max = config.dedup_runs_max;
    POOL_CONFIG
        .set(config)
        .map_err(|_| anyhow::anyhow!("pool configuration set twice"))?;
    println!(
        "# ibid-bench engine: meta={} runs={} seq={} MiB (from {} MiB of data) seq_writers={} threads={} secs={} unique_blocks={} dedup_runs_max={runs_max} (load avg {})",
        ibid_engine::MetaBackend::from_env().name(),
        s.runs,
        s.seq_bytes / MIB,
        s.seq_data_bytes / MIB,
        s.seq_writers,
        s.threads,
        s.secs,
        s.unique_blocks,
        uptime()
    );
    if !a.scale_only {
        let rows = throughput(&s)?;
        println!();
        print_table(&rows);
    }
    if s.unique_blocks > 0 {
        println!();
        scale(&s)?;
    }
    println!();
    println!("# done (load avg {})", uptime());
    Ok(())
}

fn throughput(s: &Settings) -> Result<Vec<Row>> {
    let mut data = vec![0u8; s.seq_data_bytes as usize];
    Rng(7).fill(&mut data);
    let zeros = vec![0u8; MIB as usize];
    let rand_blocks = (4 << 30) / BLOCK as u64;
    let names: [(&'static str, Goal); 11] = [
        (
            "seq write 1 MiB unique incompressible",
            Goal::MbpsMin(600.0),
        ),
        ("seq write 1 MiB duplicate", Goal::MbpsMin(1000.0)),
        ("seq write 1 MiB all-zero", Goal::MbpsMin(4000.0)),
        ("rand write 4 KiB, N threads", Goal::IopsMin(50_000.0)),
        ("seq read 1 MiB", Goal::None),
        ("rand read 4 KiB, N threads", Goal::None),
        ("rand read 4 KiB, QD1", Goal::None),
        ("rand write 4 KiB, QD1", Goal::None),
        ("write+flush 4 KiB, QD1", Goal::P99MaxUs(1000.0)),
        (
            "write+flush 4 KiB, QD1, beside N random writers",
            Goal::None,
        ),
        // What a second full pass over a disk costs (seed 001's "later writes"): every
        // write replaces a block that holds data, so every old chunk dies at commit.
        ("seq overwrite 1 MiB unique incompressible", Goal::None),
    ];
    let mut rows: Vec<Row> = names
        .iter()
        .map(|&(name, goal)| Row {
            name,
            samples: Vec::new(),
            goal,
        })
        .collect();
    for run in 0..s.runs {
        eprintln!("run {}/{} (load avg {})", run + 1, s.runs, uptime());
        let (_dir, pool) = fresh_pool(&s.base)?;
        let va = pool.create_volume("a", s.seq_bytes)?;
        let vb = pool.create_volume("b", s.seq_bytes)?;
        let vz = pool.create_volume("z", 4 * s.seq_bytes)?;
        let vr = pool.create_volume("r", rand_blocks * BLOCK as u64)?;
        let vf = pool.create_volume("f", rand_blocks * BLOCK as u64)?;
        let sel = |i: usize| {
            s.only
                .as_ref()
                .is_none_or(|o| names[i].0.contains(o.as_str()))
        };
        // Tests 1, 4, 5, 6 and 10 need volume a's data.
        let need_a = [0, 1, 4, 5, 6, 10].into_iter().any(sel);
        for (i, row) in rows.iter_mut().enumerate() {
            if !sel(i) {
                if i == 0 && need_a {
                    seq_write(&pool, &va, &data, s.seq_bytes, s.seq_writers, Wrap::Unique)?;
                }
                continue;
            }
            let r = match i {
                0 => with_cpu(|| {
                    seq_write(&pool, &va, &data, s.seq_bytes, s.seq_writers, Wrap::Unique)
                })?,
                // Same content as volume a: every block is already in the pool.
                1 => with_cpu(|| {
                    seq_write(&pool, &vb, &data, s.seq_bytes, s.seq_writers, Wrap::Repeat)
                })?,
                2 => with_cpu(|| {
                    let (z, n) = (&zeros, 4 * s.seq_bytes);
                    seq_write(&pool, &vz, z, n, s.seq_writers, Wrap::Repeat)
                })?,
                3 => with_cpu(|| {
                    let r = random_4k(&vr, s.threads, s.secs, rand_blocks, true)?;
                    pool.sync()?;
                    Ok(r)
                })?,
                4 => with_cpu(|| seq_read(&va, s.seq_bytes))?,
                5 => with_cpu(|| {
                    random_4k(&va, s.threads, s.secs, s.seq_bytes / BLOCK as u64, false)
                })?,
                6 => with_cpu(|| random_4k(&va, 1, s.secs, s.seq_bytes / BLOCK as u64, false))?,
                7 => with_cpu(|| {
                    let r = random_4k(&vf, 1, s.secs, rand_blocks, true)?;
                    pool.sync()?;
                    Ok(r)
                })?,
                8 => with_cpu(|| write_flush(&vf, s.secs, rand_blocks))?,
                10 => with_cpu(|| seq_overwrite(&pool, &va, &data, s.seq_bytes))?,
                // A database's log writes while its data pages are written at random.
                9 => with_cpu(|| {
                    let r = std::thread::scope(|scope| {
                        let writers =
                            scope.spawn(|| random_4k(&vr, s.threads, s.secs, rand_blocks, true));
                        let r = write_flush(&vf, s.secs, rand_blocks);
                        writers.join().expect("random writers")?;
                        r
                    })?;
                    pool.sync()?;
                    Ok(r)
                })?,
                _ => unreachable!("one arm per test name"),
            };
            eprintln!(
                "  {:<40} {:>8.0} MB/s {:>8.0} IOPS p50 {:>7.0} µs p99 {:>7.0} µs {:.2} cores {:.0} MB/CPU-s",
                row.name, r.mbps, r.iops, r.p50_us, r.p99_us, r.cores, r.mb_per_cpu_s
            );
            row.samples.push(r);
        }
        drop((va, vb, vz, vr, vf));
        pool.close()?;
    }
    Ok(rows)
}

/// Writes `blocks` unique compressible blocks (1 MiB writes) to volume `vol` from block `first`.
fn write_unique_compressible(vol: &Volume, first: u64, blocks: u64) -> Result<()> {
    let per = MIB as usize / BLOCK;
    let mut buf = compressible_template(MIB as usize);
    let mut b = 0;
    while b < blocks {
        let n = (blocks - b).min(per as u64) as usize;
        for i in 0..n {
            compressible_block(&mut buf[i * BLOCK..], first + b + i as u64);
        }
        vol.write((first + b) * BLOCK as u64, &buf[..n * BLOCK], false)?;
        b += n as u64;
    }
    Ok(())
}

fn scale(s: &Settings) -> Result<()> {
    let n = s.unique_blocks;
    let (dir, pool) = fresh_pool(&s.base)?;
    let path = dir.path().join("pool");
    // Room for the crash rounds' writes after the first n blocks.
    let vol = pool.create_volume("scale", 4 * n * BLOCK as u64 + (1 << 30))?;
    let rss0 = rss_bytes();
    let t0 = Instant::now();
    write_unique_compressible(&vol, 0, n)?;
    pool.sync()?;
    let write_s = t0.elapsed().as_secs_f64();
    let st = pool.stats();
    let rss1 = rss_bytes();
    let filter = st.dedup_filter_ram_bytes;
    println!(
        "## dedup index RAM at {} unique blocks ({} blocks written: 16-byte unique header + repeated pattern, LZ4-compressible; {:.1} s, {:.0} MB/s logical)",
        st.unique_chunks,
        n,
        write_s,
        (n * BLOCK as u64) as f64 / write_s / 1e6
    );
    println!();
    println!("| measure | value | per unique block | goal |");
    println!("|---|---|---|---|");
    let per = |b: u64| b as f64 / st.unique_chunks.max(1) as f64;
    println!(
        "| dedup filter RAM (live pool) | {:.1} MiB | {:.2} B | ≤ 4 B (aim 2): {} |",
        filter as f64 / MIB as f64,
        per(filter),
        if per(filter) <= 4.0 { "MET" } else { "MISSED" }
    );
    println!(
        "| process RSS growth while writing | {:.1} MiB | {:.2} B | — |",
        rss1.saturating_sub(rss0) as f64 / MIB as f64,
        per(rss1.saturating_sub(rss0))
    );
    println!(
        "| process RSS after writing | {:.1} MiB | {:.2} B | — |",
        rss1 as f64 / MIB as f64,
        per(rss1)
    );
    println!(
        "| physical / metadata bytes | {:.1} / {:.1} MiB | {:.1} / {:.1} B | — |",
        st.physical_bytes as f64 / MIB as f64,
        st.metadata_bytes as f64 / MIB as f64,
        per(st.physical_bytes),
        per(st.metadata_bytes)
    );
    drop(vol);
    pool.close()?;

    // Clean reopen: the filter is sized from the stored chunk count.
    let rss2 = rss_bytes();
    let t = Instant::now();
    let pool = Pool::open(&path, pool_config())?;
    let open_clean = t.elapsed();
    let t = Instant::now();
    pool.close()?;
    let close_clean = t.elapsed();
    let pool = Pool::open(&path, pool_config())?;
    let st2 = pool.stats();
    println!(
        "| dedup filter RAM after reopen | {:.1} MiB | {:.2} B | ≤ 4 B (aim 2): {} |",
        st2.dedup_filter_ram_bytes as f64 / MIB as f64,
        per(st2.dedup_filter_ram_bytes),
        if per(st2.dedup_filter_ram_bytes) <= 4.0 {
            "MET"
        } else {
            "MISSED"
        }
    );
    pool.close()?;
    let _ = rss2;
    println!();
    println!(
        "clean open: {:.1} ms; close right after (joins the filter rebuild): {:.1} ms",
        open_clean.as_secs_f64() * 1e3,
        close_clean.as_secs_f64() * 1e3
    );

    // Crash rounds: a child writes new unique blocks and is SIGKILLed mid-write.
    println!();
    println!(
        "## open after crash ({} unique blocks in the pool, child SIGKILLed mid-write)",
        st.unique_chunks
    );
    println!();
    println!("| round | Pool::open | first write+flush done | first read done | open → filter rebuilt (close joins it) | goal open ≤ 2 s |");
    println!("|---|---|---|---|---|---|");
    let exe = std::env::current_exe()?;
    let mut opens = Vec::new();
    for round in 0..s.crash_rounds {
        let seed = n + round as u64 * n / 2 + 1;
        let mut child = Command::new(&exe)
            .args(["crash-child", "--dir"])
            .arg(&path)
            .args(["--seed", &seed.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .context("spawn crash child")?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("child stdout")?).read_line(&mut line)?;
        if !line.starts_with("writing") {
            bail!("crash child did not start: {line:?}");
        }
        // Past the first background commit (1 s interval), into the middle of later writes.
        std::thread::sleep(Duration::from_millis(1500 + 300 * round as u64));
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        child.wait()?;
        let t = Instant::now();
        let pool = Pool::open(&path, pool_config())?;
        let open = t.elapsed();
        let vol = pool.volume("scale")?;
        let mut buf = compressible_template(BLOCK);
        compressible_block(&mut buf, u64::MAX - round as u64);
        vol.write(0, &buf, false)?;
        vol.flush()?;
        let first_write = t.elapsed();
        let mut rb = vec![0u8; BLOCK];
        vol.read(BLOCK as u64 * 12345 % (n * BLOCK as u64), &mut rb)?;
        let first_read = t.elapsed();
        drop(vol);
        pool.close()?;
        let rebuilt = t.elapsed();
        let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1e3);
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            round + 1,
            ms(open),
            ms(first_write),
            ms(first_read),
            ms(rebuilt),
            if open.as_secs_f64() <= 2.0 {
                "MET"
            } else {
                "MISSED"
            }
        );
        opens.push(open.as_secs_f64());
    }
    println!();
    println!(
        "open after crash: median {:.1} ms over {} rounds",
        median(opens) * 1e3,
        s.crash_rounds
    );
    Ok(())
}

fn crash_child(dir: &Path, seed: u64) -> Result<()> {
    let pool = Pool::open(dir, pool_config())?;
    let vol = pool.volume("scale")?;
    let mut out = std::io::stdout();
    writeln!(out, "writing")?;
    out.flush()?;
    let max_blocks = vol.size() / BLOCK as u64;
    let mut b = seed;
    loop {
        if b + 256 > max_blocks {
            b = seed;
        }
        write_unique_compressible(&vol, b, 256)?;
        b += 256;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past the end of its data, the unique test still writes blocks the pool has not seen,
    /// and incompressible ones; the others repeat the data.
    #[test]
    fn wrapped_unique_writes_stay_unique() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let (_pool_dir, pool) = fresh_pool(dir.path())?;
        let mut data = vec![0u8; MIB as usize];
        Rng(7).fill(&mut data);
        let total = 4 * MIB;
        let blocks = total / BLOCK as u64;
        let unique = pool.create_volume("u", total)?;
        seq_write(&pool, &unique, &data, total, 2, Wrap::Unique)?;
        let stats = pool.stats();
        assert_eq!(stats.unique_chunks, blocks);
        assert!(
            stats.physical_bytes >= total,
            "{} compressed",
            stats.physical_bytes
        );
        let repeated = pool.create_volume("r", total)?;
        seq_write(&pool, &repeated, &data, total, 2, Wrap::Repeat)?;
        assert_eq!(pool.stats().unique_chunks, blocks, "repeats are duplicates");
        Ok(())
    }
}
