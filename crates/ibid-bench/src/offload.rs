//! `ibid-bench offload`: push, restore and an instant restore's first reads against an
//! S3-compatible store (Ceph RGW from `scripts/ceph-rgw.sh`), each beside what `object_store`
//! itself does with the same bytes on the same store in the same run (issue 35's goals: push
//! and restore ≥ 0.8× the store's own PUTs and GETs; the first read of a block not fetched yet
//! ≤ 2× one GET).
//!
//! The store comes from the environment `scripts/ceph-rgw.sh start` prints
//! (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `IBID_TEST_BUCKET`); each
//! run writes under a prefix of its own. Per round, ibid and the peer (ibid first in even
//! rounds, the peer first in odd ones):
//! - **push** of a snapshot of `--size-mib` of incompressible data, against PUTs of as many
//!   8 MiB objects of random bytes as the push sent bytes, 4 at a time (as the push does);
//! - **restore** of it into a new volume, against GETs of the push's packs, 4 at a time,
//!   both after one untimed pass of GETs over the packs (the side that read them second was
//!   served from the store's caches: restores that went first measured 0.52–0.58× the GETs
//!   after them, restores that went second 0.85×, in the same run);
//! - **first reads**: an instant restore whose background fetch is not started, then 4 KiB
//!   reads at `--reads` random chunks (each fetches its 64 KiB chunk first), alternating with
//!   one ranged GET of a chunk record each (before the restore, on a pool of its own).

use super::{fresh_pool, median, Rng, MIB};
use anyhow::{Context, Result};
use bytes::Bytes;
use clap::Args;
use futures::{StreamExt, TryStreamExt};
use ibid_offload::{Progress, Remote, RemoteConfig};
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, PutPayload};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// What the push and restore keep in flight (the peer does the same).
const IN_FLIGHT: usize = 4;
/// Bytes of the peer's objects (a pack's size).
const OBJECT_BYTES: usize = 8 << 20;
/// Bytes of volume a chunk covers in the remote.
const CHUNK: u64 = 64 << 10;

#[derive(Args, Clone)]
pub(crate) struct OffloadArgs {
    /// Tiny sizes (finishes in seconds; for smoke runs).
    #[arg(long)]
    quick: bool,
    /// Directory under which temporary pools are created (default: the system temp dir).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// MiB of data pushed and restored.
    #[arg(long)]
    size_mib: Option<u64>,
    /// Rounds (each runs ibid and the peer, alternating).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// First reads timed per round.
    #[arg(long, default_value_t = 40)]
    reads: usize,
    /// Requests the peer keeps in flight (ibid's push and restore keep 4).
    #[arg(long, default_value_t = IN_FLIGHT)]
    depth: usize,
    /// Against `object_store`'s in-memory store instead of RGW, no peer: the CPU ibid's own
    /// side of a push and a restore costs (the process's, per GiB), without a gateway's
    /// work on the same cores.
    #[arg(long)]
    memory: bool,
}

fn env(name: &str) -> Result<String> {
    std::env::var(name).with_context(|| {
        format!("{name} is not set: run `eval \"$(scripts/ceph-rgw.sh start DIR)\"` first")
    })
}

