//! Pool configuration.

/// The cleaner yields to foreground I/O: by default it does not start a pass within this many
/// milliseconds of the last read, write, zeroing, copy or flush
/// ([`crate::PoolConfig::io_quiet_ms`]).
///
/// A pass reads whole segments and writes and fsyncs up to 16 MiB of relocated records: it
/// takes CPU and device time from the requests in flight, and a flush behind its fsync waits
/// for its writes: flush latency and random reads right after a random-write test suffer
/// while it runs (measurements: BENCHMARKS.md and docs/benchmarks/nbd-fio.md); see `gc.rs`.
pub(crate) const IO_QUIET_MS: u64 = 100;

/// Settings given when a pool is created or opened.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Capacity in bytes. `None` at creation: the free space of the filesystem less what the
    /// pool keeps free on it for metadata (see `fs_space.rs`). Ignored at open (the capacity
    /// is stored in the pool).
    pub capacity_bytes: Option<u64>,
    /// Accept a `capacity_bytes` larger than the filesystem has available (the pool then
    /// promises space the filesystem may not have; writes get ENOSPC when it fills).
    pub capacity_force: bool,
    /// Soft threshold in percent of capacity (default 80).
    pub soft_threshold_pct: u8,
    /// Largest segment file in bytes.
    pub segment_bytes_max: u64,
    /// Most segment files kept open at once (0, the default: half the process's soft limit
    /// on open files, between 16 and 65,536); past it, idle sealed files are closed and
    /// opened again when read (`segment::SegmentOptions::open_files_max`).
    pub segment_files_open_max: usize,
    /// Uncommitted map entries across the pool that trigger a background commit; past it,
    /// writers are paced to the commits' rate (see `pacer.rs`).
    pub dirty_blocks_commit: u64,
    /// Uncommitted map entries at which pacing admits writes at the commits' rate (twice it
    /// at `dirty_blocks_commit`, none at `dirty_blocks_max`); past it, before the pacer has
    /// measured a commit or without a background committer, a writer first waits for the
    /// commit in progress, if any.
    pub dirty_blocks_throttle: u64,
    /// Uncommitted map entries at which writers commit themselves (the hard limit).
    pub dirty_blocks_max: u64,
    /// Interval of the background thread's and the cleaner's rounds, in milliseconds.
    pub background_interval_ms: u64,
    /// Longest a change waits for a background commit while foreground I/O goes on, in
    /// milliseconds (a round commits at once when I/O pauses, or when the backlog reaches
    /// `dirty_blocks_commit`). Larger: fewer commits, each sharing the metadata pages it
    /// rewrites among more blocks, for more uncommitted state in memory and in the journal.
    pub commit_interval_ms: u64,
    /// How long foreground I/O must have paused, in milliseconds, before the cleaner starts a
    /// pass while garbage is small and the background thread settles zeroed ranges and folds
    /// the reference log (default 100; the simulator sets 0 so that they run between its
    /// operations).
    pub io_quiet_ms: u64,
    /// The cleaner rewrites a segment whose live fraction is below this percentage.
    pub gc_live_pct_max: u8,
    /// Run the background committer and cleaner thread (tests turn it off to step by hand).
    pub background: bool,
    /// Metadata store of a new pool. Ignored at open: a pool reopens with the backend it was
    /// created with. Default: [`crate::store::BACKEND_ENV`] if set, else redb.
    pub meta_backend: crate::store::Backend,
    /// Write segment files with `O_DIRECT` where the filesystem supports it (default): no copy
    /// into the page cache and no dirty pages for a sync to write back.
    pub direct_io: bool,
    /// Whole 4 KiB blocks from which a range copy adds frames to the destination's stack (cost
    /// independent of the length) instead of sharing each block's reference (see `copy/`).
    pub frame_copy_blocks_min: u64,
    /// Fingerprints the dedup filter is sized for at least (10 bits each: the default, 1 Mi,
    /// is 1.25 MiB of RAM and covers 4 GiB of unique data). Below it a growing pool never
    /// rebuilds the filter; past it, each rebuild sizes the filter for 1.5 × the chunks stored.
    pub dedup_filter_min: u64,
    /// New chunks a commit must have for their dedup index keys to be written as one sorted
    /// run rather than into the index's B-tree (see `dedup_index.rs`).
    pub dedup_run_keys_min: usize,
    /// Most runs the dedup index keeps: a commit that would keep as many merges the slices
    /// merged longest ago until the oldest runs go (with one slice: merges them all).
    pub dedup_runs_max: usize,
    /// Slices of the dedup index's key space merged into its B-tree separately (1: runs are
    /// only merged all at once, at `dedup_runs_max`). A commit merges the slices merged
    /// longest ago while the runs keep more than `dedup_run_keys_target` keys, so each merge
    /// rewrites a slice of the B-tree's leaves for all the keys the slice gathered (see
    /// `dedup_index.rs`).
    pub dedup_merge_slices: usize,
    /// Keys the dedup index's runs keep unmerged (16 bytes of memory each; 1 Mi = 16 MiB):
    /// the more, the fewer times a B-tree leaf is rewritten per new key. Keep it at most half
    /// of 2 Mi, past which a commit merges every run at once.
    pub dedup_run_keys_target: usize,
    /// Committed map entries (and windows) of zeroed ranges one commit settles (see
    /// `commit.rs`): a large zeroed range is settled over several commits, so each stays
    /// short and its memory bounded.
    pub zero_settle_entries_max: u64,
    /// Map entries one step of flattening moves (see `snapshot.rs`): a merge of two large
    /// layers runs as several short steps, each holding the pool's writes for its own
    /// transaction only, and a closing pool waits for one step at most.
    pub flatten_step_entries: u64,
    /// Where the pool's files live: the real filesystem ([`crate::disk::FsDisk`], the
    /// default) or a simulated disk ([`crate::disk::SimDisk`]).
    pub disk: std::sync::Arc<dyn crate::disk::Disk>,
    /// Run the engine's own threads (segment I/O and sync, parallel block preparation, the
    /// dedup filter's rebuild). Off, every step runs on the calling thread in a fixed order,
    /// so that the same operations do the same I/O (for the simulator; slower). The
    /// background committer is [`PoolConfig::background`].
    pub threads: bool,
    /// Memory for the read cache, in bytes (see `read_cache.rs`; 0: none). Default
    /// [`read_cache_bytes_default`]: a sixteenth of the machine's RAM, at most 2 GiB. Taken
    /// as blocks are cached, not at open.
    pub read_cache_bytes: u64,
    /// Where the engine logs its internal steps for diagnosis (see `event_log.rs`; `None`, the
    /// default: nowhere).
    pub events: Option<std::sync::Arc<crate::event_log::EventLog>>,
}

