//! The pool: opening and creating, volume management, space accounting.

use crate::background::Background;
use crate::config::PoolConfig;
use crate::disk::Disk;
use crate::error::{Error, Result};
use crate::format::{Frame, VolumeFormat, VolumeRecord, SECTOR_BYTES, VOLUME_BYTES_MAX};
use crate::inner::Inner;
use crate::meta::{self, PoolRecord};
use crate::segment::DATA_WRITERS;
use crate::stats::PoolStats;
use crate::store::Store;
use crate::volume::Volume;
use crate::volume_state::{new_volume_state, volume_info, VolumeInfo, VolumeState};
use std::any::Any;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Longest volume name.
pub const VOLUME_NAME_BYTES_MAX: usize = 128;

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

    /// Opens an existing pool. Recovery is bounded by what was written since the last commit
    /// and by the map's logged changes, not by the pool's size: it reads the pool record, the
    /// volume list and the map log, replays the journal and commits it, deletes segment files
    /// written after the last commit, and rebuilds the dedup filter in the background. One
    /// log line says how long each step took.
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
        let pool = Pool {
            inner: crate::recovery::open(dir, config, lock)?,
        };
        pool.start();
        Ok(pool)
    }

    /// What runs once an opened pool is consistent: the soft-threshold alarm, the filters'
    /// rebuild, the reserve file and the background threads.
    fn start(&self) {
        self.inner.check_soft_threshold();
        self.rebuild_filters_async();
        if let Err(e) = self.inner.space.fs().restore_reserve_file() {
            tracing::warn!("pool reserve file: {e}");
        }
        if self.inner.config.background {
            self.start_background();
        }
    }

    pub(crate) fn start_background(&self) {
        let stop = Arc::new(AtomicBool::new(false));
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let stop2 = stop.clone();
        let interval = Duration::from_millis(self.inner.config.background_interval_ms);
        let commit_every = Duration::from_millis(self.inner.config.commit_interval_ms);
        let thread = std::thread::Builder::new()
            .name("ibid-background".into())
            .spawn(move || crate::gc::background_loop(weak, stop2, interval, commit_every))
            .expect("spawn background thread");
        let (weak, stop2) = (Arc::downgrade(&self.inner), stop.clone());
        let cleaner = std::thread::Builder::new()
            .name("ibid-cleaner".into())
            .spawn(move || crate::gc::cleaner_loop(weak, stop2, interval))
            .expect("spawn cleaner thread");
        self.inner.threads.started(Background {
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

    /// Stops the background thread, makes everything written durable with one commit, and
    /// closes the pool. Background work is left for the next open, so a close takes one
    /// bounded commit: the reference log's folds (`ref_log.rs`) and the part of large zeroed
    /// ranges a commit does not settle, which stays in the `zeroing` table (`commit.rs`;
    /// settling 16 GiB of zeroed data took a close 64 commits).
    pub fn close(self) -> Result<()> {
        self.stop_background();
        self.inner.commit()
    }

    fn stop_background(&self) {
        self.inner.threads.stop();
        self.inner.threads.join_filters();
    }

    /// One commit, which may leave part of a large zeroed range to later ones (for tests;
    /// [`Pool::sync`] settles everything).
    #[doc(hidden)]
    pub fn commit_once(&self) -> Result<()> {
        self.inner.commit()
    }

    /// Makes everything written so far durable and commits it to the metadata store, zeroed
    /// ranges settled, the entries of deleted layers deleted and the reference log folded, so
    /// that the space figures are exact (a [`Volume::flush`] is cheaper: it only journals).
    pub fn sync(&self) -> Result<()> {
        self.commit_all(true)
    }

    /// Commits everything written so far, zeroed ranges settled, folds the reference log and
    /// writes the map's logged changes back to its table; with `discard`, the entries of
    /// layers no stack shows are deleted first.
    fn commit_all(&self, discard: bool) -> Result<()> {
        self.inner.commit()?;
        self.inner.settle_zeroed(None)?;
        if discard {
            self.inner
                .discard_abandoned_layers(&AtomicBool::new(false), false)?;
        }
        self.inner.fold_ref_log()?;
        self.inner.db.write_back_all()
    }

    /// `Err(Error::Failed)` once the pool has failed (an I/O error or damage met by a write,
    /// flush or commit), as every later write and commit answers; `Ok` while it serves.
    pub fn check_failed(&self) -> Result<()> {
        self.inner.check_failed()
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
        self.inner.health.fail(|| "simulated crash".into());
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

    /// How long ago a foreground request (read, write, zeroing, copy, flush) last ran — since
    /// the pool opened, if none has. Front ends' background work (the server's space
    /// breakdown) waits for a pause with it, as the cleaner does.
    pub fn idle_for(&self) -> std::time::Duration {
        self.inner.since_last_io()
    }

    /// The read cache's size, fill and counters since the pool opened.
    pub fn read_cache_stats(&self) -> crate::ReadCacheStats {
        self.inner.read_cache.stats()
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
        self.inner.threads.join_filters();
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
                .seal_writers(DATA_WRITERS, self.inner.batches.stamp())?;
        }
        self.inner.flatten_all(true, &AtomicBool::new(false))?;
        // Deletes the entries of layers no stack shows, too.
        self.sync()?;
        // Only the segments there now. The segments the cleaner fills meanwhile and those
        // concurrent writers seal become eligible as soon as a commit runs, and overwrites keep
        // putting dead bytes in them: a loop over "whatever qualifies" has no end while
        // writes and background commits go on.
        let committed = self.inner.batches.committed();
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

    /// Checks every invariant of the pool's metadata and data (see [`crate::verify`]), after
    /// committing what [`Pool::sync`] commits but for the deletion of dropped layers' entries.
    pub fn verify(&self) -> Result<crate::verify::VerifyReport> {
        // The pool as it stands: layers no stack shows keep their entries (and references).
        self.commit_all(false)?;
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
