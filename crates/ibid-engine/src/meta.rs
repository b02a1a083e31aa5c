//! The metadata store's tables (behind [`crate::store`]) and the pool record.
//!
//! | table      | key                                  | value                                  |
//! |------------|--------------------------------------|----------------------------------------|
//! | `pool`     | `"pool"`                             | [`PoolRecord`]                         |
//! | `pool`     | `"fps.merged"` ([`FPS_MERGED_KEY`])   | per slice of the dedup index's key space, the commit that last merged it (u64 LE each; see `dedup_index.rs`) |
//! | `pool`     | `"chunk.fps.stale"` ([`FPS_STALE_KEY`]) | per slice of the reference log, fingerprints in `chunk.fps` whose chunk died (u64 LE each; see `chunk_fps.rs`) |
//! | `pool`     | `"layers.building"` ([`BUILDING_KEY`]) | ids of layers in no stack whose entries are being written (a build) or deleted (a dropped or abandoned layer) (u64 LE each, ascending; see `copy/layer_build.rs`) |
//! | `volumes`  | volume name                          | [`crate::format::VolumeRecord`]        |
//! | `map.pages` | (layer u64 BE, block >> 4 u64 BE)   | a page: the entries (chunk id, absent = zero) of up to 16 neighbouring blocks (see `map_table.rs`) |
//! | `map`      | (layer u64 BE, block u64 BE)         | chunk id; format version 10 and older only, moved into `map.pages` at open |
//! | `chunk.pages` | chunk id >> 10                    | a page: the [`crate::format::ChunkRecord`]s of up to 16 neighbouring ids (see `chunk_table.rs`) |
//! | `chunk.fps` | chunk id >> 10                      | a page: the fingerprints of up to 16 neighbouring ids, kept after their chunks die until swept (see `chunk_fps.rs`) |
//! | `fps`      | (fingerprint prefix u64, chunk id) as u128 BE | () — the dedup index's B-tree |
//! | `fps.runs` | commit number                        | a run: ascending `fps` keys, 16 B each, as written (merged out a slice at a time, never rewritten) |
//! | `fps.gone` | commit number                        | keys of the chunks that died in that commit, packed like a run |
//! | `fps.dead` | `fps` key                            | () — keys in runs of dead chunks       |
//! | `segments` | segment id                           | [`crate::format::SegmentUsage`]        |
//! | `orphans`  | chunk id                             | () — chunks at zero refs kept alive    |
//! | `snapshots`| `VOLUME@SNAPSHOT`                    | [`crate::format::VolumeRecord`]        |
//! | `layers`   | layer id                             | stacks including it (refcount)         |
//! | `zeroing`  | volume id                            | zeroed ranges still to settle: (start, end) block pairs, u64 BE each (see `commit.rs`) |
//!
//! A map value of [`crate::format::ZERO_TOMBSTONE`] (0) in an upper layer hides lower layers.
//!
//! The dedup index holds one key per live chunk: the first 8 bytes of its fingerprint (as a
//! big-endian u64) in the high half, its id in the low half ([`fps_key`]). A key is in the
//! `fps` B-tree or in one of a few recent sorted runs (`fps.runs`, see `dedup_index.rs`). A
//! lookup scans the keys of one prefix ([`fps_range`]) and confirms each candidate against the
//! full fingerprint in its chunk record; two chunks may share a prefix. Sixteen-byte integer keys keep the
//! index's pages dense: the index was most of a commit's store work with 32-byte keys (see
//! `ibid-bench store-shapes`).
//!
//! Keys and values cross the store seam in [`crate::store::Codec`]'s encoding (integers
//! big-endian). Every table changes only inside the commit transaction, which is durable (fsync) when it
//! returns. A chunk id is `(sequence << SHARD_BITS) | shard`, so its dedup shard is its low bits.

use crate::error::{Error, Result};
use crate::store::{Def, Table};

