//! The pool: opening and creating, volume management, space accounting.

use crate::catalog::Catalog;
use crate::config::PoolConfig;
use crate::dedup::Dedup;
use crate::dedup_index::RunPolicy;
use crate::disk::Disk;
use crate::error::{Error, Result};
use crate::format::{
    ChunkRecord, Frame, VolumeFormat, VolumeRecord, BLOCK_BYTES, SECTOR_BYTES, VOLUME_BYTES_MAX,
};
use crate::journal::Journal;
use crate::layer_filter::LayerFilters;
use crate::meta::{self, PoolRecord};
use crate::ref_log::{FoldRequest, RefLog};
use crate::segment::Segments;
use crate::space::Space;
use crate::stats::PoolStats;
use crate::store::Store;
use crate::volume::Volume;
use parking_lot::{Condvar, Mutex, RwLock};
use rustc_hash::{FxHashMap, FxHashSet};
use std::any::Any;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Number of dedup shards; a chunk id's low bits name its shard.
pub const SHARDS: usize = 64;
/// Bits of a chunk id that hold the shard.
pub const SHARD_BITS: u32 = 6;
/// Number of stripe locks per volume that order read-modify-writes of partial blocks.
pub const STRIPES: usize = 64;
/// Parallel segment append streams for new data (the cleaner has one more of its own).
pub const DATA_WRITERS: usize = 4;
/// Longest volume name.
pub const VOLUME_NAME_BYTES_MAX: usize = 128;

pub(crate) use crate::overlay::{Entry, Overlay};

impl VolumeMap {
    /// A zeroed range is still to settle (uncommitted, being committed, or left by a commit).
    pub fn has_zeroed(&self) -> bool {
        self.dirty.has_zeroed() || self.committing.has_zeroed()
    }
}

/// In-memory state of one volume.
pub(crate) struct VolumeState {
    /// Volume name, or `VOLUME@SNAPSHOT` for a snapshot.
    pub name: String,
    pub id: u64,
    pub created_unix_s: u64,
    /// Snapshots are read-only views of a frozen stack.
    pub read_only: bool,
    /// The [`VolumeFormat`] code; changed only with `map` locked (see `provision.rs`).
    pub format: AtomicU8,
    pub map: Mutex<VolumeMap>,
    pub stripes: Vec<Mutex<()>>,
    /// When the last range copy by frames into this volume happened (see `copy.rs`).
    pub frames_copied_at: Mutex<Option<std::time::Instant>>,
}

/// Most commits [`Inner::settle_zeroed`] runs (each settles at least
/// `PoolConfig::zero_settle_entries_max` entries or windows).
pub(crate) const SETTLE_COMMITS_MAX: usize = 1 << 16;

pub(crate) struct VolumeMap {
    pub size: u64,
    /// Map frames (layers seen through windows), bottom first; the last is the writable top
    /// layer. Changes only with the commit lock held (a catalog operation, or a range copy
    /// made permanent, see `copy.rs`) and, except for the latter, the gate held
    /// exclusively and no uncommitted changes (see `snapshot.rs`).
    pub stack: Vec<Frame>,
    /// Changes since the last swap.
    pub dirty: Overlay,
    /// Changes being committed (readers see them until the commit is durable).
    pub committing: Arc<Overlay>,
    /// Blocks mapped to data, including uncommitted changes.
    pub mapped_blocks: u64,
    /// Bumped whenever `committing` is cleared, so a writer knows its prefetch is stale.
    pub generation: u64,
    /// The volume was deleted; its handles fail.
    pub deleted: bool,
    /// The size or record changed and must be written at the next commit.
    pub record_dirty: bool,
}

/// Uncommitted chunk-level changes of one dedup shard. Fx hashing: the keys are chunk ids and
/// BLAKE3 fingerprints, and these maps see a few operations per block written.
#[derive(Default)]
pub(crate) struct ShardBatch {
    pub new_chunks: FxHashMap<u64, ChunkRecord>,
    pub fps: FxHashMap<[u8; 32], u64>,
    pub deltas: FxHashMap<u64, i64>,
}

impl ShardBatch {
    /// An empty batch with room for as many entries as `self` holds: the next batch of a
    /// steady write load is about as large, and its maps then skip growing step by step
    /// (each step rehashes into freshly allocated memory).
    pub fn sized_like(&self) -> ShardBatch {
        fn sized<K, V>(n: usize) -> FxHashMap<K, V> {
            FxHashMap::with_capacity_and_hasher(n, Default::default())
        }
        ShardBatch {
            new_chunks: sized(self.new_chunks.len()),
            fps: sized(self.fps.len()),
            deltas: sized(self.deltas.len()),
        }
    }
}

