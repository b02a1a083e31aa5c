//! Opening a pool: recovery as named steps, each of which reads or repairs one thing.
//!
//! 1. [`make_room`]: on a full filesystem, the reserve file goes first, so that recovery has
//!    room to write.
//! 2. [`read_catalog`]: the pool record, volumes, snapshots, zeroed ranges left to settle,
//!    segment usage and the dedup index's runs (O(volumes), no map or chunk scan).
//! 3. [`upgrade_format`]: an older pool's tables move to this version's layout, in the
//!    transaction that rewrites the record (older builds refuse it from then on); the dedup
//!    index's runs are read again after it.
//! 4. [`read_journal`]: the changes journaled after the last commit; batches resume past every
//!    stamp a journal record can carry, so no stamp is used twice.
//! 5. [`open_chunk_store`]: segment files no commit and no journaled change references were
//!    written after the last commit: they are deleted.
//! 6. [`assemble`]: the in-memory pool (filters pending, shards empty, counters from the
//!    record).
//! 7. [`resume_zeroing`] then [`replay_journal`]: zeroed ranges the last commit did not
//!    settle, then the journal's newer changes, committed at once (a failed replay fails the
//!    pool, so that dropping it commits nothing partial).
//!
//! Then `Pool` starts what runs once the pool is consistent (`Pool::start`): the
//! soft-threshold alarm, the filters' rebuild, the reserve file and the background threads.

use crate::background::{Health, Threads};
use crate::bloom::Bloom;
use crate::catalog::Catalog;
use crate::chunk_fps::Stale;
use crate::commit_state::{Batches, CommitState};
use crate::config::PoolConfig;
use crate::dedup::Dedup;
use crate::dedup_index::Runs;
use crate::disk::Disk;
use crate::error::{Error, Result};
use crate::format::{self, NewChunkRecord, VolumeRecord};
use crate::fs_space::FsSpace;
use crate::inner::{bloom_capacity, name_prepare_threads, Inner};
use crate::journal::{Change, Journal};
use crate::layer_filter::LayerFilters;
use crate::meta::{self, PoolRecord};
use crate::ref_log::RefLog;
use crate::segment::DATA_WRITERS;
use crate::segment::{SegmentOptions, Segments};
use crate::shard::{ShardBatch, ShardState, SHARDS};
use crate::space::Space;
use crate::store::{Reader, Store};
use crate::volume_state::new_volume_state;
use parking_lot::{Mutex, RwLock};
use rustc_hash::FxHashSet;
use std::any::Any;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the metadata store says the pool is.
struct StoredCatalog {
    record: PoolRecord,
    volumes: BTreeMap<String, VolumeRecord>,
    snapshots: BTreeMap<String, VolumeRecord>,
    /// Volume id → zeroed ranges left to settle.
    zeroing: BTreeMap<u64, Vec<(u64, u64)>>,
    /// Segments with a usage record (written by a commit).
    segment_ids: HashSet<u64>,
    dedup_runs: Runs,
    ref_log: RefLog,
    fps_stale: Stale,
}

/// Opens the pool in `dir` (locked by `lock`): the steps of the module's doc, in order.
pub(crate) fn open(
    dir: &Path,
    config: PoolConfig,
    lock: Box<dyn Any + Send + Sync>,
) -> Result<Arc<Inner>> {
    let mut steps = Steps::new();
    make_room(&*config.disk, dir)?;
    let fs_space = FsSpace::new(config.disk.clone(), dir)?;
    let db = Store::open_on(&*config.disk, dir)?;
    steps.done("store");
    let mut catalog = read_catalog(&db)?;
    if upgrade_format(&db, &mut catalog.record, dir)? {
        let txn = db.read()?;
        catalog.dedup_runs = Runs::load(&txn)?;
        catalog.ref_log = RefLog::load(&txn)?;
        catalog.fps_stale = Stale::load(&txn)?;
    }
    steps.done("catalog");
    let journaled = read_journal(&*config.disk, dir, &mut catalog)?;
    let journaled_len = journaled.len();
    steps.done("journal read");
    let segments = open_chunk_store(&config, dir, &catalog, &journaled)?;
    let journal = Journal::open(&*config.disk, dir, config.direct_io)?;
    steps.done("segments");
    let zeroing = std::mem::take(&mut catalog.zeroing);
    let committed = catalog.record.commits;
    let inner = assemble(dir, config, lock, db, fs_space, segments, journal, catalog);
    inner.event(|| {
        format!(
            "open: batches resume after {committed}; {} journaled changes; left to settle {:?}",
            journaled.len(),
            zeroing
        )
    });
    steps.done("assemble");
    resume_zeroing(&inner, zeroing);
    replay_journal(&inner, journaled, &mut steps)?;
    tracing::info!(
        "pool {}: opened in {:.3} s ({journaled_len} journaled changes): {steps}",
        dir.display(),
        steps.total().as_secs_f64(),
    );
    Ok(inner)
}

