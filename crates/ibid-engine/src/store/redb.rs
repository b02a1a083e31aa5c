//! The redb backend: one file, `meta.redb`, with one typed redb table per engine table.
//!
//! The typed tables are those of the pools written before the [`super::MetaStore`] seam existed,
//! so such pools open unchanged: keys and values are converted between the seam's bytes
//! ([`super::Codec`]) and redb's types at this boundary.
//!
//! Durability: every batch is one redb write transaction with the default durability
//! (`Immediate`): its commit fsyncs before returning (redb's 1PC+C protocol), so a batch is
//! atomic and survives a crash once [`super::MetaStore::write`] returns. Each batch also saves
//! redb's allocator state and commits in two phases (redb's *quick repair*), so that opening the
//! file after a crash reads that state instead of walking every page of the file to rebuild it
//! (a full repair: 1.3–2.0 s for a 1.1 GB file, and growing with the store; with quick
//! repair 1–2 ms). What it costs a batch did not show beyond the noise of
//! docs/BENCHMARKS.md, "Recovery after a crash, step by step".
//!
//! Snapshots: the store keeps one read transaction on the last committed state and hands it
//! out shared; [`super::MetaStore::write`] replaces it before returning, so a snapshot taken
//! after a write returns sees that write. Opening a redb read transaction takes a lock its
//! commit holds for the whole durable write, so a lookup per new block (a dedup filter hit)
//! would otherwise wait for the commit in progress.

use super::{Batch, KvIter, MetaStore, Snapshot, Table, TableOps, TABLES};
use crate::disk::{Disk, DiskFile, OpenMode};
use crate::error::{Error, Result};
use ::redb::{
    Database, Key, ReadOnlyTable, ReadTransaction, ReadableDatabase, ReadableTable,
    TableDefinition, TableHandle, Value,
};
use parking_lot::RwLock;
use std::any::Any;
use std::ops::Bound;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The store's file in the pool directory.
pub const FILE: &str = "meta.redb";

const POOL: TableDefinition<&str, &[u8]> = TableDefinition::new("pool");
const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");
/// The map and the dedup index have byte-string keys: redb compares a fixed-size array key
/// element by element through its generic `Key` impl, which cost a quarter of a commit's CPU
/// with 64 Ki random fingerprints per commit; a byte string compares with one `memcmp`.
/// The byte order is the same, so scans see the same order.
const MAP: TableDefinition<&[u8], u64> = TableDefinition::new("map.bytes");
/// Chunk records one per row, as pools of format version 5 and older keep them.
const CHUNKS: TableDefinition<u64, &[u8]> = TableDefinition::new("chunks");
const CHUNK_PAGES: TableDefinition<u64, &[u8]> = TableDefinition::new("chunk.pages");
/// The dedup index: 16-byte integer keys (fingerprint prefix, chunk id), compared as numbers.
const FPS: TableDefinition<u128, ()> = TableDefinition::new("fps.prefix");
/// The map and dedup index of pools created before the byte-string tables (format version 1);
/// [`RedbStore::open`] moves their entries over, once.
const MAP_ARRAY_KEYS: TableDefinition<[u8; 16], u64> = TableDefinition::new("map");
const FPS_ARRAY_KEYS: TableDefinition<[u8; 32], u64> = TableDefinition::new("fps");
/// The dedup index of format version 2 (fingerprint → chunk id); moved over at open.
const FPS_BYTE_KEYS: TableDefinition<&[u8], u64> = TableDefinition::new("fps.bytes");
const SEGMENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("segments");
const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
const LAYERS: TableDefinition<u64, u64> = TableDefinition::new("layers");
const ORPHANS: TableDefinition<u64, ()> = TableDefinition::new("orphans");
const FPS_RUNS: TableDefinition<u64, &[u8]> = TableDefinition::new("fps.runs");
const FPS_DEAD: TableDefinition<u128, ()> = TableDefinition::new("fps.dead");
const FPS_GONE: TableDefinition<u64, &[u8]> = TableDefinition::new("fps.gone");
const ZEROING: TableDefinition<u64, &[u8]> = TableDefinition::new("zeroing");
const CHUNK_DELTAS: TableDefinition<u64, &[u8]> = TableDefinition::new("chunk.deltas");
/// The map in pages (format version 11; see `map_table.rs`): byte-string keys like `map.bytes`.
const MAP_PAGES: TableDefinition<&[u8], &[u8]> = TableDefinition::new("map.pages");
/// Changes to `map.pages` not yet written back (format version 12; see `deferred.rs`).
const MAP_LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("map.log");
/// Chunks' fingerprints in pages (format version 15; see `chunk_fps.rs`).
const CHUNK_FPS: TableDefinition<u64, &[u8]> = TableDefinition::new("chunk.fps");

