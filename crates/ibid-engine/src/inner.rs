//! `Inner`: everything a pool shares between its handles and its background threads — the
//! components it composes (store, segments, journal, dedup, space, catalog, ...) and the
//! commit state — and the methods every part of the engine uses (failure, wake-ups, filters,
//! statistics). The operations extend it in their own files (`commit.rs`, `volume/`,
//! `copy/`, `gc.rs`, `snapshot.rs`, ...).

use crate::background::{Health, Threads};
use crate::catalog::Catalog;
use crate::commit_state::{Batches, CommitState};
use crate::config::PoolConfig;
use crate::dedup::Dedup;
use crate::dedup_index::RunPolicy;
use crate::error::{Error, Result};
use crate::format::BLOCK_BYTES;
use crate::journal::Journal;
use crate::layer_filter::LayerFilters;
use crate::meta::{self};
use crate::provision::unwritten_blocks;
use crate::ref_log::FoldRequest;
use crate::segment::Segments;
use crate::shard::ShardState;
use crate::space::Space;
use crate::space::SpaceClaim;
use crate::stats::PoolStats;
use crate::store::Store;
use crate::volume_state::VolumeState;
use parking_lot::{Mutex, RwLock};
use std::any::Any;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;

/// Keys the filter thread's scans read between two looks at whether the pool is closing.
#[cfg(not(test))]
const CLOSING_CHECK_KEYS: u64 = 1 << 16;
/// Small in tests, so that a scan of a few keys gives up.
#[cfg(test)]
const CLOSING_CHECK_KEYS: u64 = 4;

/// Most commits [`Inner::settle_zeroed`] runs (each settles at least
/// `PoolConfig::zero_settle_entries_max` entries or windows).
pub(crate) const SETTLE_COMMITS_MAX: usize = 1 << 16;

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
    /// The batch numbering: cut, committed, blocks changed since the cut (see
    /// `commit_state.rs`).
    pub batches: Batches,
    /// Cleaning passes are serialized.
    pub gc_lock: Mutex<()>,
    pub chunk_seq: AtomicU64,
    /// Paces writers to the commits' rate once the backlog grows (see `pacer.rs`); `None`
    /// without a background committer.
    pub pacer: Option<crate::pacer::Pacer>,
    /// Garbage's pressure and the cleaner's freeing rate; paces writers of new data when the
    /// cleaner falls behind (see `cleaner_pace.rs`).
    pub cleaner_pace: crate::cleaner_pace::CleanerPace,
    /// Cleaned segments whose moves the next commit applies (see `relocations.rs`).
    pub relocations: crate::relocations::Relocations,
    /// Writes preparing whole blocks right now (see `write_range`): a large write spreads its
    /// blocks over the helper threads only while fewer writes than cores are busy.
    pub preparing: AtomicUsize,
    /// CPU cores available to the process.
    pub cores: usize,
    /// Whether the pool has failed, and when foreground I/O last ran (the cleaner yields to
    /// it; see `background.rs`).
    pub health: Health,
    /// The committer's, cleaner's and filter threads, and the committer's wake-up (see
    /// `background.rs`).
    pub threads: Threads,
    /// Range copies in flight: their order, and those waiting to be applied together (see
    /// `copy/`).
    pub copies: crate::copy::batch::Copies,
    /// Checked blocks kept in memory by chunk id (see `read_cache.rs`).
    pub read_cache: Arc<crate::read_cache::ReadCache>,
    pub(crate) _lock_file: Box<dyn Any + Send + Sync>,
}