/// The read cache's default size: a sixteenth of the memory the process may use — the
/// machine's RAM, or its cgroup's limit (`memory.max`) if lower — at most 2 GiB (0 if neither
/// can be told).
pub fn read_cache_bytes_default() -> u64 {
    // SAFETY: `sysconf` only reads system configuration.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages <= 0 || page <= 0 {
        return 0;
    }
    let ram = pages as u64 * page as u64;
    let limit = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(u64::MAX);
    (ram.min(limit) / 16).min(2 << 30)
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            capacity_bytes: None,
            capacity_force: false,
            soft_threshold_pct: 80,
            segment_bytes_max: 32 << 20,
            segment_files_open_max: 0,
            dirty_blocks_commit: 256 << 10,
            dirty_blocks_throttle: 512 << 10,
            dirty_blocks_max: 1 << 20,
            background_interval_ms: 1000,
            commit_interval_ms: 4000,
            io_quiet_ms: IO_QUIET_MS,
            gc_live_pct_max: 50,
            background: true,
            meta_backend: crate::store::Backend::from_env(),
            frame_copy_blocks_min: 256,
            direct_io: true,
            dedup_filter_min: 1 << 20,
            dedup_run_keys_min: 4096,
            dedup_runs_max: 256,
            dedup_merge_slices: 64,
            dedup_run_keys_target: 1 << 20,
            zero_settle_entries_max: 64 << 10,
            flatten_step_entries: 16 << 10,
            disk: crate::disk::fs(),
            threads: true,
            read_cache_bytes: read_cache_bytes_default(),
            events: None,
        }
    }
}