pub(crate) struct ShardState {
    pub dirty: ShardBatch,
    pub committing: Arc<ShardBatch>,
    /// Fingerprints whose chunk died in a commit not yet visible to readers of the store.
    pub dead_fps: FxHashSet<[u8; 32]>,
    /// Fingerprints of new chunks a writer is appending without the shard lock (see
    /// `prepare_group`): another writer of the same block waits for it to be placed.
    pub placing: FxHashSet<[u8; 32]>,
}

/// Committed counters and the reference-count log, owned by the committer.
pub(crate) struct CommitState {
    pub record: PoolRecord,
    pub ref_log: RefLog,
}

/// Everything a pool shares between its handles and its background thread.
pub(crate) struct Inner {
    pub dir: PathBuf,
    pub config: PoolConfig,
    pub db: Store,
    pub segments: Segments,
    /// Changes since the last commit, flushed to the journal files (see `journal.rs`).
    pub journal: Journal,
    /// The dedup filter, the dedup index's runs as committed and the count of commits that
    /// freed chunks (see `dedup.rs`).
    pub dedup: Dedup,
    /// Which blocks each layer holds entries for (see `layer_filter.rs`).
    pub layer_filters: LayerFilters,
    /// Capacity, used and reserved space, and the filesystem under the pool (see
    /// `space.rs`).
    pub space: Space,
    pub shards: Vec<Mutex<ShardState>>,
    /// Live volumes and snapshots, and those removed but not yet committed away (see
    /// `catalog.rs`).
    pub catalog: Catalog,
    /// Writers hold it shared for a whole write; the committer takes it exclusively to cut a
    /// consistent batch. Order: gate, then stripes, then a volume map or a shard.
    pub gate: RwLock<()>,
    pub commit: Mutex<CommitState>,
    /// Cleaning passes are serialized.
    pub gc_lock: Mutex<()>,
    /// Batches cut so far; writers stamp new records with `cut + 1`.
    pub cut: AtomicU64,
    /// Batches durably committed.
    pub committed: AtomicU64,
    pub chunk_seq: AtomicU64,
    pub dirty_blocks: AtomicU64,
    /// Paces writers to the commits' rate once the backlog grows (see `pacer.rs`); `None`
    /// without a background committer.
    pub pacer: Option<crate::pacer::Pacer>,
    /// Garbage's pressure and the cleaner's freeing rate; paces writers of new data when the
    /// cleaner falls behind (see `cleaner_pace.rs`).
    pub cleaner_pace: crate::cleaner_pace::CleanerPace,
    /// Cleaned segments whose moves the next commit applies (see `gc.rs`).
    pub relocations: crate::gc::Relocations,
    /// Writes preparing whole blocks right now (see `write_range`): a large write spreads its
    /// blocks over the helper threads only while fewer writes than cores are busy.
    pub preparing: AtomicUsize,
    /// CPU cores available to the process.
    pub cores: usize,
    pub failed: Mutex<Option<String>>,
    /// When a foreground request (read, write, zeroing, copy, flush) last ran, in milliseconds
    /// since `opened` (the cleaner yields to them; see `gc.rs`).
    pub last_io_ms: AtomicU64,
    pub opened: std::time::Instant,
    /// Orphan chunks may need freeing: the next commit runs even with nothing else to do.
    pub orphans_pending: AtomicBool,
    pub background: Mutex<Option<Background>>,
    /// The filter thread (`ibid-filters`): rebuilds the dedup filter after the pool opens and
    /// whenever the pool outgrows it, and builds the layer filters after the pool opens.
    pub rebuild_thread: Mutex<Option<JoinHandle<()>>>,
    /// Range copies in flight: their order, and those waiting to be applied together (see
    /// `copy.rs`).
    pub copies: crate::copy::Copies,
    pub wake: (Mutex<bool>, Condvar),
    pub(crate) _lock_file: Box<dyn Any + Send + Sync>,
}

pub(crate) struct Background {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
    /// The segment cleaner's thread (`gc::cleaner_loop`).
    cleaner: JoinHandle<()>,
}

/// Describes a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    /// Volume id: unique in the pool, never reused.
    pub id: u64,
    /// Volume name.
    pub name: String,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Blocks (4 KiB) mapped to non-zero data.
    pub mapped_blocks: u64,
    /// Creation time, seconds since the Unix epoch.
    pub created_unix_s: u64,
    /// Space reservation policy.
    pub format: VolumeFormat,
    /// Blocks "to be zeroed": never written (or zeroed since) in a lazy-zeroed thick volume;
    /// 0 for the other formats. Such blocks read as zeros at no cost either way.
    pub tbz_blocks: u64,
    /// Pool space this volume keeps reserved for its blocks that hold no data (thick only).
    pub reserved_bytes: u64,
}

/// A storage pool: a directory holding segment files and the metadata store.
///
/// Cloning a `Pool` gives another handle to the same open pool.
#[derive(Clone)]
pub struct Pool {
    pub(crate) inner: Arc<Inner>,
}