/// Runs the generic function `$f` on the redb table of `$table`, with the other arguments.
macro_rules! dispatch {
    ($table:expr, $f:ident, $($arg:expr),*) => {
        match $table {
            Table::Pool => $f(POOL, $($arg),*),
            Table::Volumes => $f(VOLUMES, $($arg),*),
            Table::Map => $f(MAP, $($arg),*),
            Table::Chunks => $f(CHUNKS, $($arg),*),
            Table::Fps => $f(FPS, $($arg),*),
            Table::Segments => $f(SEGMENTS, $($arg),*),
            Table::Snapshots => $f(SNAPSHOTS, $($arg),*),
            Table::Layers => $f(LAYERS, $($arg),*),
            Table::Orphans => $f(ORPHANS, $($arg),*),
            Table::FpsRuns => $f(FPS_RUNS, $($arg),*),
            Table::FpsDead => $f(FPS_DEAD, $($arg),*),
            Table::Zeroing => $f(ZEROING, $($arg),*),
            Table::ChunkPages => $f(CHUNK_PAGES, $($arg),*),
            Table::FpsGone => $f(FPS_GONE, $($arg),*),
            Table::ChunkDeltas => $f(CHUNK_DELTAS, $($arg),*),
            Table::MapPages => $f(MAP_PAGES, $($arg),*),
            Table::MapLog => $f(MAP_LOG, $($arg),*),
            Table::ChunkFps => $f(CHUNK_FPS, $($arg),*),
        }
    };
}

/// Where a store file's bytes go: each table's share and the file's pages
/// ([`file_space`]).
#[derive(Debug, Clone)]
pub struct FileSpace {
    /// One entry per engine table the file holds.
    pub tables: Vec<TableSpace>,
    /// Pages redb has allocated (live or waiting to be freed), of [`FileSpace::page_bytes`].
    pub allocated_pages: u64,
    /// redb's page size.
    pub page_bytes: u64,
    /// The file's length (allocated pages, free pages and redb's headers).
    pub file_bytes: u64,
}

/// One table's space in a store file.
#[derive(Debug, Clone)]
pub struct TableSpace {
    /// The redb table's name.
    pub name: String,
    /// Rows.
    pub rows: u64,
    /// Leaf pages of its B-tree (a value larger than a page takes a leaf of several).
    pub leaf_pages: u64,
    /// Branch pages of its B-tree.
    pub branch_pages: u64,
    /// Bytes of keys and values stored in the leaves.
    pub stored_bytes: u64,
    /// Bytes of its pages that hold neither data nor redb's metadata.
    pub fragmented_bytes: u64,
}

/// Measures where the bytes of the store file at `path` go, per table (a pool's
/// `meta.redb`, or a copy of one: redb locks a file in use). Walks every table; for
/// measurements (`ibid-bench store-space`), not for a serving pool. A copy taken while a
/// server had the file open is repaired by redb as it opens, which may give trailing free
/// pages back: [`FileSpace::file_bytes`] is then the repaired file's length.
pub fn file_space(path: &Path) -> Result<FileSpace> {
    let db = Database::open(path)?;
    let txn = db.begin_read()?;
    let mut tables = Vec::new();
    for t in Table::ALL {
        if let Some(s) = dispatch!(t, table_space, &txn)? {
            tables.push(s);
        }
    }
    drop(txn);
    let w = db.begin_write()?;
    let stats = w.stats()?;
    w.abort()?;
    Ok(FileSpace {
        tables,
        allocated_pages: stats.allocated_pages(),
        page_bytes: stats.page_size() as u64,
        file_bytes: std::fs::metadata(path)
            .map_err(|e| Error::io("stat the store file", e))?
            .len(),
    })
}

fn table_space<K: Key + Conv, V: Conv>(
    def: TableDefinition<K, V>,
    txn: &ReadTransaction,
) -> Result<Option<TableSpace>> {
    use ::redb::ReadableTableMetadata;
    let table = match txn.open_table(def) {
        Ok(t) => t,
        Err(::redb::TableError::TableDoesNotExist(_)) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let s = table.stats()?;
    Ok(Some(TableSpace {
        name: def_name(def),
        rows: table.len()?,
        leaf_pages: s.leaf_pages(),
        branch_pages: s.branch_pages(),
        stored_bytes: s.stored_bytes(),
        fragmented_bytes: s.fragmented_bytes(),
    }))
}

/// Conversion between a redb type and the seam's byte encoding ([`super::Codec`]).
trait Conv: Value + Send + Sync + 'static {
    fn decode_seam(b: &[u8]) -> Result<Self::SelfType<'_>>;
    fn encode_seam(v: &Self::SelfType<'_>) -> Vec<u8>;
    /// Calls `f` with the seam encoding of `v`, without allocating where the type allows.
    fn with_seam_bytes<R>(v: &Self::SelfType<'_>, f: impl FnOnce(&[u8]) -> R) -> R {
        f(&Self::encode_seam(v))
    }
}

fn bad(what: &str, b: &[u8]) -> Error {
    Error::Corrupt(format!("metadata {what} of {} bytes", b.len()))
}

impl Conv for u64 {
    fn decode_seam(b: &[u8]) -> Result<u64> {
        Ok(u64::from_be_bytes(b.try_into().map_err(|_| bad("u64", b))?))
    }
    fn encode_seam(v: &u64) -> Vec<u8> {
        v.to_be_bytes().to_vec()
    }
    fn with_seam_bytes<R>(v: &u64, f: impl FnOnce(&[u8]) -> R) -> R {
        f(&v.to_be_bytes())
    }
}

impl<const N: usize> Conv for [u8; N] {
    fn decode_seam(b: &[u8]) -> Result<[u8; N]> {
        b.try_into().map_err(|_| bad("fixed-size key", b))
    }
    fn encode_seam(v: &[u8; N]) -> Vec<u8> {
        v.to_vec()
    }
    fn with_seam_bytes<R>(v: &[u8; N], f: impl FnOnce(&[u8]) -> R) -> R {
        f(v)
    }
}

impl Conv for u128 {
    fn decode_seam(b: &[u8]) -> Result<u128> {
        Ok(u128::from_be_bytes(
            b.try_into().map_err(|_| bad("u128", b))?,
        ))
    }
    fn encode_seam(v: &u128) -> Vec<u8> {
        v.to_be_bytes().to_vec()
    }
    fn with_seam_bytes<R>(v: &u128, f: impl FnOnce(&[u8]) -> R) -> R {
        f(&v.to_be_bytes())
    }
}

impl Conv for &'static str {
    fn decode_seam(b: &[u8]) -> Result<&str> {
        std::str::from_utf8(b).map_err(|_| bad("non-UTF-8 name", b))
    }
    fn encode_seam(v: &&str) -> Vec<u8> {
        v.as_bytes().to_vec()
    }
}