pub(crate) fn offload(a: &OffloadArgs) -> Result<()> {
    let size = a.size_mib.unwrap_or(if a.quick { 32 } else { 1024 }) * MIB;
    let base = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    if a.memory {
        return in_memory(a, size, &base);
    }
    let run = format!(
        "bench-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs()
    );
    let config = |prefix: &str| -> Result<RemoteConfig> {
        Ok(RemoteConfig {
            endpoint: env("AWS_ENDPOINT_URL")?,
            bucket: env("IBID_TEST_BUCKET")?,
            region: std::env::var("AWS_REGION").ok(),
            prefix: Some(format!("{run}/{prefix}")),
            access_key_id: env("AWS_ACCESS_KEY_ID")?,
            secret_access_key: env("AWS_SECRET_ACCESS_KEY")?,
        })
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    println!(
        "offload: {} MiB of incompressible data, {} rounds, store {} (prefix {run}), load {}",
        size / MIB,
        a.rounds,
        env("AWS_ENDPOINT_URL")?,
        super::uptime()
    );
    println!("round\tpush MB/s\tPUT MB/s\tratio\trestore MB/s\tGET MB/s\tratio\tfirst read ms\tGET ms\tratio");
    let (mut push_r, mut restore_r, mut read_r) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..a.rounds {
        let (_dir, pool, mut rng) = snapshot_pool(&base, size, round)?;
        let c = config(&format!("r{round}"))?;
        let remote = Remote::s3(&c)?;
        let store = raw_store(&config(&format!("r{round}-peer"))?)?;
        let pack_store = raw_store(&c)?;

        // Who goes first alternates by round: the first writes into a fresh prefix, and the
        // first reads of objects the store has not served yet, are not the same work as the
        // second (the gateway's and the OSD's caches, the bucket index).
        let ibid_first = round % 2 == 0;
        // The push and the peer's PUTs of as many bytes. The peer's byte count is the push's,
        // so when the peer goes first it PUTs the size of the snapshot's data as the push will
        // send it (incompressible: the data and its record headers).
        let push = |rt: &tokio::runtime::Runtime| -> Result<(u64, f64)> {
            let t = Instant::now();
            let report = rt.block_on(remote.push(&pool, "v", "s", Arc::default()))?;
            Ok((report.bytes_sent, t.elapsed().as_secs_f64()))
        };
        let (sent, push_s, put_s) = if ibid_first {
            let (sent, push_s) = push(&rt)?;
            let put_s = rt.block_on(put_objects(&store, sent, &mut rng, a.depth))?;
            (sent, push_s, put_s)
        } else {
            let put_s = rt.block_on(put_objects(&store, pack_bytes(size), &mut rng, a.depth))?;
            let (sent, push_s) = push(&rt)?;
            // Rates, so a small difference in bytes does not matter; a large one would.
            anyhow::ensure!(
                sent.abs_diff(pack_bytes(size)) < sent / 100,
                "the push sent {sent} bytes, not about {} as the peer was given",
                pack_bytes(size)
            );
            (sent, push_s, put_s * sent as f64 / pack_bytes(size) as f64)
        };
        // On another pool (as on another server: nothing to deduplicate against): first reads
        // of an instant restore, alternating with one ranged GET of a record each, after the
        // store and the pool have settled; then a restore and the peer's GETs of the packs.
        let (_dir2, other) = fresh_pool(&base)?;
        std::thread::sleep(std::time::Duration::from_secs(5));
        let (read_ms, get_ms) = first_reads(&rt, &other, &remote, &pack_store, a.reads, &base)?;
        // Both sides read packs the store has served once (see the module doc).
        rt.block_on(get_packs(&pack_store, a.depth))?;
        let restore = |rt: &tokio::runtime::Runtime| -> Result<f64> {
            let t = Instant::now();
            rt.block_on(remote.restore(&other, "v", "s", "back", Arc::new(Progress::default())))?;
            Ok(t.elapsed().as_secs_f64())
        };
        let (restore_s, (got, get_s)) = if ibid_first {
            let restore_s = restore(&rt)?;
            (restore_s, rt.block_on(get_packs(&pack_store, a.depth))?)
        } else {
            let got = rt.block_on(get_packs(&pack_store, a.depth))?;
            (restore(&rt)?, got)
        };
        other.close()?;
        let mb = |bytes: u64, s: f64| bytes as f64 / s / 1e6;
        let (push, put) = (mb(sent, push_s), mb(sent, put_s));
        let (restore, get) = (mb(got, restore_s), mb(got, get_s));
        println!(
            "{round}{}\t{push:.0}\t{put:.0}\t{:.2}\t{restore:.0}\t{get:.0}\t{:.2}\t{read_ms:.1}\t{get_ms:.1}\t{:.2}",
            if ibid_first { "" } else { " (peer first)" },
            push / put,
            restore / get,
            read_ms / get_ms
        );
        push_r.push(push / put);
        restore_r.push(restore / get);
        read_r.push(read_ms / get_ms);
        pool.close()?;
        // The round's objects go (a test gateway's disk is small).
        for store in [&store, &pack_store] {
            rt.block_on(empty(store))?;
        }
    }
    println!(
        "medians: push {:.2}x the store's PUTs (goal >= 0.8), restore {:.2}x its GETs (goal >= 0.8), \
         first read {:.2}x one GET (goal <= 2); load {}",
        median(push_r),
        median(restore_r),
        median(read_r),
        super::uptime()
    );
    Ok(())
}

/// A fresh pool whose volume `v` holds `size` bytes of incompressible data (seeded by `round`)
/// and snapshot `s` of it; and the generator, to draw more.
fn snapshot_pool(
    base: &std::path::Path,
    size: u64,
    round: usize,
) -> Result<(tempfile::TempDir, ibid_engine::Pool, Rng)> {
    let (dir, pool) = fresh_pool(base)?;
    let v = pool.create_volume("v", size)?;
    let mut rng = Rng(round as u64 + 1);
    let mut buf = vec![0u8; 4 * MIB as usize];
    for off in (0..size).step_by(buf.len()) {
        rng.fill(&mut buf);
        v.write(off, &buf, false)?;
    }
    pool.create_snapshot("v", "s")?;
    Ok((dir, pool, rng))
}

/// [`offload`] against an in-memory store: per round, a push of a snapshot of `size` bytes of
/// incompressible data and a restore of it into another pool, timed and with the process's CPU
/// seconds (all its threads: the transfers, the pools' writers and commits) per GiB.
fn in_memory(a: &OffloadArgs, size: u64, base: &std::path::Path) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    println!(
        "offload --memory: {} MiB of incompressible data, {} rounds, load {}",
        size / MIB,
        a.rounds,
        super::uptime()
    );
    println!("round\tpush MB/s\tpush CPU-s/GiB\trestore MB/s\trestore CPU-s/GiB");
    let (mut push_cpu, mut restore_cpu) = (Vec::new(), Vec::new());
    let gib = size as f64 / (1u64 << 30) as f64;
    for round in 0..a.rounds {
        let (_dir, pool, _) = snapshot_pool(base, size, round)?;
        pool.flush()?;
        let remote = Remote::new(Arc::new(object_store::memory::InMemory::new()));
        let timed = |f: &dyn Fn() -> Result<()>| -> Result<(f64, f64)> {
            let (t, c) = (Instant::now(), super::cpu_seconds());
            f()?;
            Ok((t.elapsed().as_secs_f64(), super::cpu_seconds() - c))
        };
        let (push_s, push_c) = timed(&|| {
            rt.block_on(remote.push(&pool, "v", "s", Arc::default()))?;
            Ok(())
        })?;
        let (_dir2, other) = fresh_pool(base)?;
        let (restore_s, restore_c) = timed(&|| {
            let progress = Arc::new(Progress::default());
            rt.block_on(remote.restore(&other, "v", "s", "back", progress))?;
            Ok(())
        })?;
        let mb = |s: f64| size as f64 / s / 1e6;
        println!(
            "{round}\t{:.0}\t{:.2}\t{:.0}\t{:.2}",
            mb(push_s),
            push_c / gib,
            mb(restore_s),
            restore_c / gib
        );
        push_cpu.push(push_c / gib);
        restore_cpu.push(restore_c / gib);
        other.close()?;
        pool.close()?;
    }
    println!(
        "medians: push {:.2} CPU-s/GiB, restore {:.2} CPU-s/GiB; load {}",
        median(push_cpu),
        median(restore_cpu),
        super::uptime()
    );
    Ok(())
}

