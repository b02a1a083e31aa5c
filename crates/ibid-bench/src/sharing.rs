//! `ibid-bench sharing`: snapshots, clones, range copy and deep clone chains measured against
//! the goals of issue 3 ("Measure it").
//!
//! Every run uses a fresh pool. The table gives, for each measurement, the median of `--runs`
//! runs and the spread (min–max), next to the goal; the seven-clones table gives each clone.

use super::{fresh_pool, median, random_4k, seq_read, uptime, Rng, BLOCK, MIB};
use anyhow::{ensure, Result};
use clap::Args;
use ibid_engine::{CopyReport, Pool, Volume};
use std::path::PathBuf;
use std::time::Instant;

const GIB: u64 = 1024 * MIB;
const TIB: u64 = 1024 * GIB;

#[derive(Args, Clone)]
pub(crate) struct SharingArgs {
    /// Tiny sizes and durations (finishes in seconds; for tests and smoke runs).
    #[arg(long)]
    quick: bool,
    /// Directory under which temporary pools are created (default: the system temp dir).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Runs (median and spread are reported).
    #[arg(long)]
    runs: Option<usize>,
    /// MiB of unique incompressible data written to the "fully written" volume (the issue
    /// asks for 8 GiB = 8192).
    #[arg(long)]
    size_mib: Option<u64>,
    /// Generations of the clone chain (clone of clone of ...).
    #[arg(long, default_value_t = 20)]
    depth: usize,
    /// Seconds per random-read test.
    #[arg(long)]
    secs: Option<f64>,
    /// 4 KiB writes per write-latency test (each to a distinct block).
    #[arg(long)]
    writes: Option<u64>,
}

struct Settings {
    base: PathBuf,
    runs: usize,
    size: u64,
    depth: usize,
    secs: f64,
    writes: u64,
}

impl Settings {
    fn from(a: &SharingArgs) -> Settings {
        let q = a.quick;
        Settings {
            base: a.dir.clone().unwrap_or_else(std::env::temp_dir),
            runs: a.runs.unwrap_or(if q { 1 } else { 3 }),
            size: a.size_mib.unwrap_or(if q { 64 } else { 2048 }) * MIB,
            depth: a.depth.max(1),
            secs: a.secs.unwrap_or(if q { 0.2 } else { 3.0 }),
            writes: a.writes.unwrap_or(if q { 2000 } else { 20_000 }),
        }
    }
}

/// How a row's median is judged.
#[derive(Clone, Copy)]
enum Goal {
    None,
    /// Median at most this.
    Max(f64),
    /// Median at least this.
    Min(f64),
    /// Every run exactly zero.
    Zero,
}

struct Row {
    name: String,
    unit: &'static str,
    digits: usize,
    goal: Goal,
    values: Vec<f64>,
}

/// The rows of the main table, in print order, filled run by run.
#[derive(Default)]
struct Table {
    rows: Vec<Row>,
}

impl Table {
    fn add(&mut self, name: &str, unit: &'static str, digits: usize, goal: Goal, v: f64) {
        eprintln!("  {name:<60} {v:>14.digits$} {unit}");
        if let Some(r) = self.rows.iter_mut().find(|r| r.name == name) {
            r.values.push(v);
        } else {
            self.rows.push(Row {
                name: name.to_string(),
                unit,
                digits,
                goal,
                values: vec![v],
            });
        }
    }

    fn print(&self) {
        println!("| measurement | unit | median (min–max) | goal |");
        println!("|---|---|---|---|");
        for r in &self.rows {
            println!(
                "| {} | {} | {} | {} |",
                r.name,
                r.unit,
                spread(&r.values, r.digits),
                verdict(r.goal, &r.values, r.unit)
            );
        }
    }
}

fn spread(v: &[f64], digits: usize) -> String {
    let med = median(v.to_vec());
    if v.len() < 2 {
        return format!("{med:.digits$}");
    }
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{med:.digits$} ({lo:.digits$}–{hi:.digits$})")
}