/// How long each step of an open took, for the line that says where a recovery's time went.
struct Steps {
    started: Instant,
    last: Instant,
    took: Vec<(&'static str, Duration)>,
}

impl Steps {
    fn new() -> Steps {
        let now = Instant::now();
        Steps {
            started: now,
            last: now,
            took: Vec::new(),
        }
    }

    /// Ends step `name` (it began where the last one ended).
    fn done(&mut self, name: &'static str) {
        let now = Instant::now();
        self.took.push((name, now - self.last));
        self.last = now;
    }

    fn total(&self) -> Duration {
        self.last - self.started
    }
}

impl std::fmt::Display for Steps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (name, took)) in self.took.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{name} {:.3} s", took.as_secs_f64())?;
        }
        Ok(())
    }
}

/// Step 1: releases the reserve file if the filesystem has less than its size available.
fn make_room(disk: &dyn Disk, dir: &Path) -> Result<()> {
    if FsSpace::release_reserve_file_if_full(disk, dir)? {
        tracing::warn!(
            "pool {}: the filesystem is full; its reserve file was released so that the \
             pool can open (writes of new data get ENOSPC until space is freed)",
            dir.display()
        );
    }
    Ok(())
}

/// Step 2: reads the catalog from the metadata store.
fn read_catalog(db: &Store) -> Result<StoredCatalog> {
    let txn = db.read()?;
    let raw = txn
        .get(meta::POOL, meta::POOL_KEY)?
        .ok_or_else(|| Error::Corrupt("pool record missing".into()))?;
    let record = PoolRecord::decode(&raw)?;
    let mut volumes = BTreeMap::new();
    for item in txn.iter(meta::VOLUMES)? {
        let (k, v) = item?;
        volumes.insert(k, VolumeRecord::decode(&v)?);
    }
    let mut zeroing = BTreeMap::new();
    for item in txn.iter(meta::ZEROING)? {
        let (id, v) = item?;
        zeroing.insert(id, meta::decode_ranges(&v)?);
    }
    let mut snapshots = BTreeMap::new();
    for item in txn.iter(meta::SNAPSHOTS)? {
        let (k, v) = item?;
        snapshots.insert(k, VolumeRecord::decode(&v)?);
    }
    // An older format's log is in another layout until `upgrade_format` moves it.
    let ref_log = match record.version >= meta::REF_LOG_64_SLICES_VERSION {
        true => RefLog::load(&txn)?,
        false => RefLog::default(),
    };
    let mut segment_ids = HashSet::new();
    for item in txn.iter(meta::SEGMENTS)? {
        segment_ids.insert(item?.0);
    }
    Ok(StoredCatalog {
        record,
        volumes,
        snapshots,
        zeroing,
        segment_ids,
        dedup_runs: Runs::load(&txn)?,
        ref_log,
        fps_stale: Stale::load(&txn)?,
    })
}