impl Conv for &'static [u8] {
    fn decode_seam(b: &[u8]) -> Result<&[u8]> {
        Ok(b)
    }
    fn encode_seam(v: &&[u8]) -> Vec<u8> {
        v.to_vec()
    }
    fn with_seam_bytes<R>(v: &&[u8], f: impl FnOnce(&[u8]) -> R) -> R {
        f(v)
    }
}

impl Conv for () {
    fn decode_seam(b: &[u8]) -> Result<()> {
        if b.is_empty() {
            Ok(())
        } else {
            Err(bad("unit value", b))
        }
    }
    fn encode_seam(_: &()) -> Vec<u8> {
        Vec::new()
    }
}

/// Metadata in a redb database.
pub struct RedbStore {
    /// A read transaction on the last committed state, replaced by every write. Declared
    /// first, so dropped before `db`.
    current: RwLock<Arc<RedbSnapshot>>,
    db: Database,
    /// The database file (for its size).
    file: Arc<dyn DiskFile>,
    /// Whether this open had to run redb's full repair.
    repaired: bool,
    /// Bytes redb has written to the file since it was opened.
    written: Arc<AtomicU64>,
}

/// redb's storage on a file of the [`Disk`] seam: every byte the store reads or writes goes
/// through it.
#[derive(Debug)]
struct DiskBackend {
    file: Arc<dyn DiskFile>,
    /// Bytes written so far.
    written: Arc<AtomicU64>,
}

impl ::redb::StorageBackend for DiskBackend {
    fn len(&self) -> std::io::Result<u64> {
        self.file.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.file.read_exact_at(out, offset)
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.file.set_len(len)
    }

    fn sync_data(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.written.fetch_add(data.len() as u64, Ordering::Relaxed);
        self.file.write_all_at(data, offset)
    }
}

/// A database file opened by [`database`].
struct Opened {
    db: Database,
    file: Arc<dyn DiskFile>,
    /// Bytes redb writes to it, counted.
    written: Arc<AtomicU64>,
    /// Whether redb had to repair it by walking the whole file (see the module doc).
    repaired: bool,
}