fn now_unix_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn lock_pool_dir(disk: &dyn Disk, dir: &Path) -> Result<Box<dyn Any + Send + Sync>> {
    (disk.lock_dir(dir))
        .map_err(|e| Error::io("open pool lock file", e))?
        .ok_or_else(|| Error::Locked(dir.display().to_string()))
}

/// Checks a volume name: 1–128 bytes of `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn validate_volume_name(name: &str) -> Result<()> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() || name.len() > VOLUME_NAME_BYTES_MAX {
        return Err(Error::InvalidArgument(format!(
            "a volume name has 1 to {VOLUME_NAME_BYTES_MAX} characters"
        )));
    }
    if !name.chars().all(ok_char) || name.starts_with(['.', '-']) {
        return Err(Error::InvalidArgument(format!(
            "volume name {name:?}: use letters, digits, '.', '_' and '-', not starting with '.' or '-'"
        )));
    }
    Ok(())
}

/// Checks a volume size: a positive multiple of 512 bytes, at most 1 PiB.
pub fn validate_volume_size(size: u64) -> Result<()> {
    if size == 0 || !size.is_multiple_of(SECTOR_BYTES) || size > VOLUME_BYTES_MAX {
        return Err(Error::InvalidArgument(format!(
            "volume size {}: must be a positive multiple of 512 bytes, at most 1 PiB",
            crate::units::format_exact(size)
        )));
    }
    Ok(())
}

impl Pool {
    /// Creates a new pool in `dir` (created if missing; must not already hold a pool).
    pub fn create(dir: impl AsRef<Path>, config: PoolConfig) -> Result<Pool> {
        let dir = dir.as_ref();
        let disk = &*config.disk;
        (disk.create_dir_all(dir)).map_err(|e| Error::io("create pool directory", e))?;
        if crate::store::exists_on(disk, dir) {
            return Err(Error::AlreadyExists(dir.display().to_string()));
        }
        if config.soft_threshold_pct == 0 || config.soft_threshold_pct > 100 {
            return Err(Error::InvalidArgument(
                "soft threshold must be 1 to 100 percent".into(),
            ));
        }
        let (fs_total, fs_avail) = crate::fs_space::statvfs(disk, dir)?;
        let capacity = match config.capacity_bytes {
            Some(c) if c > fs_avail && !config.capacity_force => {
                return Err(Error::InvalidArgument(format!(
                    "capacity {} is more than the filesystem under {} has available ({}); \
                     force it to promise space the filesystem may not have",
                    crate::units::format_size(c),
                    dir.display(),
                    crate::units::format_size(fs_avail)
                )))
            }
            Some(c) => c,
            // What the pool can fill before its writes meet the filesystem's metadata reserve.
            None => fs_avail.saturating_sub(
                crate::fs_space::reserve_for(fs_total) + crate::fs_space::RESERVE_FILE_BYTES,
            ),
        };
        let lock = lock_pool_dir(disk, dir)?;
        let db = Store::create_on(disk, dir, config.meta_backend)?;
        let record = PoolRecord {
            version: meta::POOL_FORMAT_VERSION,
            capacity_bytes: capacity,
            soft_threshold_pct: config.soft_threshold_pct as u64,
            next_chunk_seq: 1,
            next_segment_id: 1,
            next_volume_id: 1,
            next_layer_id: 1,
            created_unix_s: now_unix_s(),
            ..Default::default()
        };
        let mut txn = db.write()?;
        txn.insert(meta::POOL, meta::POOL_KEY, record.encode().as_slice());
        txn.commit()?;
        drop(db);
        // The store's file is durable; so must its name be before the pool is.
        (disk.sync_dir(dir)).map_err(|e| Error::io("sync pool directory", e))?;
        Self::open_locked(dir, config, lock)
    }

    /// Opens an existing pool. Recovery is bounded: it reads the pool record and the volume
    /// list, deletes segment files written after the last commit, and rebuilds the dedup
    /// filter in the background.
    pub fn open(dir: impl AsRef<Path>, config: PoolConfig) -> Result<Pool> {
        let dir = dir.as_ref();
        if !crate::store::exists_on(&*config.disk, dir) {
            return Err(Error::NotFound(format!("pool at {}", dir.display())));
        }
        let lock = lock_pool_dir(&*config.disk, dir)?;
        Self::open_locked(dir, config, lock)
    }

    /// Opens the pool in `dir`, creating it if it does not exist.
    pub fn open_or_create(dir: impl AsRef<Path>, config: PoolConfig) -> Result<Pool> {
        if crate::store::exists_on(&*config.disk, dir.as_ref()) {
            Self::open(dir, config)
        } else {
            Self::create(dir, config)
        }
    }

    fn open_locked(
        dir: &Path,
        config: PoolConfig,
        lock: Box<dyn Any + Send + Sync>,
    ) -> Result<Pool> {
        crate::recovery::open(dir, config, lock)
    }