/// Step 3: moves an older pool to this format version; returns whether it did.
fn upgrade_format(db: &Store, record: &mut PoolRecord, dir: &Path) -> Result<bool> {
    if record.version >= meta::POOL_FORMAT_VERSION {
        return Ok(false);
    }
    // The store moved its tables to this version's layout when it opened, and the chunk
    // records and map entries move into pages here, in the transaction that rewrites the record, so older
    // builds refuse the pool from now on.
    tracing::info!(
        "pool {}: format version {} upgraded to {}",
        dir.display(),
        record.version,
        meta::POOL_FORMAT_VERSION
    );
    let old_version = record.version;
    record.version = meta::POOL_FORMAT_VERSION;
    let mut txn = db.write()?;
    // Nothing reads the pool yet: a format-10 map moves into the table, not into memory.
    txn.write_through();
    if old_version < meta::FPS_APART_VERSION {
        let moved = crate::chunk_table::upgrade(&mut txn)?;
        if moved > 0 {
            tracing::info!(
                "pool {}: {moved} chunk records moved into pages of this format, their \
                 fingerprints apart",
                dir.display()
            );
        }
    }
    let moved = crate::map_table::upgrade(&mut txn)?;
    if moved > 0 {
        tracing::info!(
            "pool {}: {moved} map entries moved into pages",
            dir.display()
        );
    }
    if old_version < meta::REF_LOG_64_SLICES_VERSION {
        let moved = crate::ref_log::upgrade(&mut txn)?;
        if moved > 0 {
            tracing::info!(
                "pool {}: {moved} logged reference changes moved to the log's new slices",
                dir.display()
            );
        }
    }
    let layers = count_layer_refs(&mut txn)?;
    if layers > 0 {
        tracing::info!(
            "pool {}: reference counts of {layers} layers counted from the stacks",
            dir.display()
        );
    }
    let gone = crate::dedup_index::upgrade(&mut txn, record.commits)?;
    if gone > 0 {
        tracing::info!(
            "pool {}: {gone} dead dedup index keys moved into a gone row",
            dir.display()
        );
    }
    txn.insert(meta::POOL, meta::POOL_KEY, record.encode().as_slice());
    txn.commit()?;
    Ok(true)
}

/// Fills the `layers` table of a pool made before it existed (the first engine, pool format
/// 1: one layer per volume, no snapshots) from the stacks, so that snapshots and clones of
/// such a pool's volumes count their shared layers right; returns the layers counted (0 when
/// the table has rows already, or no stack references a layer).
fn count_layer_refs(txn: &mut crate::store::WriteTxn) -> Result<u64> {
    if !txn.iter(meta::LAYERS)?.is_empty() {
        return Ok(0);
    }
    let mut refs: std::collections::BTreeMap<u64, u64> = Default::default();
    for table in [meta::VOLUMES, meta::SNAPSHOTS] {
        for (_, v) in txn.iter(table)? {
            for layer in format::referenced_layers(&VolumeRecord::decode(&v)?.layers) {
                *refs.entry(layer).or_default() += 1;
            }
        }
    }
    for (layer, n) in &refs {
        txn.insert(meta::LAYERS, layer, n);
    }
    Ok(refs.len() as u64)
}

/// Step 4: the changes journaled after the last commit, with their stamps; the record's
/// commit counter moves past every stamp a journal record can carry.
fn read_journal(
    disk: &dyn Disk,
    dir: &Path,
    catalog: &mut StoredCatalog,
) -> Result<Vec<(u64, Change)>> {
    let committed = catalog.record.commits;
    let (journaled, highest_stamp) = crate::journal::read(disk, dir, committed)?;
    assert!(highest_stamp >= committed);
    debug_assert!(
        highest_stamp <= crate::journal::stamps_bound(committed),
        "a journal record of batch {highest_stamp} after commit {committed}"
    );
    // Batches resume past the last one that can have journaled (not only the last one
    // replayed: records that outlived a power cut behind one that did not are never read,
    // and must not pass for a later batch's), so no stamp is ever used twice.
    catalog.record.commits = crate::journal::resume_after(committed, highest_stamp);
    Ok(journaled)
}

