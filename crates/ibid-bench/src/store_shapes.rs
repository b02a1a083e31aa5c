//! `ibid-bench store-shapes`: what the metadata store costs per new block, for the row shapes
//! the engine uses today and for the ones a next pool format could use (issue 2's unique-write
//! goal is bound by the commit's store work; this measures the store alone, with redb
//! directly, so a format change can be judged before it is written).
//!
//! Each shape commits `--blocks` new unique blocks of one sequentially written volume in
//! transactions of `--batch` blocks (the engine's commit size), and reports the store's time
//! per block: inserts, commit (page writes and fsync), and the file size.
//!
//! - `flat` (today): per block one `chunks` row (chunk id → 64-byte record), one `map` row
//!   ((layer, block) as 16 big-endian bytes → chunk id) and one `fps` row (32-byte
//!   fingerprint → chunk id), the fingerprints inserted in key order (as the engine's seam
//!   applies a batch).
//! - `flat-fps16`: `fps` keyed by (first 8 bytes of the fingerprint, chunk id) as a `u128`
//!   (a lookup would scan the prefix and confirm the full fingerprint in the chunk record).
//! - `grouped`: `chunks` rows of 64 consecutive records (4 KiB) and `map` rows of 64
//!   consecutive entries (512 bytes); `fps` as in `flat`.
//! - `grouped-fps16`: grouped rows and the `u128` index.
//! - `grouped-nofps`: grouped rows and no index (the floor the index sits on).
//! - `flat-runs16`: flat `chunks` and `map` rows; the `u128` index keys of each transaction
//!   written as one sorted *run* (one row: run number → the keys, packed), and every
//!   [`MERGE_RUNS`] transactions the runs merged into the `u128` B-tree in that transaction (a
//!   two-level log-structured index: the B-tree's leaves are rewritten once per merge, not once
//!   per transaction).
//!
//! After writing, each shape also times [`LOOKUPS`] lookups of stored fingerprints, as the
//! engine's dedup path does them (for runs: a binary search in each run, then the B-tree).

use anyhow::{Context, Result};
use clap::Args;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use std::path::PathBuf;
use std::time::Instant;

const CHUNKS: TableDefinition<u64, &[u8]> = TableDefinition::new("chunks");
const MAP: TableDefinition<&[u8], u64> = TableDefinition::new("map.bytes");
const FPS: TableDefinition<&[u8], u64> = TableDefinition::new("fps.bytes");
const FPS16: TableDefinition<u128, ()> = TableDefinition::new("fps.u128");
const CHUNK_GROUPS: TableDefinition<u64, &[u8]> = TableDefinition::new("chunk.groups");
const FPS_RUNS: TableDefinition<u64, &[u8]> = TableDefinition::new("fps.runs");
/// Transactions whose index runs are merged into the B-tree at once (`flat-runs16`).
const MERGE_RUNS: u64 = 8;
/// Lookups timed per shape.
const LOOKUPS: u64 = 100_000;
const MAP_GROUPS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("map.groups");

/// Records or entries per grouped row.
const GROUP: u64 = 64;
/// Bytes of a chunk record (as `format::ChunkRecord`).
const CHUNK_RECORD_BYTES: usize = 64;
const SHAPES: [&str; 6] = [
    "flat",
    "flat-fps16",
    "grouped",
    "grouped-fps16",
    "grouped-nofps",
    "flat-runs16",
];

/// Options of `ibid-bench store-shapes`.
#[derive(Args, Clone)]
pub struct StoreShapesArgs {
    /// Directory for the temporary database files (default: the system temp dir).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// New blocks committed per shape.
    #[arg(long, default_value_t = 1 << 20)]
    blocks: u64,
    /// Blocks per transaction (the engine commits about 64 Ki at a time under load).
    #[arg(long, default_value_t = 65_792)]
    batch: u64,
    /// Only the shapes whose name contains this.
    #[arg(long)]
    only: Option<String>,
}

/// One shape's result.
struct Cost {
    insert_s: f64,
    commit_s: f64,
    file_bytes: u64,
    /// Seconds for [`LOOKUPS`] lookups (`None`: the shape has no index).
    lookup_s: Option<f64>,
}