fn verdict(goal: Goal, v: &[f64], unit: &str) -> String {
    let m = median(v.to_vec());
    let (ok, text) = match goal {
        Goal::None => return "—".into(),
        Goal::Max(g) => (m <= g, format!("≤ {g} {unit}")),
        Goal::Min(g) => (m >= g, format!("≥ {g} {unit}")),
        Goal::Zero => (v.iter().all(|&x| x == 0.0), "0 in every run".into()),
    };
    format!("{} ({text})", if ok { "MET" } else { "MISSED" })
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Physical bytes and segment-file bytes after a sync (so every acknowledged write counts).
fn space(pool: &Pool) -> Result<(u64, u64)> {
    pool.sync()?;
    let st = pool.stats();
    Ok((st.physical_bytes, st.segment_file_bytes))
}

fn delta(after: u64, before: u64) -> f64 {
    after as f64 - before as f64
}

/// Writes `len` bytes of unique incompressible data with 1 MiB writes from offset `off`.
fn write_random(vol: &Volume, rng: &mut Rng, off: u64, len: u64) -> Result<()> {
    let mut buf = vec![0u8; MIB as usize];
    let mut o = off;
    while o < off + len {
        let n = (off + len - o).min(MIB) as usize;
        rng.fill(&mut buf[..n]);
        vol.write(o, &buf[..n], false)?;
        o += n as u64;
    }
    Ok(())
}

/// Times `op` (a metadata operation) and checks what it did to physical and segment-file bytes.
fn timed_meta(
    t: &mut Table,
    pool: &Pool,
    what: &str,
    op: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let (p0, s0) = space(pool)?;
    let t0 = Instant::now();
    op()?;
    let ms = ms_since(t0);
    let (p1, s1) = space(pool)?;
    t.add(&format!("{what}: time"), "ms", 2, Goal::Max(10.0), ms);
    add_space_rows(t, what, (p0, s0), (p1, s1));
    Ok(())
}

/// `n` distinct block indices below `blocks`, in random order.
fn distinct_blocks(rng: &mut Rng, blocks: u64, n: u64) -> Vec<u64> {
    let mut all: Vec<u64> = (0..blocks).collect();
    let n = n.min(blocks) as usize;
    for i in 0..n {
        let j = i + rng.below((all.len() - i) as u64) as usize;
        all.swap(i, j);
    }
    all.truncate(n);
    all
}

fn pct(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i] as f64 / 1000.0
}

pub(crate) fn sharing(a: &SharingArgs) -> Result<()> {
    let s = Settings::from(a);
    println!(
        "# ibid-bench sharing: runs={} size={} MiB depth={} secs={} writes={} (load avg {})",
        s.runs,
        s.size / MIB,
        s.depth,
        s.secs,
        s.writes,
        uptime()
    );
    let mut t = Table::default();
    // clones[i][run] = (ms, physical bytes after, physical bytes before the first clone)
    let mut clones: Vec<Vec<(f64, u64, u64)>> = vec![Vec::new(); 7];
    for run in 0..s.runs {
        eprintln!("run {}/{} (load avg {})", run + 1, s.runs, uptime());
        one_run(&s, run, &mut t, &mut clones)?;
    }
    println!();
    t.print();
    println!();
    println!(
        "## seven clones in a row of the written {} MiB volume (like seed 003)",
        s.size / MIB
    );
    println!();
    println!("| clone | time ms | physical after (MiB) | physical added (B) | goal < 10 ms, 0 B |");
    println!("|---|---|---|---|---|");
    for (i, c) in clones.iter().enumerate() {
        let ms: Vec<f64> = c.iter().map(|x| x.0).collect();
        let phys: Vec<f64> = c.iter().map(|x| x.1 as f64 / MIB as f64).collect();
        let added: Vec<f64> = c.iter().map(|x| delta(x.1, x.2)).collect();
        let ok = median(ms.clone()) < 10.0 && added.iter().all(|&x| x == 0.0);
        println!(
            "| {} | {} | {} | {} | {} |",
            i + 1,
            spread(&ms, 2),
            spread(&phys, 1),
            spread(&added, 0),
            if ok { "MET" } else { "MISSED" }
        );
    }
    println!();
    println!("# done (load avg {})", uptime());
    Ok(())
}