    pub(crate) fn start_background(&self) {
        let stop = Arc::new(AtomicBool::new(false));
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let stop2 = stop.clone();
        let interval = Duration::from_millis(self.inner.config.background_interval_ms);
        let thread = std::thread::Builder::new()
            .name("ibid-background".into())
            .spawn(move || crate::gc::background_loop(weak, stop2, interval))
            .expect("spawn background thread");
        let (weak, stop2) = (Arc::downgrade(&self.inner), stop.clone());
        let cleaner = std::thread::Builder::new()
            .name("ibid-cleaner".into())
            .spawn(move || crate::gc::cleaner_loop(weak, stop2, interval))
            .expect("spawn cleaner thread");
        *self.inner.background.lock() = Some(Background {
            stop,
            thread,
            cleaner,
        });
    }

    /// Rebuilds the dedup filter from the index, then the layer filters from the map, in a
    /// background thread. Until each is done, every lookup it would spare consults the
    /// store (results stay exact; they are only slower).
    pub(crate) fn rebuild_filters_async(&self) {
        self.inner.spawn_filter_work(true);
    }

    /// Stops the background thread, commits everything, and closes the pool (the reference
    /// log is left for the next open to fold: see `ref_log.rs`).
    pub fn close(self) -> Result<()> {
        self.stop_background();
        // Not `sync`: the reference log stays for the next open to fold (folding all of it
        // would make a shutdown under load wait for a long commit; see `ref_log.rs`).
        self.inner.commit()?;
        self.inner.settle_zeroed(None)
    }

    fn stop_background(&self) {
        if let Some(bg) = self.inner.background.lock().take() {
            bg.stop.store(true, Ordering::Release);
            self.inner.wake_background();
            bg.cleaner.thread().unpark();
            let _ = bg.thread.join();
            let _ = bg.cleaner.join();
        }
        if let Some(t) = self.inner.rebuild_thread.lock().take() {
            let _ = t.join();
        }
    }

    /// One commit, which may leave part of a large zeroed range to later ones (for tests;
    /// [`Pool::sync`] settles everything).
    #[doc(hidden)]
    pub fn commit_once(&self) -> Result<()> {
        self.inner.commit()
    }

    /// Makes everything written so far durable and commits it to the metadata store, zeroed
    /// ranges settled (a [`Volume::flush`] is cheaper: it only journals).
    pub fn sync(&self) -> Result<()> {
        self.inner.commit()?;
        self.inner.settle_zeroed(None)?;
        self.inner.fold_ref_log()
    }

    /// Makes every write acknowledged so far (on any volume) durable: one journal write and
    /// fdatasync, not a metadata commit (see `journal.rs`).
    pub fn flush(&self) -> Result<()> {
        self.inner.flush()
    }

    /// Drops the pool the way a crash would: nothing more is committed or written; what a
    /// flush or commit made durable is all that survives (for tests of recovery). Volume
    /// handles must be dropped too before the pool can be reopened.
    #[doc(hidden)]
    pub fn simulate_crash(self) {
        self.stop_background();
        self.inner
            .failed
            .lock()
            .get_or_insert_with(|| "simulated crash".into());
    }

    /// Creates a thin volume of `size_bytes` (a multiple of 512, at most 1 PiB).
    pub fn create_volume(&self, name: &str, size_bytes: u64) -> Result<Volume> {
        self.create_volume_with_format(name, size_bytes, VolumeFormat::Thin)
    }

    /// Creates a volume of `size_bytes` in `format`, in O(1) whatever the size. A thick
    /// format reserves space for the whole volume, or fails with `CannotReserve`.
    pub fn create_volume_with_format(
        &self,
        name: &str,
        size_bytes: u64,
        format: VolumeFormat,
    ) -> Result<Volume> {
        validate_volume_name(name)?;
        validate_volume_size(size_bytes)?;
        self.inner.check_failed()?;
        let adding = self.inner.catalog.adding();
        let reserving = self.inner.space.reserving();
        let blocks = crate::provision::volume_blocks(size_bytes) as i64;
        if format.is_thick() {
            reserving.check(blocks, blocks)?;
        }
        let mut cs = self.inner.commit.lock();
        adding.check_free(&cs, name)?;
        let record = VolumeRecord {
            id: cs.record.next_volume_id,
            size: size_bytes,
            mapped_blocks: 0,
            created_unix_s: now_unix_s(),
            layers: vec![Frame::plain(cs.record.next_layer_id)],
            format,
        };
        let mut pool_rec = cs.record.clone();
        pool_rec.next_volume_id += 1;
        pool_rec.next_layer_id += 1;
        let mut txn = self.inner.db.write()?;
        txn.insert(meta::VOLUMES, name, record.encode().as_slice());
        txn.insert(meta::LAYERS, &record.top(), &1);
        self.inner.layer_filters.fresh(record.top());
        txn.insert(meta::POOL, meta::POOL_KEY, pool_rec.encode().as_slice());
        txn.commit()?;
        cs.record = pool_rec;
        let state = Arc::new(new_volume_state(name.to_string(), &record, false));
        if format.is_thick() {
            reserving.add(blocks, blocks);
        }
        drop(cs);
        adding.insert(state.clone());
        drop((reserving, adding));
        self.inner.check_soft_threshold();
        Ok(Volume::new(self.inner.clone(), state))
    }