/// The pool record.
pub const POOL: Def<str, [u8]> = Def::new(Table::Pool);
/// Key in [`POOL`] of the dedup index's merge marks (see `dedup_index.rs`; absent while no
/// run or gone row is kept, and in pools of format version 8 and older, whose rows hold only
/// keys not merged yet).
pub const FPS_MERGED_KEY: &str = "fps.merged";
/// Key in [`POOL`] of the stale fingerprint counts per slice of the reference log (see
/// `chunk_fps.rs`; absent while all are zero, and in pools of format version 14 and older).
pub const FPS_STALE_KEY: &str = "chunk.fps.stale";
/// Key in [`POOL`] of the layers in no stack that still have map entries: layers being built
/// (their entries written in steps before any stack shows them) and layers whose last stack
/// reference went (their entries deleted in steps by the background); see
/// `copy/layer_build.rs`. Absent when there is none. (The key's name is from format 10, when
/// only builds were listed; a format 10 build treats a dropped layer as an abandoned build,
/// which it deletes the same way.)
pub const BUILDING_KEY: &str = "layers.building";
/// Volumes by name.
pub const VOLUMES: Def<str, [u8]> = Def::new(Table::Volumes);
/// Volume maps of pools of format version 10 and older, one row per block: (layer, block) →
/// chunk id. Emptied into [`MAP_PAGES`] when such a pool is opened
/// ([`crate::map_table::upgrade`]).
pub const MAP: Def<[u8; 16], u64> = Def::new(Table::Map);
/// Volume maps: (layer, block >> 4) → a page of up to 16 entries (see [`crate::map_table`],
/// the only module that reads or writes it).
pub const MAP_PAGES: Def<[u8; 16], [u8]> = Def::new(Table::MapPages);
/// Changes to [`MAP_PAGES`] not yet written back to it: slice and row number → packed changes
/// (see [`crate::store::deferred`]; the store reads and writes it, nothing else does).
pub const MAP_LOG: Def<u64, [u8]> = Def::new(Table::MapLog);
/// Chunks: page key (`id >> chunk_table::PAGE_SHIFT`) → page of records (see
/// [`crate::chunk_table`], the only module that reads or writes it).
pub const CHUNK_PAGES: Def<u64, [u8]> = Def::new(Table::ChunkPages);
/// Chunks' fingerprints: page key (as [`CHUNK_PAGES`]) → page of fingerprints (see
/// [`crate::chunk_fps`], the only module that reads or writes it).
pub const CHUNK_FPS: Def<u64, [u8]> = Def::new(Table::ChunkFps);
/// Chunks of pools of format version 5 and older, one row per chunk: id → record. Emptied into
/// [`CHUNK_PAGES`] when such a pool is opened ([`crate::chunk_table::upgrade`]).
pub const CHUNKS_BY_ID: Def<u64, [u8]> = Def::new(Table::Chunks);
/// The dedup index's B-tree: (fingerprint prefix, chunk id) → () (see the module doc).
pub const FPS: Def<u128, ()> = Def::new(Table::Fps);
/// The dedup index's runs: commit number → that commit's new keys, ascending, packed as
/// 16-byte big-endian integers. A row is written once and deleted once every slice of it has
/// been merged ([`FPS_MERGED_KEY`]).
pub const FPS_RUNS: Def<u64, [u8]> = Def::new(Table::FpsRuns);
/// Keys in runs whose chunks died, as format version 6 and older keep them (key → ()); moved
/// into one [`FPS_GONE`] row when such a pool is opened.
pub const FPS_DEAD: Def<u128, ()> = Def::new(Table::FpsDead);
/// The dedup index's gone rows: commit number → the keys (in a run or in [`FPS`]) of the
/// chunks that died in that commit, ascending, packed as 16-byte big-endian integers; applied
/// and deleted by the next merge (see `dedup_index.rs`).
pub const FPS_GONE: Def<u64, [u8]> = Def::new(Table::FpsGone);
/// Reference-count changes to committed chunks not yet folded into their records: slice and
/// row number → packed (chunk id, delta) entries (see `ref_log.rs`, the only module that
/// reads or writes it).
pub const CHUNK_DELTAS: Def<u64, [u8]> = Def::new(Table::ChunkDeltas);
/// Segment usage: id → (total, live) bytes.
pub const SEGMENTS: Def<u64, [u8]> = Def::new(Table::Segments);
/// Snapshots by `VOLUME@SNAPSHOT`.
pub const SNAPSHOTS: Def<str, [u8]> = Def::new(Table::Snapshots);
/// Map layers: id → number of stacks (volumes and snapshots) that include it.
pub const LAYERS: Def<u64, u64> = Def::new(Table::Layers);
/// Chunks whose refcount reached zero while a newer reference was still uncommitted.
pub const ORPHANS: Def<u64, ()> = Def::new(Table::Orphans);
/// Zeroed ranges a commit left to settle: volume id → (start, end) block pairs.
pub const ZEROING: Def<u64, [u8]> = Def::new(Table::Zeroing);

