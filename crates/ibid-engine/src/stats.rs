//! Space accounting figures.

/// Where the pool's space went, exact as of the last commit.
///
/// Sums that hold (checked by the tests): `used = physical + metadata`,
/// `free = capacity - used - reserved` (floored at zero), `logical_written = Σ volumes' mapped blocks × 4 KiB`,
/// `garbage = segment files - physical`, and `physical` is the sum of the live records' sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolStats {
    /// Capacity of the pool.
    pub capacity_bytes: u64,
    /// Soft threshold in percent of capacity.
    pub soft_threshold_pct: u8,
    /// `used + reserved` has reached the soft threshold, or the filesystem under the pool
    /// has less than twice `filesystem_reserve_bytes` available.
    pub soft_threshold_exceeded: bool,
    /// Size of the filesystem under the pool.
    pub filesystem_bytes: u64,
    /// Bytes available on the filesystem under the pool (other files can take them too).
    pub filesystem_free_bytes: u64,
    /// Filesystem bytes kept free for metadata: new data is refused (ENOSPC) once the
    /// filesystem's available space would fall under it, and the soft threshold counts as
    /// exceeded under twice it.
    pub filesystem_reserve_bytes: u64,
    /// Number of volumes.
    pub volumes: u64,
    /// Sum of the volumes' sizes (thin: may exceed capacity).
    pub provisioned_bytes: u64,
    /// Sum of the thick volumes' sizes.
    pub thick_provisioned_bytes: u64,
    /// Non-zero data the volumes hold, as seen by clients (mapped blocks × 4 KiB).
    pub logical_written_bytes: u64,
    /// Distinct non-zero blocks stored, before compression (unique chunks × 4 KiB).
    pub unique_bytes: u64,
    /// Number of distinct chunks stored.
    pub unique_chunks: u64,
    /// Bytes the live chunks occupy in segment files, after compression, headers included.
    pub physical_bytes: u64,
    /// Size of the metadata store on disk, journal files included.
    pub metadata_bytes: u64,
    /// `physical + metadata`: what counts against capacity.
    pub used_bytes: u64,
    /// Space thick volumes keep reserved: for their blocks that hold no data yet, and
    /// `overwrite_headroom_bytes`.
    pub reserved_bytes: u64,
    /// The part of `reserved_bytes` that lets thick volumes overwrite their written blocks on
    /// a full pool (new data is stored before the commit frees the old): one block's
    /// reservation per block of thick volumes, up to 16 Ki blocks per pool.
    pub overwrite_headroom_bytes: u64,
    /// `capacity - used - reserved`: what thin volumes may still take.
    pub free_bytes: u64,
    /// Bytes of all segment files: headers and records, those not yet written out included
    /// (kept as a running count, not read from the files).
    pub segment_file_bytes: u64,
    /// Dead bytes in segment files, awaiting the cleaner.
    pub garbage_bytes: u64,
    /// `logical_written / physical` (1.0 for an empty pool).
    pub data_reduction_ratio: f64,
    /// RAM of the dedup filter.
    pub dedup_filter_ram_bytes: u64,
    /// Fingerprints the dedup filter is sized for (~1 % false positives when it holds that
    /// many).
    pub dedup_filter_capacity: u64,
    /// Fingerprints the dedup filter holds: of live chunks and of chunks freed since it was
    /// built (a Bloom filter cannot drop them). Past twice its capacity it is rebuilt from the
    /// index.
    pub dedup_filter_fingerprints: u64,
    /// RAM of the filters that say which blocks each map layer holds.
    pub layer_filter_ram_bytes: u64,
    /// The number of the last committed batch: metadata commits so far (empty ones included),
    /// plus the numbers each open skips past batches a crash may have left in the journal (up
    /// to 66).
    pub committed_batches: u64,
}

/// Where one volume's space went, computed by walking its map (exact as of the last commit).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeSpace {
    /// Size of the volume.
    pub size_bytes: u64,
    /// Blocks mapped to data.
    pub mapped_blocks: u64,
    /// Blocks whose chunk no other volume references.
    pub exclusive_blocks: u64,
    /// Blocks whose chunk another volume also references.
    pub shared_blocks: u64,
    /// Distinct chunks referenced.
    pub distinct_chunks: u64,
    /// Physical bytes of the chunks only this volume references.
    pub exclusive_physical_bytes: u64,
    /// Physical bytes of the chunks this volume shares with others.
    pub shared_physical_bytes: u64,
}