    /// The in-memory state of the live volume `name`.
    pub(crate) fn live_state(&self, name: &str) -> Result<Arc<VolumeState>> {
        self.inner.catalog.volume(name)
    }

    /// Opens a handle on a volume.
    pub fn volume(&self, name: &str) -> Result<Volume> {
        Ok(Volume::new(self.inner.clone(), self.live_state(name)?))
    }

    /// Opens a handle on a volume by its id.
    pub fn volume_by_id(&self, id: u64) -> Result<Volume> {
        let state = self.inner.catalog.volume_by_id(id);
        let state = state.ok_or_else(|| Error::NotFound(format!("volume id {id}")))?;
        Ok(Volume::new(self.inner.clone(), state))
    }

    /// Lists the volumes, by name, with exact mapped counts (zeroed ranges not yet settled
    /// are committed first, see [`crate::Volume::mapped_blocks`]: that can take many commits
    /// after a large zero). Paths that need the names and sizes but must not wait use
    /// [`Pool::list_volumes_now`].
    pub fn list_volumes(&self) -> Vec<VolumeInfo> {
        if let Err(e) = self.inner.settle_zeroed(None) {
            tracing::warn!("commit to count zeroed blocks failed: {e}");
        }
        self.list_volumes_now()
    }

    /// Lists the volumes, by name, as they stand, without committing: while a zeroed range
    /// settles, a volume's mapped count (and what follows from it: unwritten, tbz) still
    /// includes the committed blocks the range hides, and can pass its size if blocks in
    /// the range were written again. For protocol paths (export and LUN lists, EXTENDED
    /// COPY's target lookup) and metrics scrapes.
    pub fn list_volumes_now(&self) -> Vec<VolumeInfo> {
        self.inner
            .catalog
            .volumes()
            .iter()
            .map(|v| volume_info(v))
            .collect()
    }

    /// Grows a volume to `new_size_bytes`. Shrinking is refused: it would destroy data. A
    /// thick volume reserves the added blocks, or fails with `CannotReserve`.
    pub fn resize_volume(&self, name: &str, new_size_bytes: u64) -> Result<()> {
        validate_volume_size(new_size_bytes)?;
        let reserving = self.inner.space.reserving();
        let state = self.live_state(name)?;
        {
            let mut map = state.map.lock();
            if new_size_bytes < map.size {
                return Err(Error::InvalidArgument(format!(
                    "volume {name:?} is {}; shrinking it to {} would discard data",
                    crate::units::format_exact(map.size),
                    crate::units::format_exact(new_size_bytes)
                )));
            }
            if state.format().is_thick() {
                let added = crate::provision::volume_blocks(new_size_bytes)
                    - crate::provision::volume_blocks(map.size);
                reserving.check(added as i64, added as i64)?;
                reserving.add(added as i64, added as i64);
            }
            map.size = new_size_bytes;
            map.record_dirty = true;
        }
        drop(reserving);
        self.inner.commit()
    }

    /// Deletes a volume and its snapshots (clones made from them live on). Space comes back
    /// through the cleaner.
    pub fn delete_volume(&self, name: &str) -> Result<()> {
        self.inner.check_failed()?;
        {
            let _gate = self.inner.gate.write();
            self.inner.catalog.remove_volume(name, |state, map| {
                if state.format().is_thick() {
                    self.inner.space.release(
                        crate::provision::reservation_share(map.size, map.mapped_blocks),
                        crate::provision::volume_blocks(map.size) as i64,
                    );
                }
            })?;
        }
        self.inner.commit()
    }

    /// A counter bumped whenever a volume or snapshot is created or deleted (front ends use it
    /// to tell initiators to rescan).
    pub fn catalog_generation(&self) -> u64 {
        self.inner.catalog.generation()
    }

    /// Whether the pool is past its soft threshold (as of the last commit). Cheap: front ends
    /// may call it for every command.
    pub fn soft_threshold_exceeded(&self) -> bool {
        self.inner.space.soft_warned()
    }

    /// Space accounting for the whole pool, exact as of the last commit (call [`Pool::sync`]
    /// first for figures that include every write acknowledged so far).
    pub fn stats(&self) -> PoolStats {
        self.inner.stats()
    }

    /// Layers whose filters are still being built after the pool opened (for tests).
    #[doc(hidden)]
    pub fn layer_filters_pending(&self) -> usize {
        self.inner.layer_filters.pending_layers().len()
    }