/// Opens `dir`'s database file on `disk` as a redb database (`mode`: create it or not).
fn database(disk: &dyn Disk, dir: &Path, mode: OpenMode) -> Result<Opened> {
    let path = dir.join(FILE);
    let file = (disk.open(&path, mode)).map_err(|e| Error::io("open metadata store", e))?;
    let written = Arc::new(AtomicU64::new(0));
    let repairing = Arc::new(AtomicBool::new(false));
    let flag = repairing.clone();
    let started = std::time::Instant::now();
    let db = ::redb::Builder::new()
        .set_repair_callback(move |_| {
            if !flag.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "{FILE}: not closed cleanly, and its last commit saved no allocator state \
                     (an older build wrote it): redb repairs it by reading the whole file"
                );
            }
        })
        .create_with_backend(DiskBackend {
            file: file.clone(),
            written: written.clone(),
        })?;
    let repaired = repairing.load(Ordering::Relaxed);
    if repaired {
        tracing::info!(
            "{FILE}: repaired in {:.3} s",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(Opened {
        db,
        file,
        written,
        repaired,
    })
}

impl RedbStore {
    /// Creates the database in `dir` on `disk` with every table, empty.
    pub fn create(disk: &dyn Disk, dir: &Path) -> Result<RedbStore> {
        let opened = database(disk, dir, OpenMode::CreateNew)?;
        let txn = opened.db.begin_write()?;
        for t in Table::ALL {
            dispatch!(t, create_table, &txn)?;
        }
        txn.commit()?;
        RedbStore::new(opened)
    }

    /// Opens the database in `dir` on `disk` (redb repairs it first if it was not closed
    /// cleanly), and moves the tables of an older layout to the current one.
    pub fn open(disk: &dyn Disk, dir: &Path) -> Result<RedbStore> {
        let opened = database(disk, dir, OpenMode::Existing)?;
        migrate_array_keys(&opened.db, MAP_ARRAY_KEYS, MAP)?;
        migrate_index(&opened.db, FPS_ARRAY_KEYS)?;
        migrate_index(&opened.db, FPS_BYTE_KEYS)?;
        create_missing_tables(&opened.db)?;
        RedbStore::new(opened)
    }

    fn new(opened: Opened) -> Result<RedbStore> {
        let current = RwLock::new(Arc::new(RedbSnapshot::begin(&opened.db)?));
        Ok(RedbStore {
            current,
            db: opened.db,
            file: opened.file,
            repaired: opened.repaired,
            written: opened.written,
        })
    }

    /// Whether opening the file took redb's full repair (a walk of every page).
    pub fn repaired(&self) -> bool {
        self.repaired
    }
}

/// Moves every entry of the array-keyed table `old`, if the database has one, to the
/// byte-keyed table `new` (format version 1 to 2).
fn migrate_array_keys<const N: usize>(
    db: &Database,
    old: TableDefinition<[u8; N], u64>,
    new: TableDefinition<&[u8], u64>,
) -> Result<()> {
    replace_table(db, old, "to byte-string keys", |txn| {
        let mut to = txn.open_table(new)?;
        let mut moved = 0u64;
        for item in txn.open_table(old)?.iter()? {
            let (k, v) = item?;
            to.insert(k.value().as_slice(), v.value())?;
            moved += 1;
        }
        Ok(moved)
    })
}

/// Rewrites every entry (fingerprint → chunk id) of the older dedup index table `old`, if the
/// database has one, as a key of the current index (format versions 1 and 2 to 3).
fn migrate_index<K: Key + 'static>(db: &Database, old: TableDefinition<K, u64>) -> Result<()>
where
    for<'a> K::SelfType<'a>: AsRef<[u8]>,
{
    replace_table(db, old, "to prefix keys", |txn| {
        let mut to = txn.open_table(FPS)?;
        let mut moved = 0u64;
        for item in txn.open_table(old)?.iter()? {
            let (k, v) = item?;
            let key = k.value();
            let fp: &[u8; 32] = key
                .as_ref()
                .try_into()
                .map_err(|_| bad("dedup index key", key.as_ref()))?;
            to.insert(crate::dedup_key::fps_key(fp, v.value()), ())?;
            moved += 1;
        }
        Ok(moved)
    })
}

/// If the database has table `old`, runs `copy` (which moves its entries elsewhere and returns
/// how many) and deletes `old`, in one transaction, so a crash leaves either layout whole.
fn replace_table<K: Key + 'static>(
    db: &Database,
    old: TableDefinition<K, u64>,
    how: &str,
    copy: impl FnOnce(&::redb::WriteTransaction) -> Result<u64>,
) -> Result<()> {
    let txn = db.begin_write()?;
    if !txn.list_tables()?.any(|t| t.name() == old.name()) {
        return Ok(());
    }
    let moved = copy(&txn)?;
    txn.delete_table(old)?;
    txn.commit()?;
    tracing::info!(
        "metadata: moved {moved} entries of table {} {how}",
        old.name()
    );
    Ok(())
}

/// Creates the tables an older format did not have (empty), in one transaction if any.
fn create_missing_tables(db: &Database) -> Result<()> {
    let txn = db.begin_write()?;
    let names: Vec<String> = txn.list_tables()?.map(|t| t.name().to_string()).collect();
    let missing: Vec<Table> = Table::ALL
        .into_iter()
        .filter(|t| !names.contains(&dispatch!(*t, def_name,)))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    for t in &missing {
        dispatch!(*t, create_table, &txn)?;
    }
    txn.commit()?;
    tracing::info!("metadata: created tables {missing:?}");
    Ok(())
}

fn def_name<K: Key + Conv, V: Conv>(def: TableDefinition<K, V>) -> String {
    def.name().to_string()
}

fn create_table<K: Key + Conv, V: Conv>(
    def: TableDefinition<K, V>,
    txn: &::redb::WriteTransaction,
) -> Result<()> {
    txn.open_table(def)?;
    Ok(())
}

impl MetaStore for RedbStore {
    fn snapshot(&self) -> Result<Box<dyn Snapshot + '_>> {
        Ok(Box::new(self.current.read().clone()))
    }

    fn write(&self, batch: &Batch, ready: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let mut txn = self.db.begin_write()?;
        // Recovery bounded by the journal, not by the store's size (module doc).
        txn.set_quick_repair(true);
        for t in Table::ALL {
            let ops = &batch.tables[t.index()];
            if !ops.is_empty() {
                dispatch!(t, apply_ops, &txn, ops)?;
            }
        }
        // Dropped uncommitted on an error: redb aborts it.
        ready()?;
        txn.commit()?;
        *self.current.write() = Arc::new(RedbSnapshot::begin(&self.db)?);
        Ok(())
    }

    fn disk_bytes(&self) -> u64 {
        // What the file takes, not its length: redb doubles a file when it needs room (up to
        // its region size), and the new half holds no blocks until pages are written there.
        // Counting the length charged a pool's room for space nobody used (goal 6 of issue 31:
        // 0.55 GiB of a full 10 GiB pool's ~1.4 GiB of garbage room).
        self.file.allocated().unwrap_or(0)
    }

    fn bytes_written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }
}

/// A batch's changes in key order: `(key, Some(value))` sets, `(key, None)` deletes.
type Changes<'a> = [(&'a [u8], Option<&'a [u8]>)];

fn apply_ops<K: Key + Conv, V: Conv>(
    def: TableDefinition<K, V>,
    txn: &::redb::WriteTransaction,
    ops: &TableOps,
) -> Result<()> {
    let mut table = txn.open_table(def)?;
    let sorted = ops.sorted();
    let mut rest = &sorted[..];
    for (lo, hi) in ops.packs() {
        let before = rest.partition_point(|(k, _)| *k < lo);
        apply_each(&mut table, &rest[..before])?;
        rest = &rest[before..];
        let within = rest.partition_point(|(k, _)| *k <= hi);
        apply_packed(&mut table, lo, hi, &rest[..within])?;
        rest = &rest[within..];
    }
    apply_each(&mut table, rest)
}