/// Runs every selected shape and prints one Markdown table.
pub fn store_shapes(a: &StoreShapesArgs) -> Result<()> {
    let base = match &a.dir {
        Some(d) => tempfile::tempdir_in(d),
        None => tempfile::tempdir(),
    }
    .context("temp dir")?;
    println!(
        "# ibid-bench store-shapes: redb, {} new blocks per shape in transactions of {}",
        a.blocks, a.batch
    );
    println!();
    println!("| shape | µs per block | inserts µs | commit µs | file MiB | µs per lookup |");
    println!("|---|---|---|---|---|---|");
    for shape in SHAPES {
        if a.only.as_ref().is_some_and(|o| !shape.contains(o.as_str())) {
            continue;
        }
        let path = base.path().join(format!("{shape}.redb"));
        let c = run_shape(shape, &path, a.blocks, a.batch)?;
        let per = |s: f64| s * 1e6 / a.blocks as f64;
        let lookup = c.lookup_s.map_or("—".to_string(), |s| {
            format!("{:.2}", s * 1e6 / LOOKUPS as f64)
        });
        println!(
            "| {shape} | {:.2} | {:.2} | {:.2} | {} | {lookup} |",
            per(c.insert_s + c.commit_s),
            per(c.insert_s),
            per(c.commit_s),
            c.file_bytes >> 20
        );
        std::fs::remove_file(&path).ok();
    }
    println!();
    println!("# done");
    Ok(())
}

/// The fingerprint of block `i` (fingerprints are uniformly random, like BLAKE3's).
fn fingerprint(i: u64) -> [u8; 32] {
    *blake3::hash(&i.to_le_bytes()).as_bytes()
}

/// A `map` key: (layer 1, block) in big-endian bytes.
fn map_key(block: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&1u64.to_be_bytes());
    k[8..].copy_from_slice(&block.to_be_bytes());
    k
}

/// The `u128` index key of chunk `id` with fingerprint `fp`.
fn fps16_key(fp: &[u8; 32], id: u64) -> u128 {
    let prefix = u64::from_be_bytes(fp[..8].try_into().expect("8 bytes"));
    ((prefix as u128) << 64) | id as u128
}

fn run_shape(shape: &str, path: &std::path::Path, blocks: u64, batch: u64) -> Result<Cost> {
    let db = Database::create(path).context("create database")?;
    let grouped = shape.starts_with("grouped");
    let (mut insert_s, mut commit_s) = (0.0, 0.0);
    let mut done = 0;
    while done < blocks {
        let end = (done + batch).min(blocks);
        // Fingerprints are computed outside the timed part (the engine has them already).
        let mut fps: Vec<([u8; 32], u64)> = (done..end).map(|i| (fingerprint(i), i)).collect();
        let t0 = Instant::now();
        let txn = db.begin_write()?;
        if grouped {
            write_groups(&txn, done, end)?;
        } else {
            let mut chunks = txn.open_table(CHUNKS)?;
            let mut map = txn.open_table(MAP)?;
            for i in done..end {
                chunks.insert(i, [7u8; CHUNK_RECORD_BYTES].as_slice())?;
                map.insert(map_key(i).as_slice(), i)?;
            }
        }
        if shape.ends_with("runs16") {
            write_run(&txn, &fps, done / batch)?;
        } else if shape.ends_with("fps16") {
            let mut t = txn.open_table(FPS16)?;
            let mut keys: Vec<u128> = fps.iter().map(|(fp, id)| fps16_key(fp, *id)).collect();
            keys.sort_unstable();
            for k in keys {
                t.insert(k, ())?;
            }
        } else if !shape.ends_with("nofps") {
            fps.sort_unstable();
            let mut t = txn.open_table(FPS)?;
            for (fp, id) in &fps {
                t.insert(fp.as_slice(), id)?;
            }
        }
        let t1 = Instant::now();
        txn.commit()?;
        insert_s += (t1 - t0).as_secs_f64();
        commit_s += t1.elapsed().as_secs_f64();
        done = end;
    }
    let lookup_s = lookups(&db, shape, blocks)?;
    drop(db);
    Ok(Cost {
        insert_s,
        commit_s,
        file_bytes: std::fs::metadata(path)?.len(),
        lookup_s,
    })
}