    /// Waits until the filters rebuilt in the background after the pool opened (dedup and
    /// layer filters) are ready; that rebuild commits once (for tests and benchmarks).
    #[doc(hidden)]
    pub fn wait_filters_built(&self) {
        let thread = self.inner.rebuild_thread.lock().take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }

    /// Cleans every segment that holds dead bytes when it is called, open ones included (for
    /// tests and benchmarks; the background thread does the same thing a little at a time).
    /// Segments sealed while it runs, its own output among them, are left to the background
    /// cleaner, so it ends however busy the pool is. Returns the segments cleaned.
    pub fn gc_now(&self) -> Result<u64> {
        {
            // Seal the open segments too, so their dead records can go.
            let _gate = self.inner.gate.write();
            self.inner
                .segments
                .seal_writers(DATA_WRITERS, self.inner.cut.load(Ordering::Acquire) + 1)?;
        }
        self.inner.flatten_all(true, &AtomicBool::new(false))?;
        self.sync()?;
        // Only the segments there now. The segments the cleaner fills meanwhile and those
        // concurrent writers seal become eligible as soon as a commit runs, and overwrites keep
        // putting dead bytes in them: a loop over "whatever qualifies" has no end while
        // writes and background commits go on.
        let committed = self.inner.committed.load(Ordering::Acquire);
        let mut remaining: HashSet<u64> = self
            .inner
            .segments
            .cleanable(committed)
            .into_iter()
            .collect();
        let mut cleaned = 0;
        while let Some(crate::gc::Cleaned { segment: seg, .. }) =
            self.inner.clean_one(true, Some(&remaining))?
        {
            remaining.remove(&seg);
            cleaned += 1;
        }
        // The passes' moves.
        self.inner.commit()?;
        Ok(cleaned)
    }

    /// Checks every invariant of the pool's metadata and data (see [`crate::verify`]).
    pub fn verify(&self) -> Result<crate::verify::VerifyReport> {
        self.sync()?;
        crate::verify::verify(&self.inner)
    }

    /// Paths of the segment files (for tests that corrupt them).
    pub fn segment_paths(&self) -> Vec<PathBuf> {
        let mut ids = self.inner.segments.ids();
        ids.sort_unstable();
        ids.into_iter()
            .map(|id| self.inner.segments.path(id))
            .collect()
    }

    /// The directory holding the pool.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }
}

impl Drop for Inner {
    /// A pool dropped without [`Pool::close`] still commits what it can: dropping the last
    /// handle should not behave like a crash.
    fn drop(&mut self) {
        if self.failed.lock().is_none() {
            if let Err(e) = self.commit() {
                tracing::error!("final commit of pool {}: {e}", self.dir.display());
            }
        }
    }
}

/// Builds rayon's global pool, on which a large write prepares its blocks (one thread per
/// core), with named threads (`ibid-prepare-N`), once per process. Built lazily instead, its
/// threads would take the name of whichever thread first used it (in `top` and profiles, the
/// preparing threads showed up as `ibid-filters`). Left alone if something else built it.
pub(crate) fn name_prepare_threads() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Err(e) = rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("ibid-prepare-{i}"))
            .build_global()
        {
            tracing::debug!("rayon's pool was built before the pool opened: {e}");
        }
    });
}

/// Fingerprints the dedup filter is sized for, given the chunks stored: 50 % headroom, so the
/// filter costs 1.5 × 10 bits ≈ 1.9 bytes per unique block when built and 1.25 bytes when the
/// pool has grown into it; it is then rebuilt larger. Each rebuild scans the whole index, so
/// the headroom sets the scanning cost of growth: every fingerprint is read about 3 times
/// while a pool fills (1 / (1 − 1/1.5)), where 25 % headroom read it 5 times. Never below
/// `min` ([`PoolConfig::dedup_filter_min`]): a pool that starts empty skips the rebuilds of its
/// first `min` chunks (from 64 Ki, seven scans and the commits they start before 1 Mi).
pub(crate) fn bloom_capacity(live_chunks: u64, min: u64) -> u64 {
    live_chunks.saturating_add(live_chunks / 2).max(min)
}

pub(crate) fn new_volume_state(name: String, r: &VolumeRecord, read_only: bool) -> VolumeState {
    VolumeState {
        name,
        id: r.id,
        created_unix_s: r.created_unix_s,
        read_only,
        format: AtomicU8::new(r.format.code()),
        map: Mutex::new(VolumeMap {
            size: r.size,
            stack: r.layers.clone(),
            dirty: Overlay::new(),
            committing: Arc::new(Overlay::new()),
            mapped_blocks: r.mapped_blocks,
            generation: 0,
            deleted: false,
            record_dirty: false,
        }),
        stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
        frames_copied_at: Mutex::new(None),
    }
}