/// Applies `changes` one by one.
fn apply_each<K: Key + Conv, V: Conv>(
    table: &mut ::redb::Table<K, V>,
    changes: &Changes,
) -> Result<()> {
    for &(k, v) in changes {
        let key = K::decode_seam(k)?;
        match v {
            Some(v) => {
                table.insert(key, V::decode_seam(v)?)?;
            }
            None => {
                table.remove(key)?;
            }
        }
    }
    Ok(())
}

/// Applies `changes`, all within `lo..=hi`, rewriting every row of the range packed when they
/// touch about every leaf of it ([`crate::store::WriteTxn::pack`]): the range's rows are
/// removed through a cursor and the merged stream inserted back in key order, which redb lays
/// out in full leaves (a leaf run rebuilt at once) instead of the leaves the rows were in. The
/// rows go [`PACK_ROWS`] at a time, so a large range is never held in memory whole.
fn apply_packed<K: Key + Conv, V: Conv>(
    table: &mut ::redb::Table<K, V>,
    lo: &[u8],
    hi: &[u8],
    changes: &Changes,
) -> Result<()> {
    if changes.is_empty() {
        return Ok(());
    }
    // Fewer changes than the leaves the range would fill leave some of them untouched, which
    // a rewrite of every row would copy for nothing; and each row rewritten costs about what a
    // change applied alone does (redb's cursor deletes one entry at a time), so a range whose
    // rows mostly stay as they are (a slice of the dedup index merged: a few new keys per
    // leaf) is cheaper applied change by change. The count stops as soon as either is known
    // (a range the cleaner's moves touch at a page or two is not read whole).
    let sparse = |rows: usize, bytes: usize| {
        changes.len() < bytes / PACKED_LEAF_BYTES || changes.len() * 2 < rows
    };
    let (lo_key, hi_key) = (K::decode_seam(lo)?, K::decode_seam(hi)?);
    let (mut rows, mut bytes) = (0usize, 0usize);
    for item in
        table.range::<K::SelfType<'_>>((Bound::Included(lo_key), Bound::Included(hi_key)))?
    {
        let (k, v) = item?;
        rows += 1;
        bytes += K::as_bytes(&k.value()).as_ref().len() + V::as_bytes(&v.value()).as_ref().len();
        if sparse(rows, bytes) {
            break;
        }
    }
    if sparse(rows, bytes) {
        return apply_each(table, changes);
    }
    let mut cursor = table.lower_bound_mut(Bound::Included(K::decode_seam(lo)?))?;
    // The rows taken out, one batch at a time: keys and values end to end, and where each ends.
    let mut taken: Vec<u8> = Vec::new();
    let mut ends: Vec<(usize, usize)> = Vec::new();
    let mut next = 0;
    let mut left = rows;
    while left > 0 || next < changes.len() {
        let n = left.min(PACK_ROWS);
        left -= n;
        taken.clear();
        ends.clear();
        for _ in 0..n {
            let Some((k, v)) = cursor.remove_next()? else {
                break;
            };
            K::with_seam_bytes(&k.value(), |k| taken.extend_from_slice(k));
            let key_end = taken.len();
            V::with_seam_bytes(&v.value(), |v| taken.extend_from_slice(v));
            ends.push((key_end, taken.len()));
        }
        if ends.len() < n {
            left = 0;
        }
        // This batch's rows merged with the changes up to its last row (all that are left,
        // after the last batch).
        let mut at = 0;
        let mut old = ends.iter().map(|&(key_end, end)| {
            let start = std::mem::replace(&mut at, end);
            (&taken[start..key_end], &taken[key_end..end])
        });
        let upto = ends.last().filter(|_| left > 0).map(|&(key_end, _)| {
            let start = ends.len().checked_sub(2).map_or(0, |i| ends[i].1);
            &taken[start..key_end]
        });
        if upto.is_some_and(|k| k > hi) {
            return Err(Error::Corrupt(format!(
                "metadata: a packed rewrite of {rows} rows went past its range"
            )));
        }
        let mut row = old.next();
        loop {
            let change = changes
                .get(next)
                .filter(|(k, _)| upto.is_none_or(|upto| *k <= upto));
            match (row, change) {
                (None, None) => break,
                (Some((k, v)), None) => {
                    cursor.insert_before(K::decode_seam(k)?, V::decode_seam(v)?)?;
                    row = old.next();
                }
                (Some((k, v)), Some((ck, _))) if k < *ck => {
                    cursor.insert_before(K::decode_seam(k)?, V::decode_seam(v)?)?;
                    row = old.next();
                }
                (_, Some(&(ck, cv))) => {
                    if row.is_some_and(|(k, _)| k == ck) {
                        row = old.next();
                    }
                    if let Some(cv) = cv {
                        cursor.insert_before(K::decode_seam(ck)?, V::decode_seam(cv)?)?;
                    }
                    next += 1;
                }
            }
        }
    }
    cursor.close()?;
    Ok(())
}