/// Encodes zeroed ranges for [`ZEROING`].
pub fn encode_ranges(ranges: &[(u64, u64)]) -> Vec<u8> {
    ranges
        .iter()
        .flat_map(|&(s, e)| s.to_be_bytes().into_iter().chain(e.to_be_bytes()))
        .collect()
}

/// Decodes a [`ZEROING`] value.
pub fn decode_ranges(b: &[u8]) -> Result<Vec<(u64, u64)>> {
    if !b.len().is_multiple_of(16) {
        return Err(Error::Corrupt(format!(
            "zeroing ranges of {} bytes",
            b.len()
        )));
    }
    let word = |c: &[u8]| u64::from_be_bytes(c.try_into().expect("8 bytes"));
    let ranges: Vec<(u64, u64)> = b
        .chunks_exact(16)
        .map(|c| (word(&c[..8]), word(&c[8..])))
        .collect();
    if ranges.iter().any(|&(s, e)| s >= e) {
        return Err(Error::Corrupt("an empty zeroing range".into()));
    }
    Ok(ranges)
}

pub use crate::dedup_key::{fp_prefix, fps_key, fps_key_chunk, fps_key_prefix, fps_range};

/// Key of the pool record in [`POOL`].
pub const POOL_KEY: &str = "pool";

/// The pool's persistent counters and settings.
///
/// Layout: 12 little-endian u64 in field order, 96 bytes. Version log: 1 — initial format;
/// 2 — the redb backend keeps the map and the dedup index in byte-keyed tables (`map.bytes`,
/// `fps.bytes`). A version 1 pool has its tables moved over and its record rewritten when it
/// is opened; a binary that knows only version 1 then refuses the pool instead of reading
/// tables it cannot see. 3 — the dedup index is keyed by (fingerprint prefix, chunk id), one
/// 16-byte integer key per chunk (redb table `fps.prefix`; fjall keeps the `fps` keyspace with
/// the new keys); older pools have their index rewritten when opened. 4 — the dedup index
/// also keeps recent keys in sorted runs (`fps.runs`, `fps.dead`); a version 3 pool has no
/// runs and needs only the empty tables, but a build that knows only version 3 would not see
/// the keys in runs. 5 — zeroed ranges a commit left to settle (`zeroing`); a version 4
/// pool has none, but a build that knows only version 4 would show the data they hide.
/// 6 — chunk records packed in pages (`chunk.pages`); a version 5 pool has its `chunks` rows
/// moved into pages when opened. 7 — the dedup index's gone rows (`fps.gone`). 8 — the
/// reference log (`chunk.deltas`). 9 — dedup runs and gone rows are merged out a slice at a
/// time without being rewritten, the slices merged marked in [`FPS_MERGED_KEY`]; a version 8
/// pool has no marks (its rows hold only unmerged keys), but a build that knows only version
/// 8 would take merged keys for unmerged ones. 10 — map entries of layers in no stack yet,
/// listed in [`BUILDING_KEY`]; a version 9 pool has none, but a build that knows only version
/// 9 would take them for corruption and never delete them. 11 — map entries packed in pages
/// (`map.pages`); a version 10 pool has its `map` rows moved into pages when opened. 12 — the
/// map's changes logged (`map.log`) and written back a slice at a time. 13 — the reference
/// log cut in 64 slices (key `slice << 56 | row`), not 16 (`slice << 60 | row`); a version 12
/// pool's log is summed and logged again when it is opened (`ref_log::upgrade`). 14 — the
/// map log records a change to an existing page as a delta (`map_page.rs`); a version 13
/// pool's log rows hold whole pages only, which this build reads as they are, but a build
/// that knows only version 13 would take a delta for corruption. 15 — chunk records of 24
/// bytes in entries of 26 (`chunk.pages`), their fingerprints apart in `chunk.fps`; a version
/// 14 pool's pages are split when it is opened (`chunk_table::upgrade`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolRecord {
    /// Format version of the pool.
    pub version: u64,
    /// Capacity in bytes: physical data plus metadata may not exceed it.
    pub capacity_bytes: u64,
    /// Soft threshold, percent of capacity.
    pub soft_threshold_pct: u64,
    /// Next chunk sequence number.
    pub next_chunk_seq: u64,
    /// Next segment id.
    pub next_segment_id: u64,
    /// Next volume id.
    pub next_volume_id: u64,
    /// Next map layer id.
    pub next_layer_id: u64,
    /// Chunks alive.
    pub live_chunks: u64,
    /// Physical bytes of live chunks (record headers included).
    pub live_bytes: u64,
    /// Number of the last batch committed (batches that were empty are never written, so
    /// this can skip numbers; journal stamps are batch numbers, see `journal.rs`).
    pub commits: u64,
    /// Creation time, seconds since the Unix epoch.
    pub created_unix_s: u64,
    /// Reserved.
    pub reserved: u64,
}