pub(crate) fn volume_info(v: &VolumeState) -> VolumeInfo {
    let map = v.map.lock();
    let format = v.format();
    let unwritten = crate::provision::unwritten_blocks(map.size, map.mapped_blocks);
    VolumeInfo {
        id: v.id,
        name: v.name.clone(),
        size_bytes: map.size,
        mapped_blocks: map.mapped_blocks,
        created_unix_s: v.created_unix_s,
        format,
        tbz_blocks: if format == VolumeFormat::LazyZeroedThick {
            unwritten
        } else {
            0
        },
        reserved_bytes: if format.is_thick() {
            unwritten * crate::provision::RESERVED_BYTES_PER_BLOCK
        } else {
            0
        },
    }
}

impl Inner {
    /// Commits until no zeroed range is left to settle (see `commit.rs`) in `only`, or in any
    /// volume (no commit if none is): then the committed map, mapped counts, tbz, reservations
    /// and space are exact.
    /// Each commit settles a bounded part; zeroes arriving meanwhile are settled too, up to
    /// [`SETTLE_COMMITS_MAX`] commits.
    pub(crate) fn settle_zeroed(&self, only: Option<&VolumeState>) -> Result<()> {
        // A deleted volume's overlay is never emptied again (its handles may outlive it):
        // nothing waits on its ranges.
        let pending_in = |v: &VolumeState| {
            let map = v.map.lock();
            !map.deleted && map.has_zeroed()
        };
        let pending = || match only {
            Some(v) => pending_in(v),
            None => self.catalog.any_volume(pending_in),
        };
        let mut commits = 0;
        loop {
            if !pending() {
                return Ok(());
            }
            if commits == SETTLE_COMMITS_MAX {
                tracing::warn!("zeroed ranges still pending after {commits} commits");
                return Ok(());
            }
            self.commit()?;
            commits += 1;
        }
    }

    /// Folds the whole reference-count log into the chunk records in one commit (none if
    /// it is empty): then every chunk's record holds its count, the chunks left with no
    /// reference are freed, and the space figures are exact (see `ref_log.rs`).
    pub(crate) fn fold_ref_log(&self) -> Result<()> {
        self.fold_ref_log_with(FoldRequest::All).map(|_| ())
    }

    /// Commits, folding what `what` asks for (no commit if the log is empty). Returns whether
    /// the log still holds anything.
    pub(crate) fn fold_ref_log_with(&self, what: FoldRequest) -> Result<bool> {
        let mut cs = self.commit.lock();
        if cs.ref_log.entries() == 0 {
            return Ok(false);
        }
        cs.ref_log.request(what);
        self.commit_with(&mut cs)?;
        let more = cs.ref_log.entries() > 0;
        drop(cs);
        self.after_commit();
        Ok(more)
    }

    pub(crate) fn check_failed(&self) -> Result<()> {
        match &*self.failed.lock() {
            Some(why) => Err(Error::Failed(why.clone())),
            None => Ok(()),
        }
    }

    pub(crate) fn fail(&self, e: &Error) {
        tracing::error!("pool {} failed: {e}", self.dir.display());
        self.failed.lock().get_or_insert_with(|| e.to_string());
    }

    pub(crate) fn wake_background(&self) {
        let (m, c) = &self.wake;
        *m.lock() = true;
        c.notify_one();
    }

    /// When commits write and merge dedup index runs.
    pub(crate) fn run_policy(&self) -> RunPolicy {
        RunPolicy {
            keys_min: self.config.dedup_run_keys_min,
            runs_max: self.config.dedup_runs_max,
            slices: self.config.dedup_merge_slices,
        }
    }

    /// Rebuilds the dedup filter, then (if `layers`) the layer filters.
    fn filter_work(inner: &Arc<Self>, layers: bool) {
        if let Err(e) = inner.rebuild_bloom() {
            tracing::warn!("rebuild dedup filter: {e}");
        }
        if layers {
            if let Err(e) = inner.build_layer_filters() {
                tracing::warn!("build layer filters: {e}");
            }
        }
    }

    /// Runs a dedup filter rebuild (and with `layers`, the layer filters' builds) on the
    /// filter thread, `ibid-filters`, unless that thread is still busy with the previous one.
    /// Not on the background thread: the scan reads the whole index, and commits would wait
    /// for it. Returns whether it started. (Without threads, runs it here.)
    pub(crate) fn spawn_filter_work(self: &Arc<Self>, layers: bool) -> bool {
        if !self.config.threads {
            Self::filter_work(self, layers);
            return true;
        }
        let mut slot = self.rebuild_thread.lock();
        if slot.as_ref().is_some_and(|t| !t.is_finished()) {
            return false;
        }
        if let Some(done) = slot.take() {
            let _ = done.join();
        }
        let weak = Arc::downgrade(self);
        let thread = std::thread::Builder::new()
            .name("ibid-filters".into())
            .spawn(move || {
                if let Some(inner) = weak.upgrade() {
                    Self::filter_work(&inner, layers);
                }
            });
        match thread {
            Ok(t) => {
                *slot = Some(t);
                true
            }
            Err(e) => {
                tracing::warn!("start the filter thread: {e}");
                false
            }
        }
    }