impl Drop for Inner {
    /// A pool dropped without [`crate::Pool::close`] still commits what it can: dropping the last
    /// handle should not behave like a crash.
    fn drop(&mut self) {
        if self.health.failure().is_none() {
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
        match self.health.failure() {
            Some(why) => Err(Error::Failed(why)),
            None => Ok(()),
        }
    }

    pub(crate) fn fail(&self, e: &Error) {
        tracing::error!("pool {} failed: {e}", self.dir.display());
        self.event(|| format!("pool failed: {e}"));
        self.health.fail(|| e.to_string());
    }

    /// Logs an internal step to [`PoolConfig::events`], if set (`line` is built only then).
    pub(crate) fn event(&self, line: impl FnOnce() -> String) {
        if let Some(log) = &self.config.events {
            log.push(line());
        }
    }

    pub(crate) fn wake_background(&self) {
        self.threads.wake();
    }

    /// When commits write and merge dedup index runs.
    pub(crate) fn run_policy(&self) -> RunPolicy {
        RunPolicy {
            keys_min: self.config.dedup_run_keys_min,
            runs_max: self.config.dedup_runs_max,
            slices: self.config.dedup_merge_slices,
            keys_target: self.config.dedup_run_keys_target,
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
        let mut slot = self.threads.filters();
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
        if self.threads.closing() {
            return Ok(());
        }
        let capacity = bloom_capacity(self.space.live_chunks(), self.config.dedup_filter_min);
        let bloom = self.dedup.grow_filter(capacity);
        self.commit()?;
        let t0 = std::time::Instant::now();
        match self.fill_bloom(&bloom)? {
            Some(filled) => {
                bloom.set_ready(self.space.live_chunks());
                tracing::debug!(
                    "dedup filter: {filled} fingerprints into a filter for {capacity} in {:.1} ms",
                    t0.elapsed().as_secs_f64() * 1e3
                );
            }
            // The filter stays not ready: lookups go through the one it replaces.
            None => tracing::debug!("dedup filter: rebuild given up, the pool is closing"),
        }
        Ok(())
    }

    /// Inserts every live fingerprint of the committed index into `bloom`; returns how many,
    /// or `None` if the pool started closing meanwhile (checked every
    /// [`CLOSING_CHECK_KEYS`] keys).
    fn fill_bloom(&self, bloom: &crate::bloom::Bloom) -> Result<Option<u64>> {
        let txn = self.db.read()?;
        // Keys of chunks freed since the index's last merge are still in its B-tree (listed in
        // its gone rows until the merge removes them): left out, so the rebuilt filter holds
        // live fingerprints only, even after a large deletion.
        let gone: rustc_hash::FxHashSet<u128> = crate::dedup_index::Runs::load_gone(&txn)?
            .into_iter()
            .map(|(_, key)| key)
            .collect();
        let mut filled = 0u64;
        let mut seen = 0u64;
        let complete = txn.for_each_key_while(meta::FPS, |key| {
            if !gone.contains(&key) {
                bloom.insert(meta::fps_key_prefix(key));
                filled += 1;
            }
            seen += 1;
            !seen.is_multiple_of(CLOSING_CHECK_KEYS) || !self.threads.closing()
        })?;
        drop(gone);
        if !complete {
            return Ok(None);
        }
        for key in self.dedup.runs().keys() {
            bloom.insert(meta::fps_key_prefix(key));
            filled += 1;
        }
        Ok(Some(filled))
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
            let mut seen = 0u64;
            let mut closing = false;
            crate::map_table::scan_while(&txn, layer, 0, u64::MAX, |b, _| {
                if seen.is_multiple_of(CLOSING_CHECK_KEYS) && self.threads.closing() {
                    closing = true;
                    return false;
                }
                seen += 1;
                blocks.insert(b);
                true
            })?;
            if closing {
                // Pending filters exclude nothing: lookups probe the store.
                return Ok(());
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
        let filter = self.dedup.filter();
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
            dedup_filter_ram_bytes: filter.ram_bytes(),
            dedup_filter_capacity: filter.capacity(),
            dedup_filter_fingerprints: filter.inserted(),
            layer_filter_ram_bytes: self.layer_filters.ram_bytes(),
            committed_batches: self.batches.committed(),
        }
    }

    /// Notes that a foreground request runs now (see `last_io_ms`).
    pub(crate) fn note_io(&self) {
        self.health.note_io();
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

impl Inner {
    /// Claims `bytes` of pool space for a new chunk of volume `v` ([`Space::claim`]: a thick
    /// volume with blocks still without data is always admitted).
    pub(crate) fn reserve_space(&self, bytes: u64, v: &VolumeState) -> Result<SpaceClaim<'_>> {
        self.space.claim(bytes, v.format().is_thick(), || {
            let map = v.map.lock();
            unwritten_blocks(map.size, map.mapped_blocks) > 0
        })
    }

    /// Records that `v`'s mapped count changed by `delta` (call with its map locked): a thick
    /// volume's reservation follows it.
    pub(crate) fn note_mapped_change(&self, v: &VolumeState, delta: i64) {
        if delta != 0 && v.format().is_thick() {
            self.space.note_mapped_change(delta);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::format::{BLOCK_BYTES, RECORD_HEADER_BYTES};
    use crate::{Error, Pool, PoolConfig};
    use std::sync::{Arc, Barrier};

    /// A dedup filter rebuild under way when the pool starts closing gives up within a few
    /// keys (a close waited seconds for the scan of a large index): the grown filter stays not
    /// ready, and every indexed fingerprint still answers "maybe" through the one it replaces.
    #[test]
    fn a_filter_rebuild_gives_up_when_the_pool_closes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = PoolConfig {
            capacity_bytes: Some(1 << 30),
            capacity_force: true,
            background: false,
            ..PoolConfig::default()
        };
        let pool = Pool::create(dir.path().join("p"), config).expect("create");
        let v = pool.create_volume("v", 1 << 20).expect("v");
        for b in 0..40u64 {
            v.write(b * 4096, &crate::test_data::noise_block(b + 1), false)
                .expect("write");
        }
        pool.sync().expect("sync");
        let inner = pool.inner.clone();
        inner.threads.join_filters();
        let keys: Vec<u128> = inner
            .db
            .read()
            .expect("read")
            .iter(crate::meta::FPS)
            .expect("fps")
            .map(|e| e.expect("key").0)
            .collect();
        let indexed = keys.len() as u64 + inner.dedup.runs().keys().count() as u64;
        assert!(indexed >= 40, "{indexed} keys indexed");
        inner.threads.stop();
        assert!(inner.threads.closing());
        inner.rebuild_bloom().expect("rebuild");
        // Not even started once closing: the filter is the one built before.
        assert!(inner.dedup.filter().inserted() >= 40);
        // A rebuild that had started: its scan gives up after the first few keys.
        let grown = inner.dedup.grow_filter(1 << 16);
        assert_eq!(inner.fill_bloom(&grown).expect("fill"), None);
        assert!(keys.len() > super::CLOSING_CHECK_KEYS as usize);
        assert_eq!(
            grown.inserted(),
            super::CLOSING_CHECK_KEYS,
            "given up at the first look"
        );
        for key in &keys {
            assert!(
                grown.may_contain(crate::meta::fps_key_prefix(*key)),
                "an indexed fingerprint answers through the replaced filter"
            );
        }
        drop((v, inner));
        pool.close().expect("close");
    }

    /// A held claim counts as used space at once, so a second claim cannot take the same
    /// bytes; a failed claim and a dropped one count nothing; writers claiming at once never
    /// claim more than the free space together.
    #[test]
    fn claims_count_at_once_and_never_pass_the_capacity() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = PoolConfig {
            capacity_bytes: Some(64 << 20),
            background: false,
            ..PoolConfig::default()
        };
        let pool = Pool::create(dir.path().join("p"), config).expect("create");
        pool.create_volume("v", 1 << 30).expect("v");
        let inner = pool.inner.clone();
        // The filter rebuild started at creation commits when done, and a commit updates the
        // metadata's size: let it finish, so that the free space stays put below.
        inner.threads.join_filters();
        let v = inner.catalog.volume("v").expect("v");
        let free = inner.space.capacity() - inner.space.used_now();
        let chunk = (RECORD_HEADER_BYTES + BLOCK_BYTES) as u64;

        let held = inner
            .reserve_space(free - chunk, &v)
            .expect("most of the space");
        assert!(matches!(
            inner.reserve_space(2 * chunk, &v),
            Err(Error::NoSpace)
        ));
        let last = inner.reserve_space(chunk, &v).expect("the rest");
        assert_eq!(inner.space.used_now(), inner.space.capacity());
        drop((held, last));
        assert_eq!(inner.space.pending_bytes(), 0);

        let writers = 8;
        let start = Arc::new(Barrier::new(writers));
        let kept: u64 = (0..writers)
            .map(|_| {
                let (inner, v, start) = (inner.clone(), v.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    let mut kept = 0;
                    while let Ok(claim) = inner.reserve_space(chunk, &v) {
                        claim.keep();
                        kept += chunk;
                    }
                    kept
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().expect("writer"))
            .sum();
        assert!(kept <= free, "claimed {kept} of {free} free bytes");
        assert!(
            kept + writers as u64 * chunk > free,
            "claimed only {kept} of {free}"
        );
        assert_eq!(inner.space.pending_bytes(), kept as i64);
    }
}