fn one_run(
    s: &Settings,
    run: usize,
    t: &mut Table,
    clones: &mut [Vec<(f64, u64, u64)>],
) -> Result<()> {
    let (_dir, pool) = fresh_pool(&s.base)?;
    let mut rng = Rng(0x5eed ^ run as u64);
    let size_name = if s.size.is_multiple_of(GIB) {
        format!("{} GiB", s.size / GIB)
    } else {
        format!("{} MiB", s.size / MIB)
    };

    // The fully written volume.
    let full = pool.create_volume("full", s.size)?;
    let t0 = Instant::now();
    write_random(&full, &mut rng, 0, s.size)?;
    pool.sync()?;
    let fill_s = t0.elapsed().as_secs_f64();
    t.add(
        &format!("fill: {size_name} unique incompressible, 1 MiB writes + sync"),
        "MB/s",
        0,
        Goal::None,
        s.size as f64 / fill_s / 1e6,
    );

    // The thin 1 TiB volume with a few writes (16 × 1 MiB spread over it).
    let thin = pool.create_volume("thin", TIB)?;
    for i in 0..16u64 {
        write_random(&thin, &mut rng, i * (TIB / 16) + i * 7 * MIB, MIB)?;
    }

    for (vol, label) in [
        ("full", format!("{size_name} written")),
        ("thin", "1 TiB thin, 16 MiB written".to_string()),
    ] {
        timed_meta(t, &pool, &format!("snapshot of {label}"), || {
            pool.create_snapshot(vol, "s1")?;
            Ok(())
        })?;
        timed_meta(
            t,
            &pool,
            &format!("clone of that snapshot ({label})"),
            || {
                pool.clone_volume(&format!("{vol}@s1"), &format!("{vol}-c1"))?;
                Ok(())
            },
        )?;
        timed_meta(
            t,
            &pool,
            &format!("fast clone of live volume ({label})"),
            || {
                pool.clone_volume(vol, &format!("{vol}-live"))?;
                Ok(())
            },
        )?;
    }

    // Seven clones in a row of the written volume.
    let (p0, _) = space(&pool)?;
    for (i, c) in clones.iter_mut().enumerate() {
        let t0 = Instant::now();
        pool.clone_volume("full", &format!("full-seven{}", i + 1))?;
        let ms = ms_since(t0);
        let (p, _) = space(&pool)?;
        eprintln!(
            "  seven clones: clone {} {:.2} ms physical {} B",
            i + 1,
            ms,
            p
        );
        c.push((ms, p, p0));
    }

    // copy_from of the written data into an empty volume.
    let dst = pool.create_volume("copy-dst", s.size)?;
    copy_rows(
        t,
        &pool,
        &format!("copy_from {size_name} written"),
        2000.0,
        || Ok(dst.copy_from(&full, 0, 0, s.size)?),
    )?;

    // copy_from of 370 GiB mostly unwritten (seed 004): the source holds the written data in
    // its first `size` bytes (placed by a metadata copy, so nothing is written), the rest
    // was never written.
    let big = 370 * GIB;
    let src370 = pool.create_volume("src370", big)?;
    src370.copy_from(&full, 0, 0, s.size)?;
    let dst370 = pool.create_volume("dst370", big)?;
    copy_rows(
        t,
        &pool,
        &format!("copy_from 370 GiB, first {size_name} written"),
        1000.0,
        || Ok(dst370.copy_from(&src370, 0, 0, big)?),
    )?;
    drop((dst, src370, dst370));

    deep_reads(s, t, &pool, &full)?;
    first_write(s, t, &pool, &full, &mut rng)?;

    drop((full, thin));
    pool.close()?;
    Ok(())
}