/// Writes transaction `no`'s index keys as one sorted run; every [`MERGE_RUNS`]th
/// transaction merges the runs into the `u128` B-tree and removes them.
fn write_run(txn: &redb::WriteTransaction, fps: &[([u8; 32], u64)], no: u64) -> Result<()> {
    let mut keys: Vec<u128> = fps.iter().map(|(fp, id)| fps16_key(fp, *id)).collect();
    keys.sort_unstable();
    let mut runs = txn.open_table(FPS_RUNS)?;
    if (no + 1).is_multiple_of(MERGE_RUNS) {
        let mut all = keys;
        for item in runs.iter()? {
            let (_, v) = item?;
            all.extend(
                v.value()
                    .chunks_exact(16)
                    .map(|k| u128::from_be_bytes(k.try_into().expect("16 bytes"))),
            );
        }
        all.sort_unstable();
        let mut t = txn.open_table(FPS16)?;
        for k in all {
            t.insert(k, ())?;
        }
        runs.retain(|_, _| false)?;
    } else {
        let packed: Vec<u8> = keys.iter().flat_map(|k| k.to_be_bytes()).collect();
        runs.insert(no, packed.as_slice())?;
    }
    Ok(())
}

/// Times [`LOOKUPS`] lookups of stored fingerprints in one read transaction: the candidates
/// of the fingerprint's 8-byte prefix, as the engine's index lookup finds them.
fn lookups(db: &Database, shape: &str, blocks: u64) -> Result<Option<f64>> {
    if shape.ends_with("nofps") {
        return Ok(None);
    }
    let txn = db.begin_read()?;
    let step = (blocks / LOOKUPS).max(1);
    let t0 = Instant::now();
    let mut found = 0u64;
    for n in 0..LOOKUPS {
        let i = (n * step + n % step) % blocks;
        let fp = fingerprint(i);
        let hit = if shape.ends_with("fps16") || shape.ends_with("runs16") {
            let lo = fps16_key(&fp, 0);
            let hi = fps16_key(&fp, u64::MAX);
            let mut hit = txn
                .open_table(FPS16)
                .ok()
                .map(|t| -> Result<bool> { Ok(t.range(lo..=hi)?.next().is_some()) })
                .transpose()?
                .unwrap_or(false);
            if !hit && shape.ends_with("runs16") {
                let runs = txn.open_table(FPS_RUNS)?;
                for item in runs.iter()? {
                    let (_, v) = item?;
                    let packed = v.value();
                    let len = packed.len() / 16;
                    let key_at = |j: usize| {
                        u128::from_be_bytes(packed[j * 16..][..16].try_into().expect("16"))
                    };
                    let (mut a, mut b) = (0, len);
                    while a < b {
                        let m = (a + b) / 2;
                        if key_at(m) < lo {
                            a = m + 1;
                        } else {
                            b = m;
                        }
                    }
                    if a < len && key_at(a) <= hi {
                        hit = true;
                        break;
                    }
                }
            }
            hit
        } else {
            txn.open_table(FPS)?.get(fp.as_slice())?.is_some()
        };
        found += hit as u64;
    }
    let s = t0.elapsed().as_secs_f64();
    anyhow::ensure!(
        found == LOOKUPS,
        "{shape}: found {found} of {LOOKUPS} stored fingerprints"
    );
    Ok(Some(s))
}

/// Grouped rows for blocks (and chunk ids) `[from, to)`: a row already holding part of a
/// group (written by the previous transaction) is read and rewritten, as a real format would.
fn write_groups(txn: &redb::WriteTransaction, from: u64, to: u64) -> Result<()> {
    let mut chunks = txn.open_table(CHUNK_GROUPS)?;
    let mut map = txn.open_table(MAP_GROUPS)?;
    let mut i = from;
    while i < to {
        let g = i / GROUP;
        let end = ((g + 1) * GROUP).min(to);
        let mut records = vec![0u8; GROUP as usize * CHUNK_RECORD_BYTES];
        let mut entries = vec![0u8; GROUP as usize * 8];
        let key = map_key(g);
        if !i.is_multiple_of(GROUP) {
            if let Some(v) = chunks.get(g)? {
                records.copy_from_slice(v.value());
            }
            if let Some(v) = map.get(key.as_slice())? {
                entries.copy_from_slice(v.value());
            }
        }
        for j in i..end {
            let slot = (j % GROUP) as usize;
            records[slot * CHUNK_RECORD_BYTES..][..CHUNK_RECORD_BYTES].fill(7);
            entries[slot * 8..][..8].copy_from_slice(&j.to_le_bytes());
        }
        chunks.insert(g, records.as_slice())?;
        map.insert(key.as_slice(), entries.as_slice())?;
        i = end;
    }
    Ok(())
}