/// Bytes a push of `size` bytes of incompressible data sends: each 64 KiB chunk as one record
/// (its header and the chunk as it is).
fn pack_bytes(size: u64) -> u64 {
    size.div_ceil(CHUNK) * (CHUNK + ibid_offload::format::RECORD_HEADER_BYTES as u64)
}

/// Deletes every object of `store` (under its prefix).
async fn empty(store: &Arc<dyn ObjectStore>) -> Result<()> {
    let all: Vec<StorePath> = store
        .list(None)
        .map_ok(|m| m.location)
        .try_collect()
        .await?;
    futures::stream::iter(all)
        .map(|p| {
            let store = store.clone();
            async move { store.delete(&p).await }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

/// The store a remote uses, for the peer's own requests.
fn raw_store(c: &RemoteConfig) -> Result<Arc<dyn ObjectStore>> {
    let s3 = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(&c.endpoint)
        .with_allow_http(c.endpoint.starts_with("http://"))
        .with_bucket_name(&c.bucket)
        .with_region(c.region.as_deref().unwrap_or("us-east-1"))
        .with_access_key_id(&c.access_key_id)
        .with_secret_access_key(&c.secret_access_key)
        .build()?;
    let prefix = c.prefix.clone().unwrap_or_default();
    Ok(Arc::new(object_store::prefix::PrefixStore::new(s3, prefix)))
}

/// PUTs `bytes` in 8 MiB objects of random bytes, `depth` at a time; seconds taken.
async fn put_objects(
    store: &Arc<dyn ObjectStore>,
    bytes: u64,
    rng: &mut Rng,
    depth: usize,
) -> Result<f64> {
    let objects: Vec<Bytes> = (0..bytes.div_ceil(OBJECT_BYTES as u64))
        .map(|i| {
            let len = (bytes - i * OBJECT_BYTES as u64).min(OBJECT_BYTES as u64) as usize;
            let mut b = vec![0u8; len];
            rng.fill(&mut b);
            Bytes::from(b)
        })
        .collect();
    let t = Instant::now();
    futures::stream::iter(objects.into_iter().enumerate())
        .map(|(i, b)| {
            let store = store.clone();
            async move {
                store
                    .put(&StorePath::from(format!("peer/{i}")), PutPayload::from(b))
                    .await
            }
        })
        .buffer_unordered(depth)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(t.elapsed().as_secs_f64())
}

/// GETs every pack of the remote, `depth` at a time; (bytes, seconds).
async fn get_packs(store: &Arc<dyn ObjectStore>, depth: usize) -> Result<(u64, f64)> {
    let packs: Vec<StorePath> = store
        .list(Some(&StorePath::from("packs")))
        .map_ok(|m| m.location)
        .try_collect()
        .await?;
    let t = Instant::now();
    let sizes: Vec<u64> =
        futures::stream::iter(packs)
            .map(|p| {
                let store = store.clone();
                async move {
                    Ok::<_, object_store::Error>(store.get(&p).await?.bytes().await?.len() as u64)
                }
            })
            .buffer_unordered(depth)
            .try_collect()
            .await?;
    Ok((sizes.iter().sum(), t.elapsed().as_secs_f64()))
}

/// Median ms of a 4 KiB first read (fetching its chunk) at `n` random chunks of an instant
/// restore, and of one ranged GET of a chunk's record (64 KiB and its header) from a pack.
fn first_reads(
    rt: &tokio::runtime::Runtime,
    pool: &ibid_engine::Pool,
    remote: &Remote,
    packs: &Arc<dyn ObjectStore>,
    n: usize,
    base: &std::path::Path,
) -> Result<(f64, f64)> {
    let marks = tempfile::tempdir_in(base)?;
    let ir = rt.block_on(remote.instant_restore(pool, "v", "s", "instant", marks.path()))?;
    let chunks = ir.volume().size() / CHUNK;
    let pack_list: Vec<(StorePath, u64)> = rt.block_on(
        packs
            .list(Some(&StorePath::from("packs")))
            .map_ok(|m| (m.location, m.size))
            .try_collect(),
    )?;
    let mut rng = Rng(7);
    let (mut reads, mut gets) = (Vec::new(), Vec::new());
    let mut buf = vec![0u8; 4096];
    for i in 0..n {
        // ibid: a chunk not read before.
        let chunk = (i as u64 * 7919 + rng.next() % 7) % chunks;
        let off = chunk * CHUNK + (rng.next() % 16) * 4096;
        let t = Instant::now();
        ir.before_read(off, 4096)?;
        ir.volume().read(off, &mut buf)?;
        reads.push(t.elapsed().as_secs_f64() * 1e3);
        // The peer: one ranged GET of a record's size somewhere in a pack.
        let (path, size) = &pack_list[i % pack_list.len()];
        let len = CHUNK + 45;
        let start = (rng.next() % size.saturating_sub(len).max(1)).min(size - len.min(*size));
        let t = Instant::now();
        rt.block_on(packs.get_range(path, start..start + len.min(*size)))?;
        gets.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ir.stop();
    let spread = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        format!(
            "min {:.1} p90 {:.1} max {:.1}",
            v[0],
            v[v.len() * 9 / 10],
            v[v.len() - 1]
        )
    };
    eprintln!(
        "first reads ms: {}; GETs ms: {}",
        spread(&reads),
        spread(&gets)
    );
    Ok((median(reads), median(gets)))
}