fn copy_rows(
    t: &mut Table,
    pool: &Pool,
    what: &str,
    goal_ms: f64,
    op: impl FnOnce() -> Result<CopyReport>,
) -> Result<()> {
    let (p0, s0) = space(pool)?;
    let t0 = Instant::now();
    let r = op()?;
    let ms = ms_since(t0);
    // The copy's new map entries reach the metadata store at the next commit (copy_from
    // itself commits when the pool's dirty-block limit is reached): time that commit too.
    let t1 = Instant::now();
    pool.sync()?;
    let sync_ms = ms_since(t1);
    let (p1, s1) = space(pool)?;
    // A copy by frames is made permanent in the background later (copy.rs); time that work,
    // which runs off the copy's path, with the cleaner pass gc_now adds.
    let t2 = Instant::now();
    pool.gc_now()?;
    let permanent_ms = ms_since(t2);
    t.add(&format!("{what}: time"), "ms", 1, Goal::Max(goal_ms), ms);
    t.add(
        &format!("{what}: then Pool::sync"),
        "ms",
        1,
        Goal::None,
        sync_ms,
    );
    t.add(
        &format!("{what}: then gc_now (made permanent, flattened, cleaned)"),
        "ms",
        1,
        Goal::None,
        permanent_ms,
    );
    t.add(
        &format!("{what}: CopyReport.shared_bytes"),
        "MiB",
        1,
        Goal::None,
        r.shared_bytes as f64 / MIB as f64,
    );
    t.add(
        &format!("{what}: CopyReport.data_bytes"),
        "B",
        0,
        Goal::Zero,
        r.data_bytes as f64,
    );
    t.add(
        &format!("{what}: physical before"),
        "MiB",
        1,
        Goal::None,
        p0 as f64 / MIB as f64,
    );
    add_space_rows(t, what, (p0, s0), (p1, s1));
    Ok(())
}

/// Reads of a clone `depth` generations deep against reads of its original, alternating the
/// two so both see the same machine load and page cache.
fn read_pair(s: &Settings, t: &mut Table, orig: &Volume, deep: &Volume, phase: &str) -> Result<()> {
    let blocks = s.size / BLOCK as u64;
    let d = s.depth;
    let mut o4 = Vec::new();
    let mut d4 = Vec::new();
    let mut os = Vec::new();
    let mut ds = Vec::new();
    // Warm both paths once (first touch of the deep clone's metadata).
    seq_read(orig, s.size.min(64 * MIB))?;
    seq_read(deep, s.size.min(64 * MIB))?;
    for _ in 0..2 {
        o4.push(random_4k(orig, 1, s.secs / 2.0, blocks, false)?.iops);
        d4.push(random_4k(deep, 1, s.secs / 2.0, blocks, false)?.iops);
        os.push(seq_read(orig, s.size)?.mbps);
        ds.push(seq_read(deep, s.size)?.mbps);
    }
    let (o4, d4, os, ds) = (median(o4), median(d4), median(os), median(ds));
    t.add(
        &format!("4 KiB random read QD1, original ({phase})"),
        "IOPS",
        0,
        Goal::None,
        o4,
    );
    t.add(
        &format!("4 KiB random read QD1, clone gen {d} ({phase})"),
        "IOPS",
        0,
        Goal::None,
        d4,
    );
    t.add(
        &format!("4 KiB random read: gen {d} / original ({phase})"),
        "ratio",
        3,
        Goal::Min(0.9),
        d4 / o4,
    );
    t.add(
        &format!("1 MiB seq read, original ({phase})"),
        "MB/s",
        0,
        Goal::None,
        os,
    );
    t.add(
        &format!("1 MiB seq read, clone gen {d} ({phase})"),
        "MB/s",
        0,
        Goal::None,
        ds,
    );
    t.add(
        &format!("1 MiB seq read: gen {d} / original ({phase})"),
        "ratio",
        3,
        Goal::Min(0.9),
        ds / os,
    );
    Ok(())
}