/// Step 5: opens the segment files and deletes those nothing references.
fn open_chunk_store(
    config: &PoolConfig,
    dir: &Path,
    catalog: &StoredCatalog,
    journaled: &[(u64, Change)],
) -> Result<Segments> {
    let mut keep = catalog.segment_ids.clone();
    for (_, change) in journaled {
        if let Change::Chunk {
            rec, inline: None, ..
        } = change
        {
            keep.insert(rec.segment);
        }
    }
    name_prepare_threads();
    let options = SegmentOptions {
        writers: DATA_WRITERS + 1,
        segment_bytes_max: config.segment_bytes_max,
        next_id: catalog.record.next_segment_id,
        direct_io: config.direct_io,
        threads: config.threads,
        open_files_max: config.segment_files_open_max,
    };
    let (segments, found) = Segments::open_on(config.disk.clone(), &dir.join("segments"), options)?;
    for id in found.iter().filter(|id| !keep.contains(id)) {
        // Written after the last commit and not journaled: nothing references it.
        segments.remove(*id)?;
    }
    Ok(segments)
}

/// Step 6: the in-memory pool.
#[allow(clippy::too_many_arguments)]
fn assemble(
    dir: &Path,
    config: PoolConfig,
    lock: Box<dyn Any + Send + Sync>,
    db: Store,
    fs_space: FsSpace,
    segments: Segments,
    journal: Journal,
    catalog: StoredCatalog,
) -> Arc<Inner> {
    let StoredCatalog {
        record,
        volumes,
        snapshots,
        dedup_runs,
        ref_log,
        fps_stale,
        ..
    } = catalog;
    let bloom = Bloom::with_capacity(
        bloom_capacity(record.live_chunks, config.dedup_filter_min),
        false,
    );
    let shards = (0..SHARDS)
        .map(|_| {
            Mutex::new(ShardState {
                dirty: ShardBatch::default(),
                committing: Arc::new(ShardBatch::default()),
                dead_fps: FxHashSet::default(),
                placing: FxHashSet::default(),
            })
        })
        .collect();
    let (thick_unwritten, thick_blocks) = crate::provision::thick_totals(volumes.values());
    // Registered before anything can commit (see layer_filter.rs); built in the background.
    let layer_filters = LayerFilters::pending(
        volumes
            .values()
            .chain(snapshots.values())
            .flat_map(|r| format::referenced_layers(&r.layers))
            .collect::<HashSet<u64>>(),
    );
    let states = |records: BTreeMap<String, VolumeRecord>, read_only: bool| {
        records
            .into_iter()
            .map(|(name, r)| Arc::new(new_volume_state(name, &r, read_only)))
            .collect()
    };
    let space = Space::new(
        crate::space::Opening {
            capacity_bytes: record.capacity_bytes,
            soft_threshold_pct: record.soft_threshold_pct,
            live_chunks: record.live_chunks,
            live_bytes: record.live_bytes,
            meta_bytes: db.disk_bytes() + journal.disk_bytes(),
            thick_unwritten_blocks: thick_unwritten,
            thick_blocks,
        },
        fs_space,
    );
    Arc::new(Inner {
        dir: dir.to_path_buf(),
        db,
        segments,
        journal,
        dedup: Dedup::new(bloom, dedup_runs),
        layer_filters,
        space,
        shards,
        catalog: Catalog::new(states(volumes, false), states(snapshots, true)),
        gate: RwLock::new(()),
        batches: Batches::resume(record.commits),
        chunk_seq: AtomicU64::new(record.next_chunk_seq),
        preparing: AtomicUsize::new(0),
        cores: match config.threads {
            true => std::thread::available_parallelism().map_or(1, |n| n.get()),
            false => 1,
        },
        pacer: (config.background && config.threads).then(|| {
            crate::pacer::Pacer::new(crate::pacer::Limits {
                commit: config.dirty_blocks_commit,
                throttle: config.dirty_blocks_throttle,
                max: config.dirty_blocks_max,
            })
        }),
        cleaner_pace: Default::default(),
        relocations: Default::default(),
        health: Health::new(),
        threads: Threads::default(),
        copies: crate::copy::batch::Copies::default(),
        read_cache: Arc::new(crate::read_cache::ReadCache::new(config.read_cache_bytes)),
        commit: Mutex::new(CommitState {
            record,
            ref_log,
            fps_stale,
            building: BTreeSet::new(),
        }),
        gc_lock: Mutex::new(()),
        config,
        _lock_file: lock,
    })
}