    /// Replaces the filter with one sized for the current chunk count and fills it from the
    /// index. New chunks go into the new filter as soon as it is installed; a commit right after
    /// makes sure every older chunk is in the index snapshot the scan reads.
    pub(crate) fn rebuild_bloom(&self) -> Result<()> {
        let capacity = bloom_capacity(self.space.live_chunks(), self.config.dedup_filter_min);
        let bloom = self.dedup.grow_filter(capacity);
        self.commit()?;
        let t0 = std::time::Instant::now();
        let txn = self.db.read()?;
        let mut filled = 0u64;
        txn.for_each_key(meta::FPS, |key| {
            bloom.insert(meta::fps_key_prefix(key));
            filled += 1;
        })?;
        for key in self.dedup.runs().keys() {
            bloom.insert(meta::fps_key_prefix(key));
            filled += 1;
        }
        bloom.set_ready();
        tracing::debug!(
            "dedup filter: {filled} fingerprints into a filter for {capacity} in {:.1} ms",
            t0.elapsed().as_secs_f64() * 1e3
        );
        Ok(())
    }

    /// Completes the layer filters registered at open from one scan of each layer's entries
    /// (see `layer_filter.rs`).
    pub(crate) fn build_layer_filters(&self) -> Result<()> {
        let pending = self.layer_filters.pending_layers();
        if pending.is_empty() {
            return Ok(());
        }
        let txn = self.db.read()?;
        for layer in pending {
            let mut blocks = roaring::RoaringTreemap::new();
            let (lo, hi) = (
                crate::format::map_key(layer, 0),
                crate::format::map_key(layer, u64::MAX),
            );
            for item in txn.range(meta::MAP, lo..=hi)? {
                blocks.insert(crate::format::decode_map_key(&item?.0).1);
            }
            self.layer_filters.complete(layer, blocks);
        }
        Ok(())
    }

    pub(crate) fn stats(&self) -> PoolStats {
        let space = &self.space;
        let capacity = space.capacity();
        let physical = space.live_bytes();
        let meta_bytes = space.meta_bytes();
        let live_chunks = space.live_chunks();
        let (mut provisioned, mut thick, mut mapped) = (0u64, 0u64, 0u64);
        let volumes = self.catalog.volumes();
        for v in &volumes {
            let m = v.map.lock();
            provisioned += m.size;
            if v.format().is_thick() {
                thick += m.size;
            }
            mapped += m.mapped_blocks;
        }
        let reserved = space.reserved_bytes();
        let segment_file_bytes = self.segment_file_bytes();
        let used = physical + meta_bytes;
        let logical = mapped * BLOCK_BYTES as u64;
        let (fs_total, fs_avail) = space.fs().now();
        PoolStats {
            capacity_bytes: capacity,
            soft_threshold_pct: space.soft_threshold_pct() as u8,
            soft_threshold_exceeded: space.past_soft_threshold(fs_avail),
            filesystem_bytes: fs_total,
            filesystem_free_bytes: fs_avail,
            filesystem_reserve_bytes: space.fs().reserve_bytes(),
            volumes: volumes.len() as u64,
            provisioned_bytes: provisioned,
            thick_provisioned_bytes: thick,
            logical_written_bytes: logical,
            unique_bytes: live_chunks * BLOCK_BYTES as u64,
            unique_chunks: live_chunks,
            physical_bytes: physical,
            metadata_bytes: meta_bytes,
            used_bytes: used,
            reserved_bytes: reserved,
            overwrite_headroom_bytes: space.overwrite_headroom_bytes(),
            free_bytes: capacity.saturating_sub(used + reserved),
            segment_file_bytes,
            garbage_bytes: segment_file_bytes.saturating_sub(physical),
            data_reduction_ratio: if physical == 0 {
                1.0
            } else {
                logical as f64 / physical as f64
            },
            dedup_filter_ram_bytes: self.dedup.filter().ram_bytes(),
            layer_filter_ram_bytes: self.layer_filters.ram_bytes(),
            committed_batches: self.committed.load(Ordering::Relaxed),
        }
    }

    /// Notes that a foreground request runs now (see `last_io_ms`).
    pub(crate) fn note_io(&self) {
        self.last_io_ms
            .store(self.opened.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Bytes of all segment files ([`Segments::total_bytes`]: a counter, so the background
    /// thread may ask on every wake-up however many segments the pool has).
    pub(crate) fn segment_file_bytes(&self) -> u64 {
        self.segments.total_bytes()
    }

    /// Logs the soft threshold crossing once, and its clearing ([`Space::check_soft_threshold`]).
    pub(crate) fn check_soft_threshold(&self) {
        self.space.check_soft_threshold(&self.dir);
    }
}