fn deep_reads(s: &Settings, t: &mut Table, pool: &Pool, full: &Volume) -> Result<()> {
    // The original: a single-layer volume holding the written data (a full clone: same chunks,
    // its own map).
    let orig = pool.full_clone("full", "gen0")?;
    let _ = full;
    let t0 = Instant::now();
    for g in 1..=s.depth {
        pool.clone_volume(&format!("gen{}", g - 1), &format!("gen{g}"))?;
    }
    let chain_ms = ms_since(t0);
    t.add(
        &format!("clone chain: {} clones of clones, total", s.depth),
        "ms",
        1,
        Goal::None,
        chain_ms,
    );
    let deep = pool.volume(&format!("gen{}", s.depth))?;
    pool.sync()?;
    // What lets a deep lookup skip the layers that cannot hold a block (layer_filter.rs).
    t.add(
        "layer filters RAM, whole pool (all volumes' layers)",
        "KiB",
        1,
        Goal::None,
        pool.stats().layer_filter_ram_bytes as f64 / 1024.0,
    );
    read_pair(s, t, &orig, &deep, "intermediates exist")?;

    for g in 1..s.depth {
        pool.delete_volume(&format!("gen{g}"))?;
    }
    let t0 = Instant::now();
    pool.gc_now()?;
    t.add(
        &format!("delete {} intermediates, then gc_now", s.depth - 1),
        "ms",
        0,
        Goal::None,
        ms_since(t0),
    );
    read_pair(s, t, &orig, &deep, "after delete + gc_now")?;
    // The data is still what was written.
    let (mut a, mut b) = (vec![0u8; MIB as usize], vec![0u8; MIB as usize]);
    full.read(s.size / 2, &mut a)?;
    deep.read(s.size / 2, &mut b)?;
    ensure!(a == b, "clone generation {} reads different data", s.depth);
    Ok(())
}

/// QD1 4 KiB unique writes to distinct blocks of a fully written volume, alternating between a
/// volume with no snapshot and one just snapshotted (so every write there is the first write
/// to that block since the snapshot).
fn first_write(
    s: &Settings,
    t: &mut Table,
    pool: &Pool,
    full: &Volume,
    rng: &mut Rng,
) -> Result<()> {
    let blocks = s.size / BLOCK as u64;
    // Two volumes with the same mapped data, each one layer (metadata copies).
    let plain = pool.full_clone("full", "w-plain")?;
    let snapped = pool.full_clone("full", "w-snap")?;
    let _ = full;
    pool.create_snapshot("w-snap", "before")?;
    pool.sync()?;
    let order = distinct_blocks(rng, blocks, s.writes);
    let mut buf = vec![0u8; BLOCK];
    rng.fill(&mut buf);
    let (mut lp, mut ls) = (Vec::new(), Vec::new());
    for (n, &b) in order.iter().enumerate() {
        buf[..8].copy_from_slice(&(n as u64).to_le_bytes());
        // Alternate which volume goes first, so neither always follows the other.
        let vols: [(&Volume, bool); 2] = if n % 2 == 0 {
            [(&plain, false), (&snapped, true)]
        } else {
            [(&snapped, true), (&plain, false)]
        };
        for (v, is_snap) in vols {
            buf[8] = is_snap as u8;
            let t0 = Instant::now();
            v.write(b * BLOCK as u64, &buf, false)?;
            let ns = t0.elapsed().as_nanos() as u64;
            if is_snap {
                ls.push(ns);
            } else {
                lp.push(ns);
            }
        }
    }
    pool.sync()?;
    lp.sort_unstable();
    ls.sort_unstable();
    let n = s.writes.min(blocks);
    for (p, label) in [(0.5, "p50"), (0.99, "p99")] {
        let (a, b) = (pct(&lp, p), pct(&ls, p));
        t.add(
            &format!("4 KiB write QD1 {label}, normal ({n} distinct blocks)"),
            "µs",
            1,
            Goal::None,
            a,
        );
        t.add(
            &format!("4 KiB write QD1 {label}, first write after snapshot"),
            "µs",
            1,
            Goal::None,
            b,
        );
        t.add(
            &format!("4 KiB write QD1 {label}: after snapshot / normal"),
            "ratio",
            3,
            Goal::Max(1.1),
            b / a,
        );
    }
    Ok(())
}

/// The two "nothing added" rows: physical bytes and segment-file bytes, before → after.
fn add_space_rows(t: &mut Table, what: &str, (p0, s0): (u64, u64), (p1, s1): (u64, u64)) {
    t.add(
        &format!("{what}: physical bytes added"),
        "B",
        0,
        Goal::Zero,
        delta(p1, p0),
    );
    t.add(
        &format!("{what}: segment-file bytes added"),
        "B",
        0,
        Goal::Zero,
        delta(s1, s0),
    );
}