/// Rows a packed rewrite takes out of the table at a time (few in unit tests, so that their
/// ranges take several).
const PACK_ROWS: usize = if cfg!(test) { 48 } else { 16 << 10 };

/// Bytes of rows a packed leaf holds, about (redb's pages are 4 KiB, less their headers).
const PACKED_LEAF_BYTES: usize = 3 << 10;

struct RedbSnapshot {
    /// Tables opened so far, by [`Table::index`] (each a `ReadOnlyTable<K, V>`): opening a
    /// table looks it up in redb's table tree and checks its types, which cost more than the
    /// point lookup itself when done per get. Declared first, so dropped before `txn`.
    tables: [OnceLock<Box<dyn Any + Send + Sync>>; TABLES],
    txn: ReadTransaction,
}

impl RedbSnapshot {
    /// A snapshot of the last committed state of `db`.
    fn begin(db: &Database) -> Result<RedbSnapshot> {
        Ok(RedbSnapshot {
            tables: Default::default(),
            txn: db.begin_read()?,
        })
    }

    /// Table `table` (definition `def`), opened on first use.
    fn table<K: Key + Conv, V: Conv>(
        &self,
        table: Table,
        def: TableDefinition<K, V>,
    ) -> Result<&ReadOnlyTable<K, V>> {
        let cell = &self.tables[table.index()];
        if cell.get().is_none() {
            let opened: Box<dyn Any + Send + Sync> = Box::new(self.txn.open_table(def)?);
            // Another thread may have opened it meanwhile: either copy will do.
            let _ = cell.set(opened);
        }
        cell.get()
            .and_then(|t| t.downcast_ref::<ReadOnlyTable<K, V>>())
            .ok_or_else(|| Error::Corrupt(format!("redb table {} has another type", table.name())))
    }
}

impl Snapshot for Arc<RedbSnapshot> {
    fn get(&self, table: Table, key: &[u8]) -> Result<Option<Vec<u8>>> {
        dispatch!(table, get_in, self, table, key)
    }

    fn range(&self, table: Table, lo: Bound<&[u8]>, hi: Bound<&[u8]>) -> Result<KvIter<'_>> {
        dispatch!(table, range_in, self, table, lo, hi)
    }

    fn for_each_key(&self, table: Table, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        dispatch!(table, keys_in, self, table, f)
    }
}

/// Calls `f` with every key of a table, lent from redb's page when the key is a byte string
/// (no allocation per entry: this scan fills the dedup filter).
fn keys_in<K: Key + Conv, V: Conv>(
    def: TableDefinition<K, V>,
    snapshot: &RedbSnapshot,
    table: Table,
    f: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    for item in snapshot.table(table, def)?.iter()? {
        let (k, _) = item?;
        K::with_seam_bytes(&k.value(), &mut *f)?;
    }
    Ok(())
}

fn get_in<K: Key + Conv, V: Conv>(
    def: TableDefinition<K, V>,
    snapshot: &RedbSnapshot,
    table: Table,
    key: &[u8],
) -> Result<Option<Vec<u8>>> {
    let got = snapshot.table(table, def)?.get(K::decode_seam(key)?)?;
    Ok(got.map(|g| V::encode_seam(&g.value())))
}

/// Scans on the snapshot's opened table (a dedup index lookup is a scan of one prefix).
fn range_in<K: Key + Conv, V: Conv>(
    def: TableDefinition<K, V>,
    snapshot: &RedbSnapshot,
    table: Table,
    lo: Bound<&[u8]>,
    hi: Bound<&[u8]>,
) -> Result<KvIter<'static>> {
    let range = snapshot
        .table(table, def)?
        .range::<K::SelfType<'_>>((bound::<K>(lo)?, bound::<K>(hi)?))?;
    Ok(Box::new(range.map(|item| {
        let (k, v) = item?;
        let pair = (K::encode_seam(&k.value()), V::encode_seam(&v.value()));
        Ok(pair)
    })))
}