/// Current pool format version.
pub const POOL_FORMAT_VERSION: u64 = 15;
/// First format whose chunk records leave their fingerprints to `chunk.fps`.
pub const FPS_APART_VERSION: u64 = 15;
/// First format whose reference log is cut in 64 slices, not 16.
pub const REF_LOG_64_SLICES_VERSION: u64 = 13;
/// Oldest pool format version this build opens (and upgrades).
pub const POOL_FORMAT_VERSION_OLDEST: u64 = 1;
const POOL_RECORD_FIELDS: usize = 12;

impl PoolRecord {
    fn fields(&self) -> [u64; POOL_RECORD_FIELDS] {
        [
            self.version,
            self.capacity_bytes,
            self.soft_threshold_pct,
            self.next_chunk_seq,
            self.next_segment_id,
            self.next_volume_id,
            self.next_layer_id,
            self.live_chunks,
            self.live_bytes,
            self.commits,
            self.created_unix_s,
            self.reserved,
        ]
    }

    /// Encodes the record.
    pub fn encode(&self) -> Vec<u8> {
        self.fields().iter().flat_map(|f| f.to_le_bytes()).collect()
    }

    /// Decodes the record.
    pub fn decode(v: &[u8]) -> Result<Self> {
        if v.len() != POOL_RECORD_FIELDS * 8 {
            return Err(Error::Corrupt(format!("pool record of {} bytes", v.len())));
        }
        let f = |i: usize| u64::from_le_bytes(v[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let r = PoolRecord {
            version: f(0),
            capacity_bytes: f(1),
            soft_threshold_pct: f(2),
            next_chunk_seq: f(3),
            next_segment_id: f(4),
            next_volume_id: f(5),
            next_layer_id: f(6),
            live_chunks: f(7),
            live_bytes: f(8),
            commits: f(9),
            created_unix_s: f(10),
            reserved: f(11),
        };
        if !(POOL_FORMAT_VERSION_OLDEST..=POOL_FORMAT_VERSION).contains(&r.version) {
            return Err(Error::Corrupt(format!(
                "unknown pool format version {} (this build opens {POOL_FORMAT_VERSION_OLDEST} to {POOL_FORMAT_VERSION})",
                r.version
            )));
        }
        Ok(r)
    }
}
