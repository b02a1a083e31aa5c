//! `ibid-bench xcopy`: range copies in 4 MiB segments with several in flight, as ESXi sends
//! EXTENDED COPY (issue 31, goal 4), inside one volume and across volumes, against the same
//! copy one segment at a time.
//!
//! For each (placement, queue depth): a fresh pool, `--size-mib` of unique data written at
//! the start of a source volume and synced, 1 MiB sequential reads of 256 MiB of it timed
//! (before), the copy (each thread takes the next segment; arrival order is what the
//! scheduler makes of it), then the same reads of the copied range at once and after
//! `--settle-secs` (after), and the time `Pool::close` takes. Prints one row per case.

use super::{fresh_pool, median, uptime, Rng, MIB};
use anyhow::{ensure, Result};
use clap::Args;
use ibid_engine::Volume;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const SEGMENT: u64 = 4 * MIB;

#[derive(Args, Clone)]
pub(crate) struct XcopyArgs {
    /// Tiny sizes (finishes in seconds; for tests and smoke runs).
    #[arg(long)]
    quick: bool,
    /// Directory under which temporary pools are created (default: the system temp dir).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// MiB copied (written first as unique data).
    #[arg(long)]
    size_mib: Option<u64>,
    /// Queue depths to measure (copies in flight).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    qd: Vec<usize>,
    /// Seconds to wait after the copy before the second read.
    #[arg(long)]
    settle_secs: Option<f64>,
}

struct Case {
    within: bool,
    qd: usize,
}

struct Outcome {
    copy_s: f64,
    worst_ms: f64,
    p99_ms: f64,
    read_before_ms: f64,
    read_at_once_ms: f64,
    read_after_ms: f64,
    close_ms: f64,
}

pub(crate) fn xcopy(a: &XcopyArgs) -> Result<()> {
    let size = a.size_mib.unwrap_or(if a.quick { 64 } else { 1024 }) * MIB;
    ensure!(
        size >= SEGMENT && size.is_multiple_of(SEGMENT),
        "size must be whole 4 MiB segments"
    );
    let settle = a.settle_secs.unwrap_or(if a.quick { 0.5 } else { 10.0 });
    let base = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    println!(
        "# ibid-bench xcopy: size={} MiB in 4 MiB segments, settle {settle} s (load avg {})",
        size / MIB,
        uptime()
    );
    println!();
    println!("| placement | in flight | copy s | worst command ms | p99 ms | read before ms | read at once ms | read after {settle} s ms | after/before | close ms |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for within in [true, false] {
        for &qd in &a.qd {
            let o = one(&base, size, settle, &Case { within, qd })?;
            println!(
                "| {} | {qd} | {:.3} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} | {:.2} | {:.0} |",
                if within {
                    "inside one volume"
                } else {
                    "across volumes"
                },
                o.copy_s,
                o.worst_ms,
                o.p99_ms,
                o.read_before_ms,
                o.read_at_once_ms,
                o.read_after_ms,
                o.read_after_ms / o.read_before_ms,
                o.close_ms
            );
        }
    }
    println!();
    println!("# done (load avg {})", uptime());
    Ok(())
}

fn one(base: &std::path::Path, size: u64, settle: f64, c: &Case) -> Result<Outcome> {
    let (_dir, pool) = fresh_pool(base)?;
    let src = pool.create_volume("src", 4 * size)?;
    let dst = if c.within {
        src.clone()
    } else {
        pool.create_volume("dst", 4 * size)?
    };
    let dst_off = if c.within { 2 * size } else { 0 };
    write_unique(&src, size)?;
    pool.sync()?;
    let probe = size.min(256 * MIB);
    let read_before_ms = median(
        (0..3)
            .map(|_| timed_read(&src, 0, probe))
            .collect::<Result<_>>()?,
    );

    let next = AtomicU64::new(0);
    let lat = Mutex::new(Vec::new());
    let t0 = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..c.qd)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    loop {
                        let at = next.fetch_add(SEGMENT, Ordering::Relaxed);
                        if at >= size {
                            return Ok(());
                        }
                        let t = Instant::now();
                        dst.copy_from(&src, at, dst_off + at, SEGMENT)?;
                        lat.lock()
                            .expect("lock")
                            .push(t.elapsed().as_secs_f64() * 1e3);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("copy thread")?;
        }
        Ok(())
    })?;
    let copy_s = t0.elapsed().as_secs_f64();
    let mut lat = lat.into_inner().expect("lock");
    lat.sort_by(f64::total_cmp);
    let worst_ms = *lat.last().unwrap_or(&0.0);
    let p99_ms = lat[((lat.len() as f64 * 0.99) as usize).min(lat.len() - 1)];

    let read_at_once_ms = timed_read(&dst, dst_off, probe)?;
    verify_sample(&src, &dst, dst_off, size)?;
    std::thread::sleep(Duration::from_secs_f64(settle));
    let read_after_ms = median(
        (0..3)
            .map(|_| timed_read(&dst, dst_off, probe))
            .collect::<Result<_>>()?,
    );
    drop((src, dst));
    let t = Instant::now();
    pool.close()?;
    let close_ms = t.elapsed().as_secs_f64() * 1e3;
    Ok(Outcome {
        copy_s,
        worst_ms,
        p99_ms,
        read_before_ms,
        read_at_once_ms,
        read_after_ms,
        close_ms,
    })
}

/// Writes `size` bytes of unique incompressible data from offset 0, 1 MiB at a time.
fn write_unique(vol: &Volume, size: u64) -> Result<()> {
    let mut rng = Rng(0x5eed_0001);
    let mut buf = vec![0u8; MIB as usize];
    for off in (0..size).step_by(MIB as usize) {
        rng.fill(&mut buf);
        vol.write(off, &buf, false)?;
    }
    Ok(())
}

fn timed_read(vol: &Volume, offset: u64, len: u64) -> Result<f64> {
    let t = Instant::now();
    let mut buf = vec![0u8; MIB as usize];
    for off in (offset..offset + len).step_by(MIB as usize) {
        vol.read(off, &mut buf)?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// Compares 16 pseudo-random 1 MiB ranges of the copy with the source.
fn verify_sample(src: &Volume, dst: &Volume, dst_off: u64, size: u64) -> Result<()> {
    let mut rng = Rng(7);
    let (mut a, mut b) = (vec![0u8; MIB as usize], vec![0u8; MIB as usize]);
    for _ in 0..16 {
        let off = rng.next() % (size / MIB) * MIB;
        src.read(off, &mut a)?;
        dst.read(dst_off + off, &mut b)?;
        ensure!(a == b, "the copy differs from its source at {off}");
    }
    Ok(())
}