fn bound<K: Conv>(b: Bound<&[u8]>) -> Result<Bound<K::SelfType<'_>>> {
    Ok(match b {
        Bound::Included(k) => Bound::Included(K::decode_seam(k)?),
        Bound::Excluded(k) => Bound::Excluded(K::decode_seam(k)?),
        Bound::Unbounded => Bound::Unbounded,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::SimDisk;
    use crate::format;
    use crate::meta;
    use crate::store::{Backend, Store};

    /// A batch that sets `key` of the pool table to `value`.
    fn pool_row(key: &str, value: &[u8]) -> Batch {
        let mut batch = Batch::default();
        batch.tables[Table::Pool.index()].set(key.as_bytes().to_vec(), Some(value.to_vec()));
        batch
    }

    /// After a power cut, a file whose last batch went through [`MetaStore::write`] opens
    /// without redb's full repair, with every batch; one whose last commit saved no allocator
    /// state (as every commit of the builds before did) is repaired, and opens with its data.
    #[test]
    fn a_store_cut_off_after_its_batches_opens_without_a_full_repair() -> Result<()> {
        let dir = Path::new("/pool");
        for saved in [true, false] {
            let disk = SimDisk::new(5, 1 << 30);
            disk.create_dir_all(dir)
                .map_err(|e| Error::io("mkdir", e))?;
            let store = RedbStore::create(&disk, dir)?;
            for n in 0..3u8 {
                store.write(&pool_row(&format!("k{n}"), &[n; 100]), &mut || Ok(()))?;
            }
            if !saved {
                let txn = store.db.begin_write()?;
                txn.open_table(POOL)?.insert("k3", [3u8; 100].as_slice())?;
                txn.commit()?;
            }
            disk.power_cut();
            drop(store);
            let reopened = RedbStore::open(&disk, dir)?;
            assert_eq!(
                reopened.repaired(),
                !saved,
                "saved allocator state: {saved}"
            );
            let snap = reopened.snapshot()?;
            for n in 0..3 + u8::from(!saved) {
                let key = format!("k{n}");
                assert_eq!(snap.get(Table::Pool, key.as_bytes())?, Some(vec![n; 100]));
            }
        }
        Ok(())
    }

    /// The byte count (what the commits' debug lines and `store-bytes.sh` report) grows by at
    /// least what a batch's values hold and by no more than a few times that, not at all for
    /// reads, and starts again at zero when the file is reopened.
    #[test]
    fn the_store_counts_the_bytes_it_writes() -> Result<()> {
        let dir = Path::new("/pool");
        let disk = SimDisk::new(7, 1 << 30);
        disk.create_dir_all(dir)
            .map_err(|e| Error::io("mkdir", e))?;
        let store = RedbStore::create(&disk, dir)?;
        let before = store.bytes_written();
        let value = vec![0x5a; 256 << 10];
        for n in 0..4 {
            store.write(&pool_row(&format!("big{n}"), &value), &mut || Ok(()))?;
        }
        let grew = store.bytes_written() - before;
        assert!(
            (1 << 20..4 << 20).contains(&grew),
            "4 × 256 KiB of values written as {grew} bytes"
        );
        let snap = store.snapshot()?;
        assert_eq!(snap.get(Table::Pool, b"big3")?, Some(value));
        drop(snap);
        assert_eq!(
            store.bytes_written() - before,
            grew,
            "a read writes nothing"
        );
        drop(store);
        let reopened = RedbStore::open(&disk, dir)?;
        assert!(reopened.bytes_written() < 64 << 10);
        Ok(())
    }

    /// The dedup index as a store reads it: (chunk id, fingerprint prefix) pairs, sorted.
    fn index_entries(store: &Store) -> Result<Vec<(u64, u64)>> {
        let mut got: Vec<(u64, u64)> = store
            .read()?
            .iter(meta::FPS)?
            .map(|e| e.map(|(k, ())| (crate::dedup_key::fps_key_chunk(k), (k >> 64) as u64)))
            .collect::<Result<_>>()?;
        got.sort();
        Ok(got)
    }

    /// A format version 2 dedup index (32-byte fingerprint → chunk id) opens rewritten as
    /// prefix keys, the old table deleted; the next open finds nothing to move.
    #[test]
    fn byte_keyed_index_moves_to_prefix_keys_at_open() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let fps = [([9u8; 32], 1u64), ([3u8; 32], 2), ([3u8; 32], 5)];
        {
            let db = Database::create(dir.path().join(FILE))?;
            let txn = db.begin_write()?;
            {
                let mut t = txn.open_table(FPS_BYTE_KEYS)?;
                for (fp, id) in &fps[..2] {
                    t.insert(fp.as_slice(), id)?;
                }
            }
            txn.commit()?;
        }
        for _ in 0..2 {
            let store = Store::open(dir.path())?;
            let expected = vec![
                (1, crate::dedup_key::fp_prefix(&[9; 32])),
                (2, crate::dedup_key::fp_prefix(&[3; 32])),
            ];
            assert_eq!(index_entries(&store)?, expected);
        }
        let db = Database::open(dir.path().join(FILE))?;
        let names: Vec<String> = db
            .begin_read()?
            .list_tables()?
            .map(|t| t.name().to_string())
            .collect();
        assert!(names.iter().all(|n| n != "fps.bytes"), "{names:?}");
        // Two chunks under one prefix are two keys, both in the prefix's range.
        drop(db);
        let store = Store::open(dir.path())?;
        let mut txn = store.write()?;
        txn.insert(
            meta::FPS,
            &crate::dedup_key::fps_key(&fps[2].0, fps[2].1),
            &(),
        );
        txn.commit()?;
        let under: Vec<u64> = store
            .read()?
            .range(meta::FPS, meta::fps_range(&[3u8; 32]))?
            .map(|e| e.map(|(k, ())| crate::dedup_key::fps_key_chunk(k)))
            .collect::<Result<_>>()?;
        assert_eq!(under, vec![2, 5]);
        Ok(())
    }

    /// A pool created with the array-keyed map and dedup index (format version 1) opens with
    /// the map moved to the byte-keyed table (same values, same scan order), the index
    /// rewritten with prefix keys, and the old tables deleted; the next open finds nothing to
    /// move.
    #[test]
    fn array_keyed_tables_move_to_byte_keys_at_open() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let map = [((2, 0), 7u64), ((1, 5), 50), ((1, 2), 20)];
        let fps = [([9u8; 32], 1u64), ([3u8; 32], 2)];
        {
            let db = Database::create(dir.path().join(FILE))?;
            let txn = db.begin_write()?;
            {
                let mut t = txn.open_table(MAP_ARRAY_KEYS)?;
                for ((layer, block), id) in map {
                    t.insert(format::map_key(layer, block), id)?;
                }
                let mut t = txn.open_table(FPS_ARRAY_KEYS)?;
                for (fp, id) in fps {
                    t.insert(fp, id)?;
                }
            }
            txn.commit()?;
        }
        for _ in 0..2 {
            let store = Store::open(dir.path())?;
            let r = store.read()?;
            let scanned: Vec<([u8; 16], u64)> = r.iter(meta::MAP)?.collect::<Result<_>>()?;
            let mut expected: Vec<([u8; 16], u64)> = map
                .iter()
                .map(|&((layer, block), id)| (format::map_key(layer, block), id))
                .collect();
            expected.sort();
            assert_eq!(scanned, expected);
            drop(r);
            let mut expected: Vec<(u64, u64)> = fps
                .iter()
                .map(|(fp, id)| (*id, crate::dedup_key::fp_prefix(fp)))
                .collect();
            expected.sort();
            assert_eq!(index_entries(&store)?, expected);
        }
        let db = Database::open(dir.path().join(FILE))?;
        let txn = db.begin_read()?;
        let names: Vec<String> = txn.list_tables()?.map(|t| t.name().to_string()).collect();
        assert!(names.iter().all(|n| n != "map" && n != "fps"), "{names:?}");
        assert!(names.iter().any(|n| n == "map.bytes"), "{names:?}");
        Ok(())
    }

    /// Rounds of changes over rows that shrink (as the chunk table's pages do as their chunks
    /// die), applied with packed ranges asked for and without: both tables hold what a model
    /// says after every round (the packed rewrites taking their ranges several batches of
    /// rows at a time, and scattered changes in ranges they barely touch applied as plain
    /// ones), and the packed table its rows in far fewer leaves.
    #[test]
    fn packed_ranges_hold_the_same_rows_in_fuller_leaves() -> Result<()> {
        let dirs = [tempfile::tempdir(), tempfile::tempdir()]
            .map(|d| d.map_err(|e| Error::io("tempdir", e)));
        let [plain_dir, packed_dir] = dirs;
        let (plain_dir, packed_dir) = (plain_dir?, packed_dir?);
        let span = 256u64;
        let pages = 16 * span;
        let mut model: std::collections::BTreeMap<u64, Vec<u8>> = Default::default();
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        {
            let stores = [
                Store::create(plain_dir.path(), Backend::Redb)?,
                Store::create(packed_dir.path(), Backend::Redb)?,
            ];
            // Full pages of 16 entries (1,152 bytes), in commits of 1,024.
            for c in 0..pages / 1024 {
                for store in &stores {
                    let mut txn = store.write()?;
                    for k in c * 1024..(c + 1) * 1024 {
                        txn.insert(meta::CHUNK_PAGES, &k, vec![k as u8; 1152].as_slice());
                    }
                    txn.commit()?;
                }
            }
            for k in 0..pages {
                model.insert(k, vec![k as u8; 1152]);
            }
            for round in 0..48u64 {
                // Every page of one stretch in 16 shrinks (or goes), and a few pages elsewhere.
                let stretch = round % 16;
                let mut changes: Vec<(u64, Option<Vec<u8>>)> = Vec::new();
                for k in stretch * span..(stretch + 1) * span {
                    let Some(v) = model.get(&k) else { continue };
                    let kept = (v.len() / 72).saturating_sub(1 + (next() % 4) as usize);
                    changes.push((k, (kept > 0).then(|| vec![round as u8; kept * 72])));
                }
                for _ in 0..3 {
                    let k = next() % pages;
                    changes.push((k, Some(vec![7; 72 * (1 + (next() % 16) as usize)])));
                }
                for (k, v) in &changes {
                    match v {
                        Some(v) => model.insert(*k, v.clone()),
                        None => model.remove(k),
                    };
                }
                for (packed, store) in stores.iter().enumerate() {
                    let mut txn = store.write()?;
                    for (k, v) in &changes {
                        if packed == 1 {
                            let lo = k / span * span;
                            txn.pack(meta::CHUNK_PAGES, &lo, &(lo + span - 1));
                        }
                        match v {
                            Some(v) => txn.insert(meta::CHUNK_PAGES, k, v.as_slice()),
                            None => txn.remove(meta::CHUNK_PAGES, k),
                        }
                    }
                    txn.commit()?;
                    let rows: Vec<(u64, Vec<u8>)> = store
                        .read()?
                        .iter(meta::CHUNK_PAGES)?
                        .collect::<Result<_>>()?;
                    let expect: Vec<(u64, Vec<u8>)> =
                        model.iter().map(|(k, v)| (*k, v.clone())).collect();
                    assert!(
                        rows == expect,
                        "round {round}, packed {packed}: rows differ"
                    );
                }
            }
        }
        let leaves = |dir: &Path| -> Result<u64> {
            let space = file_space(&dir.join("meta.redb"))?;
            Ok(space
                .tables
                .iter()
                .find(|t| t.name == "chunk.pages")
                .map_or(0, |t| t.leaf_pages))
        };
        let (plain, packed) = (leaves(plain_dir.path())?, leaves(packed_dir.path())?);
        let bytes: usize = model.values().map(|v| v.len() + 8).sum();
        // Packed, a leaf holds over 3 KiB of rows; plain, the shrunk rows stay where they were.
        assert!(
            (packed as usize) * 3072 < bytes && plain > packed * 3 / 2,
            "{packed} leaves packed, {plain} plain, for {bytes} bytes of rows"
        );
        Ok(())
    }
}