/// Step 7a: zeroed ranges the last commit did not finish settling, before the journal's
/// newer changes (see `commit.rs`); the next commit settles them.
fn resume_zeroing(inner: &Inner, zeroing: BTreeMap<u64, Vec<(u64, u64)>>) {
    for (id, ranges) in zeroing {
        let Some(v) = inner.catalog.volume_by_id(id) else {
            continue;
        };
        let mut map = v.map.lock();
        for (b0, b1) in ranges {
            map.dirty.zero_under(b0, b1);
        }
        inner.batches.add_dirty(1);
    }
}

/// Step 7b: replays the journaled changes and commits them (each timed in `steps`).
fn replay_journal(inner: &Inner, journaled: Vec<(u64, Change)>, steps: &mut Steps) -> Result<()> {
    if journaled.is_empty() {
        return Ok(());
    }
    let replay = inner.replay(journaled).and_then(|()| {
        steps.done("replay");
        inner.commit()
    });
    if let Err(e) = replay {
        // Fail the pool so that dropping it does not commit a partial replay.
        inner.fail(&e);
        return Err(e);
    }
    steps.done("commit");
    Ok(())
}

impl Inner {
    /// Replays journaled changes into the dirty state (at open, before anything else runs).
    pub(crate) fn replay(&self, changes: Vec<(u64, Change)>) -> Result<()> {
        let volumes: std::collections::HashMap<u64, _> = self
            .catalog
            .volumes()
            .into_iter()
            .map(|v| (v.id, v))
            .collect();
        let mut replayed: Vec<String> = Vec::new();
        for (stamp, change) in changes {
            if self.config.events.is_some() {
                replayed.push(describe_change(stamp, &change, &volumes));
            }
            match change {
                Change::Chunk {
                    id,
                    mut rec,
                    fingerprint,
                    inline,
                } => {
                    match inline {
                        Some(payload) => {
                            let stamp = self.batches.stamp();
                            let placed = self.segments.append(0, id, rec.flags, &payload, stamp)?;
                            if placed.crc != rec.crc {
                                return Err(Error::Corrupt(format!(
                                    "journal: chunk {id:#x} payload does not match its checksum"
                                )));
                            }
                            rec.segment = placed.segment;
                            rec.offset = placed.offset;
                        }
                        None => {
                            let ok = self
                                .segments
                                .read_record(rec.segment, rec.offset, rec.stored_len)?
                                .is_some_and(|r| format::record_crc_ok(&r, rec.crc));
                            if !ok {
                                return Err(Error::Corrupt(format!(
                                    "journal: chunk {id:#x} is not in segment {:016x} at {}",
                                    rec.segment, rec.offset
                                )));
                            }
                        }
                    }
                    self.adopt_chunk(id, NewChunkRecord { rec, fingerprint });
                }
                Change::Install { volume, entries } => {
                    let Some(v) = volumes.get(&volume) else {
                        continue;
                    };
                    self.replay_install(v, entries)?;
                }
                Change::Zero { volume, b0, b1 } => {
                    let Some(v) = volumes.get(&volume) else {
                        continue;
                    };
                    self.zero_blocks(v, b0, b1)?;
                }
            }
        }
        self.event(|| format!("replayed: {}", replayed.join("; ")));
        Ok(())
    }
}

/// A journaled change in a few words (for the event log).
fn describe_change(
    stamp: u64,
    change: &Change,
    volumes: &std::collections::HashMap<u64, Arc<crate::volume_state::VolumeState>>,
) -> String {
    let name = |id: &u64| volumes.get(id).map_or("(deleted)", |v| v.name.as_str());
    match change {
        Change::Chunk { id, inline, .. } => {
            format!(
                "{stamp}: chunk {id:#x}{}",
                if inline.is_some() { " inline" } else { "" }
            )
        }
        Change::Install { volume, entries } => {
            let ids: Vec<String> = entries
                .iter()
                .take(64)
                .map(|(b, e)| match e {
                    crate::overlay::Entry::Data(id) => format!("{b}={id:#x}"),
                    crate::overlay::Entry::Zero => format!("{b}=0"),
                })
                .collect();
            format!("{stamp}: install {} {}", name(volume), ids.join(" "))
        }
        Change::Zero { volume, b0, b1 } => format!("{stamp}: zero {} {b0}..{b1}", name(volume)),
    }
}
