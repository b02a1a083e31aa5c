//! The metadata store seam: what the engine needs from an embedded key-value store, and nothing
//! more.
//!
//! A backend ([`MetaStore`]) offers three things:
//! - **consistent read snapshots** ([`Snapshot`]) with point gets and ordered range scans;
//! - **one atomic, durable write batch** across all tables ([`MetaStore::write`]): when it
//!   returns `Ok`, the whole batch survives a crash; when the process dies before, none of it
//!   does;
//! - its **size on disk**.
//!
//! On top of that, [`Store`] gives the engine typed tables ([`Def`]) and read-modify-write
//! transactions ([`WriteTxn`]): writers are serialized by one lock, read their own uncommitted
//! changes, and commit as one batch. Keys and values cross the seam as bytes
//! ([`Codec`]: integers big-endian so byte order is numeric order).
//!
//! Point reads of the tables the I/O path reads most go through a cache of their committed
//! rows ([`row_cache`]), which commits keep up to date.
//!
//! Backends: [`redb`] (the file `meta.redb`) and [`fjall`] (the directory `meta.fjall/`). A pool
//! records its backend by which of the two it holds, so it always reopens with the backend it
//! was created with.

pub mod deferred;
pub mod fjall;
pub mod redb;
pub mod row_cache;

use crate::disk::{Disk, FsDisk};
use crate::error::{Error, Result};
use parking_lot::{Mutex, MutexGuard};
use rustc_hash::FxHashMap;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;

/// The engine's tables (see [`crate::meta`] for their keys and values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Table {
    /// The pool record.
    Pool,
    /// Volumes by name.
    Volumes,
    /// Volume maps one row per block (format version 10 and older; moved into pages at open).
    Map,
    /// Chunks one per row (format version 5 and older; emptied at open).
    Chunks,
    /// The dedup index's B-tree: (fingerprint prefix, chunk id).
    Fps,
    /// Segment usage.
    Segments,
    /// Snapshots by `VOLUME@SNAPSHOT`.
    Snapshots,
    /// Map layers → refcount.
    Layers,
    /// Chunks at zero references kept alive.
    Orphans,
    /// The dedup index's runs: commit number → sorted keys.
    FpsRuns,
    /// Dedup index keys in runs whose chunks died (format version 6 and older; moved into a
    /// gone row at open).
    FpsDead,
    /// Zeroed ranges a commit left to settle: volume id → ranges.
    Zeroing,
    /// Chunk records in pages of neighbouring ids.
    ChunkPages,
    /// The dedup index's gone rows: commit number → keys of the chunks that died in it.
    FpsGone,
    /// Reference-count changes to committed chunks not yet folded into their records.
    ChunkDeltas,
    /// Volume maps in pages of neighbouring blocks: (layer, page) → entries.
    MapPages,
    /// Changes to `MapPages` not yet written back to it (see [`deferred`]).
    MapLog,
    /// Chunks' fingerprints in pages of neighbouring ids (format version 15).
    ChunkFps,
}

/// Number of tables.
pub const TABLES: usize = 18;

impl Table {
    /// Every table, in index order.
    pub const ALL: [Table; TABLES] = [
        Table::Pool,
        Table::Volumes,
        Table::Map,
        Table::Chunks,
        Table::Fps,
        Table::Segments,
        Table::Snapshots,
        Table::Layers,
        Table::Orphans,
        Table::FpsRuns,
        Table::FpsDead,
        Table::Zeroing,
        Table::ChunkPages,
        Table::FpsGone,
        Table::ChunkDeltas,
        Table::MapPages,
        Table::MapLog,
        Table::ChunkFps,
    ];

    /// Position in [`Table::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The table's name on disk.
    pub fn name(self) -> &'static str {
        match self {
            Table::Pool => "pool",
            Table::Volumes => "volumes",
            Table::Map => "map",
            Table::Chunks => "chunks",
            Table::Fps => "fps",
            Table::Segments => "segments",
            Table::Snapshots => "snapshots",
            Table::Layers => "layers",
            Table::Orphans => "orphans",
            Table::FpsRuns => "fps.runs",
            Table::FpsDead => "fps.dead",
            Table::Zeroing => "zeroing",
            Table::ChunkPages => "chunk.pages",
            Table::FpsGone => "fps.gone",
            Table::ChunkDeltas => "chunk.deltas",
            Table::MapPages => "map.pages",
            Table::MapLog => "map.log",
            Table::ChunkFps => "chunk.fps",
        }
    }
}

/// A key and its value, as bytes.
pub type KvPair = (Vec<u8>, Vec<u8>);
/// An ordered scan over a snapshot.
pub type KvIter<'a> = Box<dyn Iterator<Item = Result<KvPair>> + 'a>;
/// Changes to one table: key → new value (`None`: delete); a later change to a key replaces
/// the earlier one.
///
/// Kept as a log in arrival order and put in key order once, when the batch is written
/// ([`TableOps::sorted`]: a stable sort, then the last change of each key). A commit of new
/// data adds a change per block to the map, mostly in runs of ascending keys, which the
/// stable sort merges in near-linear time; a `BTreeMap` compared each key ~30 times on insert
/// and was a quarter of the commit thread's CPU, and a hash index kept on every change (for a
/// transaction's reads of its own changes) cost ~4 % of the server's CPU under unique writes.
/// The index is built only when a transaction first reads its own changes to the table, and
/// then kept up to date lazily, at each read.
#[derive(Debug, Default)]
pub struct TableOps {
    /// Every change, in arrival order.
    log: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    /// Key → position in `log` of its latest change, covering the first `.1` changes.
    index: RefCell<(FxHashMap<Vec<u8>, usize>, usize)>,
    /// Key ranges (inclusive) to write packed ([`WriteTxn::pack`]), in arrival order.
    packs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl TableOps {
    /// Records that `key` becomes `value` (`None`: is deleted).
    pub fn set(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) {
        self.log.push((key, value));
    }

    /// This batch's change to `key`, if it has one: `Some(None)` for a delete.
    pub fn get(&self, key: &[u8]) -> Option<Option<Vec<u8>>> {
        if self.log.is_empty() {
            return None;
        }
        let mut index = self.index.borrow_mut();
        let (map, covered) = &mut *index;
        for (at, (k, _)) in self.log.iter().enumerate().skip(*covered) {
            map.insert(k.clone(), at);
        }
        *covered = self.log.len();
        map.get(key).map(|&at| self.log[at].1.clone())
    }

    /// Whether there is no change.
    pub fn is_empty(&self) -> bool {
        self.log.is_empty()
    }

    /// Asks for the rows of `lo..=hi` to be written packed (see [`WriteTxn::pack`]).
    pub fn pack(&mut self, lo: Vec<u8>, hi: Vec<u8>) {
        if lo <= hi {
            self.packs.push((lo, hi));
        }
    }

    /// The ranges to write packed, in key order, overlapping ones joined.
    pub fn packs(&self) -> Vec<(&[u8], &[u8])> {
        let mut v: Vec<(&[u8], &[u8])> = self
            .packs
            .iter()
            .map(|(lo, hi)| (lo.as_slice(), hi.as_slice()))
            .collect();
        v.sort_unstable();
        let mut out: Vec<(&[u8], &[u8])> = Vec::with_capacity(v.len());
        for (lo, hi) in v {
            match out.last_mut() {
                Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
                _ => out.push((lo, hi)),
            }
        }
        out
    }

    /// Forgets every change, keeping the memory for the next batch unless it holds room for
    /// more than [`TableOps::RETAINED_MAX`] changes (a rare huge batch, such as the deletion
    /// of a large layer, gives its memory back).
    fn clear(&mut self) {
        if self.log.capacity() > Self::RETAINED_MAX {
            self.log = Vec::new();
        } else {
            self.log.clear();
        }
        let index = self.index.get_mut();
        if index.0.capacity() > Self::RETAINED_MAX {
            index.0 = FxHashMap::default();
        } else {
            index.0.clear();
        }
        index.1 = 0;
        self.packs.clear();
    }

    /// Most changes a table's emptied batch keeps room for (a commit under a sequential write
    /// load holds about 128 Ki per table).
    const RETAINED_MAX: usize = 512 << 10;

    /// Every key's last change, in key order.
    pub fn sorted(&self) -> Vec<(&[u8], Option<&[u8]>)> {
        self.last_changes(|_| true)
    }

    /// The last changes to keys within `(lo, hi)`, in key order.
    fn in_range(&self, lo: Bound<&[u8]>, hi: Bound<&[u8]>) -> Vec<(&[u8], Option<&[u8]>)> {
        self.last_changes(|k| (lo, hi).contains(k))
    }

    /// The last change of each key that `keep` accepts, in key order.
    fn last_changes(&self, keep: impl Fn(&[u8]) -> bool) -> Vec<(&[u8], Option<&[u8]>)> {
        let mut v: Vec<(&[u8], Option<&[u8]>)> = self
            .log
            .iter()
            .filter(|(k, _)| keep(k))
            .map(|(k, v)| (k.as_slice(), v.as_deref()))
            .collect();
        // Stable: a key's changes stay in arrival order, and the last one is kept.
        v.sort_by(|a, b| a.0.cmp(b.0));
        v.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                *kept = *later;
            }
            same
        });
        v
    }
}

/// One atomic batch of changes across the tables.
#[derive(Debug, Default)]
pub struct Batch {
    /// Per table (indexed by [`Table::index`]), its changes.
    pub tables: [TableOps; TABLES],
}

impl Batch {
    /// Whether the batch changes nothing.
    pub fn is_empty(&self) -> bool {
        self.tables.iter().all(|t| t.is_empty())
    }
}

/// A backend: an embedded, crash-safe key-value store holding the engine's tables.
pub trait MetaStore: Send + Sync {
    /// A consistent view of the last committed batch.
    fn snapshot(&self) -> Result<Box<dyn Snapshot + '_>>;
    /// Applies `batch` atomically; durable (fsynced) when it returns `Ok`. Calls `ready` once
    /// the batch is in a transaction not yet committed (for redb, after the B-tree work, most
    /// of a write's time) and commits only if it returns `Ok` (else returns its error, having
    /// changed nothing). Callers serialize writes ([`Store`] does).
    fn write(&self, batch: &Batch, ready: &mut dyn FnMut() -> Result<()>) -> Result<()>;
    /// Bytes the store occupies on disk (allocated, not apparent: sparse parts are free).
    fn disk_bytes(&self) -> u64;
    /// Bytes written to its files since it was opened, where the backend counts them (0 where
    /// it does not).
    fn bytes_written(&self) -> u64 {
        0
    }
}

/// A consistent read view.
pub trait Snapshot {
    /// The value of `key` in `table`.
    fn get(&self, table: Table, key: &[u8]) -> Result<Option<Vec<u8>>>;
    /// Entries of `table` with keys in `(lo, hi)`, in key order.
    fn range(&self, table: Table, lo: Bound<&[u8]>, hi: Bound<&[u8]>) -> Result<KvIter<'_>>;
    /// Calls `f` with every key of `table`, in key order. A backend may lend its own bytes
    /// instead of copying each pair out as [`Snapshot::range`] does.
    fn for_each_key(&self, table: Table, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        for item in self.range(table, Bound::Unbounded, Bound::Unbounded)? {
            f(&item?.0)?;
        }
        Ok(())
    }
}

/// Byte encoding of a key or value type. Integers are big-endian, so byte order is numeric
/// order; strings are UTF-8; `()` is empty.
pub trait Codec {
    /// The decoded, owned form.
    type Owned;
    /// Encodes.
    fn encode(&self) -> Vec<u8>;
    /// Decodes, or reports corruption.
    fn decode(b: &[u8]) -> Result<Self::Owned>;
}

fn corrupt(what: &str, b: &[u8]) -> Error {
    Error::Corrupt(format!("metadata {what} of {} bytes", b.len()))
}

impl Codec for u64 {
    type Owned = u64;
    fn encode(&self) -> Vec<u8> {
        self.to_be_bytes().to_vec()
    }
    fn decode(b: &[u8]) -> Result<u64> {
        Ok(u64::from_be_bytes(
            b.try_into().map_err(|_| corrupt("u64", b))?,
        ))
    }
}

impl<const N: usize> Codec for [u8; N] {
    type Owned = [u8; N];
    fn encode(&self) -> Vec<u8> {
        self.to_vec()
    }
    fn decode(b: &[u8]) -> Result<[u8; N]> {
        b.try_into().map_err(|_| corrupt("fixed-size key", b))
    }
}

/// Big-endian, so keys sort as numbers.
impl Codec for u128 {
    type Owned = u128;
    fn encode(&self) -> Vec<u8> {
        self.to_be_bytes().to_vec()
    }
    fn decode(b: &[u8]) -> Result<u128> {
        Ok(u128::from_be_bytes(
            b.try_into().map_err(|_| corrupt("u128", b))?,
        ))
    }
}

impl Codec for str {
    type Owned = String;
    fn encode(&self) -> Vec<u8> {
        self.as_bytes().to_vec()
    }
    fn decode(b: &[u8]) -> Result<String> {
        String::from_utf8(b.to_vec()).map_err(|_| corrupt("non-UTF-8 name", b))
    }
}

impl Codec for [u8] {
    type Owned = Vec<u8>;
    fn encode(&self) -> Vec<u8> {
        self.to_vec()
    }
    fn decode(b: &[u8]) -> Result<Vec<u8>> {
        Ok(b.to_vec())
    }
}

impl Codec for () {
    type Owned = ();
    fn encode(&self) -> Vec<u8> {
        Vec::new()
    }
    fn decode(b: &[u8]) -> Result<()> {
        if b.is_empty() {
            Ok(())
        } else {
            Err(corrupt("unit value", b))
        }
    }
}

/// A typed table: its key and value types.
pub struct Def<K: ?Sized, V: ?Sized> {
    /// The table.
    pub table: Table,
    types: PhantomData<fn(&K, &V)>,
}

impl<K: ?Sized, V: ?Sized> Def<K, V> {
    /// Declares `table` as holding `K` → `V`.
    pub const fn new(table: Table) -> Self {
        Def {
            table,
            types: PhantomData,
        }
    }
}

impl<K: ?Sized, V: ?Sized> Clone for Def<K, V> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<K: ?Sized, V: ?Sized> Copy for Def<K, V> {}

/// Which backend a pool's metadata lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// redb, in `meta.redb`.
    #[default]
    Redb,
    /// fjall, in `meta.fjall/`.
    Fjall,
}

/// Environment variable naming the backend of new pools (`redb` or `fjall`), read by
/// [`crate::PoolConfig::default`].
pub const BACKEND_ENV: &str = "IBID_META_BACKEND";

impl Backend {
    /// The backend of the pool in `dir` on `disk`, if it holds one.
    pub fn detect(disk: &dyn Disk, dir: &Path) -> Option<Backend> {
        if disk.exists(&dir.join(redb::FILE)) {
            Some(Backend::Redb)
        } else if disk.exists(&dir.join(fjall::DIR)) {
            Some(Backend::Fjall)
        } else {
            None
        }
    }

    /// Parses `redb` or `fjall`.
    pub fn parse(s: &str) -> Option<Backend> {
        match s {
            "redb" => Some(Backend::Redb),
            "fjall" => Some(Backend::Fjall),
            _ => None,
        }
    }

    /// The backend named by [`BACKEND_ENV`], or the default when it is unset.
    ///
    /// # Panics
    /// If the variable names no backend: a typo must not silently test the other one.
    pub fn from_env() -> Backend {
        match std::env::var(BACKEND_ENV) {
            Ok(v) => Backend::parse(&v)
                .unwrap_or_else(|| panic!("{BACKEND_ENV}={v:?}: expected redb or fjall")),
            Err(_) => Backend::default(),
        }
    }

    /// The backend's name.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Redb => "redb",
            Backend::Fjall => "fjall",
        }
    }
}

/// Whether `dir` holds a pool's metadata store.
pub fn exists(dir: &Path) -> bool {
    exists_on(&FsDisk, dir)
}

/// Whether `dir` on `disk` holds a pool's metadata store.
pub fn exists_on(disk: &dyn Disk, dir: &Path) -> bool {
    Backend::detect(disk, dir).is_some()
}

/// fjall keeps its own files: it runs only on the real filesystem.
fn fjall_on_fs(disk: &dyn Disk) -> Result<()> {
    match disk.is_real_filesystem() {
        true => Ok(()),
        false => Err(Error::InvalidArgument(
            "the fjall metadata store does not go through the disk seam: use redb".into(),
        )),
    }
}

/// The engine's handle on its metadata store.
pub struct Store {
    backend: Box<dyn MetaStore>,
    kind: Backend,
    /// Held by the one open [`WriteTxn`]: the last transaction's emptied batch, whose tables
    /// keep their capacity. A commit of new data fills them with hundreds of thousands of
    /// changes; allocated afresh each time, that memory came from the kernel, zeroed, on
    /// every commit.
    writer: Mutex<Batch>,
    /// Committed rows of the most read tables.
    cache: row_cache::RowCache,
    /// The map's changes logged and not yet written back to its table.
    deferred: deferred::Deferred,
}

impl Store {
    /// Creates a new, empty store of kind `kind` in `dir`.
    pub fn create(dir: &Path, kind: Backend) -> Result<Store> {
        Self::create_on(&FsDisk, dir, kind)
    }

    /// Creates a new, empty store of kind `kind` in `dir` on `disk`.
    pub fn create_on(disk: &dyn Disk, dir: &Path, kind: Backend) -> Result<Store> {
        let backend: Box<dyn MetaStore> = match kind {
            Backend::Redb => Box::new(redb::RedbStore::create(disk, dir)?),
            Backend::Fjall => {
                fjall_on_fs(disk)?;
                Box::new(fjall::FjallStore::create(dir)?)
            }
        };
        Store::new(backend, kind)
    }

    /// Opens the store in `dir` with the backend it was created with.
    pub fn open(dir: &Path) -> Result<Store> {
        Self::open_on(&FsDisk, dir)
    }

    /// Opens the store in `dir` on `disk` with the backend it was created with.
    pub fn open_on(disk: &dyn Disk, dir: &Path) -> Result<Store> {
        let kind = Backend::detect(disk, dir)
            .ok_or_else(|| Error::NotFound(format!("metadata store in {}", dir.display())))?;
        let started = std::time::Instant::now();
        let backend: Box<dyn MetaStore> = match kind {
            Backend::Redb => Box::new(redb::RedbStore::open(disk, dir)?),
            Backend::Fjall => {
                fjall_on_fs(disk)?;
                Box::new(fjall::FjallStore::open(dir)?)
            }
        };
        tracing::debug!(
            "metadata store {kind:?} opened in {:.3} s",
            started.elapsed().as_secs_f64()
        );
        Store::new(backend, kind)
    }

    fn new(backend: Box<dyn MetaStore>, kind: Backend) -> Result<Store> {
        let deferred = deferred::Deferred::load(&*backend.snapshot()?)?;
        Ok(Store {
            backend,
            kind,
            writer: Mutex::new(Batch::default()),
            cache: row_cache::RowCache::new(row_cache::ROW_CACHE_BYTES),
            deferred,
        })
    }

    /// The backend in use.
    pub fn backend(&self) -> Backend {
        self.kind
    }

    /// A read transaction on the last committed state.
    pub fn read(&self) -> Result<ReadTxn<'_>> {
        // The generation first: the snapshot is then of that batch or a newer one. The
        // pending map changes with them (see `deferred`).
        let (pending, (generation, snap)) = self
            .deferred
            .pending_with(|| (self.cache.generation(), self.backend.snapshot()));
        Ok(ReadTxn {
            snap: snap?,
            pending,
            cache: &self.cache,
            generation,
        })
    }

    /// A write transaction; waits for the previous one to finish.
    pub fn write(&self) -> Result<WriteTxn<'_>> {
        let mut guard = self.writer.lock();
        let batch = std::mem::take(&mut *guard);
        // No commit runs while the writer lock is held: the base is of this generation.
        let generation = self.cache.generation();
        let (pending, base) = self.deferred.pending_with(|| self.backend.snapshot());
        Ok(WriteTxn {
            base: Some(base?),
            pending,
            write_back_all: false,
            write_through: false,
            generation,
            deltas: FxHashMap::default(),
            batch,
            store: self,
            guard,
        })
    }

    /// Bytes on disk.
    pub fn disk_bytes(&self) -> u64 {
        self.backend.disk_bytes()
    }

    /// Bytes written to the store's files since it was opened (0 where the backend does not
    /// count them: fjall).
    pub fn bytes_written(&self) -> u64 {
        self.backend.bytes_written()
    }

    /// Writes every pending map change back to the map's table (one transaction; nothing
    /// if none is pending).
    pub fn write_back_all(&self) -> Result<()> {
        let mut txn = self.write()?;
        txn.write_back_all = true;
        txn.commit()
    }

    /// Map changes logged and not yet written back.
    pub fn pending_map_changes(&self) -> usize {
        self.deferred.pending_with(|| ()).0.len()
    }

    /// Checks the map changes pending in memory against the log rows of the last commit.
    /// Takes the writer lock, so that no commit runs meanwhile.
    pub fn check_pending(&self) -> Result<()> {
        let _writer = self.writer.lock();
        self.deferred.check(&*self.backend.snapshot()?)
    }
}

fn byte_bounds<K: Codec>(r: &impl RangeBounds<K>) -> (Bound<Vec<u8>>, Bound<Vec<u8>>) {
    (
        r.start_bound().map(|k| k.encode()),
        r.end_bound().map(|k| k.encode()),
    )
}

fn as_slices(b: &(Bound<Vec<u8>>, Bound<Vec<u8>>)) -> (Bound<&[u8]>, Bound<&[u8]>) {
    (
        b.0.as_ref().map(|v| v.as_slice()),
        b.1.as_ref().map(|v| v.as_slice()),
    )
}

fn decode_pair<K: Codec + ?Sized, V: Codec + ?Sized>(
    (k, v): KvPair,
) -> Result<(K::Owned, V::Owned)> {
    Ok((K::decode(&k)?, V::decode(&v)?))
}

/// Typed point reads, for read and write transactions alike.
pub trait Reader {
    /// The raw value of `key` in `table`.
    fn get_raw(&self, table: Table, key: &[u8]) -> Result<Option<Vec<u8>>>;

    /// The value of `key`.
    fn get<K: Codec + ?Sized, V: Codec + ?Sized>(
        &self,
        def: Def<K, V>,
        key: &K,
    ) -> Result<Option<V::Owned>>
    where
        Self: Sized,
    {
        self.get_raw(def.table, &key.encode())?
            .map(|v| V::decode(&v))
            .transpose()
    }
}

/// A consistent read of the committed state.
pub struct ReadTxn<'a> {
    snap: Box<dyn Snapshot + 'a>,
    /// The map changes not yet written back as of `snap`.
    pending: Arc<deferred::Pending>,
    cache: &'a row_cache::RowCache,
    /// The cache's generation when the snapshot was taken.
    generation: u64,
}

/// `key` of `table` from `cache` if it holds it for `generation`, else from `snap` (offered
/// to the cache; rows of tables it does not cache go straight to `snap`, without its lock).
fn cached_get(
    cache: &row_cache::RowCache,
    generation: u64,
    snap: &(dyn Snapshot + '_),
    table: Table,
    key: &[u8],
) -> Result<Option<Vec<u8>>> {
    if let Some(row) = cache.get(generation, table, key) {
        return Ok(row);
    }
    let row = snap.get(table, key)?;
    cache.offer(generation, table, key, row.as_deref());
    Ok(row)
}

impl Reader for ReadTxn<'_> {
    fn get_raw(&self, table: Table, key: &[u8]) -> Result<Option<Vec<u8>>> {
        if let Some(v) = pending_get(&self.pending, table, key) {
            return Ok(v);
        }
        cached_get(self.cache, self.generation, &*self.snap, table, key)
    }
}

/// The pending change to `key` of `table` if that is the deferred table and one is pending.
fn pending_get(pending: &deferred::Pending, table: Table, key: &[u8]) -> Option<Option<Vec<u8>>> {
    if table != deferred::DEFERRED {
        return None;
    }
    pending.get(key).map(|v| v.map(<[u8]>::to_vec))
}

/// `base` (a scan of the deferred table's B-tree) with the pending `changes` of its range
/// over it, in key order.
fn merged<'a>(
    mut base: std::iter::Peekable<KvIter<'a>>,
    changes: Vec<&'a deferred::Change>,
) -> KvIter<'a> {
    let mut changes = changes.into_iter().peekable();
    Box::new(std::iter::from_fn(move || loop {
        let order = match (base.peek(), changes.peek()) {
            (Some(Err(_)), _) => return base.next(),
            (Some(Ok((k, _))), Some((c, _))) => k.as_slice().cmp(c),
            (Some(Ok(_)), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => return None,
        };
        if order == std::cmp::Ordering::Less {
            return base.next();
        }
        if order == std::cmp::Ordering::Equal {
            base.next();
        }
        let (k, v) = changes.next().expect("peeked");
        if let Some(v) = v {
            return Some(Ok((k.to_vec(), v.to_vec())));
        }
    }))
}

impl ReadTxn<'_> {
    /// The committed rows of `table` with keys in `(lo, hi)`, in key order.
    fn range_raw(&self, table: Table, lo: Bound<&[u8]>, hi: Bound<&[u8]>) -> Result<KvIter<'_>> {
        let base = self.snap.range(table, lo, hi)?;
        if table != deferred::DEFERRED {
            return Ok(base);
        }
        Ok(merged(base.peekable(), self.pending.range(lo, hi)))
    }

    /// Entries with keys in `range`, in key order.
    pub fn range<K: Codec, V: Codec + ?Sized>(
        &self,
        def: Def<K, V>,
        range: impl RangeBounds<K>,
    ) -> Result<impl Iterator<Item = Result<(K::Owned, V::Owned)>> + '_> {
        let b = byte_bounds(&range);
        let (lo, hi) = as_slices(&b);
        Ok(self
            .range_raw(def.table, lo, hi)?
            .map(|i| i.and_then(decode_pair::<K, V>)))
    }

    /// Calls `f` with every key, in key order, without reading the values out, until `f`
    /// answers `false`. Returns whether every key was seen.
    pub fn for_each_key_while<K: Codec + ?Sized, V: ?Sized>(
        &self,
        def: Def<K, V>,
        mut f: impl FnMut(K::Owned) -> bool,
    ) -> Result<bool> {
        if def.table == deferred::DEFERRED {
            for item in self.range_raw(def.table, Bound::Unbounded, Bound::Unbounded)? {
                if !f(K::decode(&item?.0)?) {
                    return Ok(false);
                }
            }
            return Ok(true);
        }
        let mut stopped = false;
        let scanned = self.snap.for_each_key(def.table, &mut |k| {
            if f(K::decode(k)?) {
                Ok(())
            } else {
                // Ends the backend's scan; told apart from a real error by `stopped`.
                stopped = true;
                Err(Error::InvalidArgument("key scan stopped".into()))
            }
        });
        match scanned {
            Err(_) if stopped => Ok(false),
            Err(e) => Err(e),
            Ok(()) => Ok(true),
        }
    }

    /// Every entry, in key order.
    pub fn iter<K: Codec + ?Sized, V: Codec + ?Sized>(
        &self,
        def: Def<K, V>,
    ) -> Result<impl Iterator<Item = Result<(K::Owned, V::Owned)>> + '_> {
        Ok(self
            .range_raw(def.table, Bound::Unbounded, Bound::Unbounded)?
            .map(|i| i.and_then(decode_pair::<K, V>)))
    }
}

/// A read-modify-write transaction: reads see the committed state plus this transaction's own
/// changes; [`WriteTxn::commit`] applies them as one atomic, durable batch. Dropped without
/// commit, it changes nothing.
pub struct WriteTxn<'a> {
    /// The committed state this transaction reads under its changes; released before the
    /// batch is written.
    base: Option<Box<dyn Snapshot + 'a>>,
    /// The map changes not yet written back as of `base`.
    pending: Arc<deferred::Pending>,
    /// Whether the commit writes back every pending map change, not just a slice's.
    write_back_all: bool,
    /// Whether the map's changes go straight to its table (see [`WriteTxn::write_through`]).
    write_through: bool,
    /// The row cache's generation of `base`.
    generation: u64,
    /// Page deltas of deferred-table keys whose one change in this transaction its writer
    /// made over the committed page and described ([`WriteTxn::set_deferred`]): logged as
    /// they are, without reading the page again.
    deltas: FxHashMap<[u8; 16], Vec<u8>>,
    batch: Batch,
    store: &'a Store,
    /// The store's writer lock; gets the batch back, emptied, when the transaction ends.
    guard: MutexGuard<'a, Batch>,
}

impl Drop for WriteTxn<'_> {
    fn drop(&mut self) {
        let mut batch = std::mem::take(&mut self.batch);
        for t in &mut batch.tables {
            t.clear();
        }
        *self.guard = batch;
    }
}

impl Reader for WriteTxn<'_> {
    fn get_raw(&self, table: Table, key: &[u8]) -> Result<Option<Vec<u8>>> {
        if let Some(v) = self.batch.tables[table.index()].get(key) {
            return Ok(v);
        }
        if let Some(v) = pending_get(&self.pending, table, key) {
            return Ok(v);
        }
        cached_get(&self.store.cache, self.generation, self.base(), table, key)
    }
}

impl WriteTxn<'_> {
    /// Sets `key` to `value`.
    pub fn insert<K: Codec + ?Sized, V: Codec + ?Sized>(
        &mut self,
        def: Def<K, V>,
        key: &K,
        value: &V,
    ) {
        let key = key.encode();
        self.forget_delta(def.table, &key);
        self.batch.tables[def.table.index()].set(key, Some(value.encode()));
    }

    /// Deletes `key` (absent or not).
    pub fn remove<K: Codec + ?Sized, V: Codec + ?Sized>(&mut self, def: Def<K, V>, key: &K) {
        let key = key.encode();
        self.forget_delta(def.table, &key);
        self.batch.tables[def.table.index()].set(key, None);
    }

    /// Asks the backend to write the rows of `lo..=hi` packed when it applies this batch: a
    /// hint, not a change (what the table holds afterwards is the same). redb leaves a leaf
    /// as sparse as the values replaced in it left it — a value that shrinks never merges its
    /// leaf with a neighbour, only a deletion can — so a table whose rows shrink as they are
    /// rewritten (the chunk table's pages, as their chunks die) kept about a third of its
    /// leaves' bytes in use, and every commit that rewrote a stretch of it wrote three times
    /// the pages it needed. Where this batch changes about every leaf of the range anyway,
    /// the backend rewrites all of its rows, so they are laid out in full leaves again; where
    /// it changes few, or a minority of its rows, it applies them as usual. Ask for ranges the
    /// batch may rewrite densely: a stretch of the chunk table (a fold's), a stretch of the
    /// map written back.
    pub fn pack<K: Codec + ?Sized, V: Codec + ?Sized>(&mut self, def: Def<K, V>, lo: &K, hi: &K) {
        self.batch.tables[def.table.index()].pack(lo.encode(), hi.encode());
    }

    /// Sets `key` of the deferred table ([`deferred::DEFERRED`], the map's pages) to `value`
    /// (`None`: deletes it). `delta`: the page delta from the page this transaction read at
    /// `key` to `value` (`map_page.rs`), if it read one: when that was the committed page (no
    /// change to `key` in this transaction before), the map log records it as it is.
    pub fn set_deferred(&mut self, key: &[u8; 16], value: Option<Vec<u8>>, delta: Option<Vec<u8>>) {
        let ops = &mut self.batch.tables[deferred::DEFERRED.index()];
        match delta {
            Some(delta) if ops.get(key).is_none() => {
                self.deltas.insert(*key, delta);
            }
            _ => {
                self.deltas.remove(key);
            }
        }
        ops.set(key.to_vec(), value);
    }

    /// Drops the delta given for `key` of `table` (changed again: no longer its change).
    fn forget_delta(&mut self, table: Table, key: &[u8]) {
        if table == deferred::DEFERRED && !self.deltas.is_empty() {
            if let Ok(key) = <&[u8; 16]>::try_from(key) {
                self.deltas.remove(key);
            }
        }
    }

    /// Entries with keys in `range` as this transaction sees them, in key order.
    pub fn range<K: Codec, V: Codec + ?Sized>(
        &self,
        def: Def<K, V>,
        range: impl RangeBounds<K>,
    ) -> Result<Vec<(K::Owned, V::Owned)>> {
        self.range_raw(def.table, &byte_bounds(&range))?
            .into_iter()
            .map(decode_pair::<K, V>)
            .collect()
    }

    /// Every entry as this transaction sees it, in key order.
    pub fn iter<K: Codec + ?Sized, V: Codec + ?Sized>(
        &self,
        def: Def<K, V>,
    ) -> Result<Vec<(K::Owned, V::Owned)>> {
        self.range_raw(def.table, &(Bound::Unbounded, Bound::Unbounded))?
            .into_iter()
            .map(decode_pair::<K, V>)
            .collect()
    }

    /// Deletes the entries with keys in `range` for which `keep` is false, and returns them.
    pub fn extract_range_if<K: Codec, V: Codec + ?Sized>(
        &mut self,
        def: Def<K, V>,
        range: impl RangeBounds<K>,
        mut take: impl FnMut(&K::Owned, &V::Owned) -> bool,
    ) -> Result<Vec<(K::Owned, V::Owned)>> {
        let mut out = Vec::new();
        for (kb, vb) in self.range_raw(def.table, &byte_bounds(&range))? {
            let (k, v) = (K::decode(&kb)?, V::decode(&vb)?);
            if take(&k, &v) {
                self.forget_delta(def.table, &kb);
                self.batch.tables[def.table.index()].set(kb, None);
                out.push((k, v));
            }
        }
        Ok(out)
    }

    fn base(&self) -> &(dyn Snapshot + '_) {
        self.base
            .as_deref()
            .expect("taken only by commit, which consumes the transaction")
    }

    fn range_raw(
        &self,
        table: Table,
        bounds: &(Bound<Vec<u8>>, Bound<Vec<u8>>),
    ) -> Result<Vec<KvPair>> {
        let (lo, hi) = as_slices(bounds);
        let mut merged: BTreeMap<Vec<u8>, Vec<u8>> =
            self.base().range(table, lo, hi)?.collect::<Result<_>>()?;
        if table == deferred::DEFERRED {
            for (k, v) in self.pending.range(lo, hi) {
                match v {
                    Some(v) => merged.insert(k.to_vec(), v.to_vec()),
                    None => merged.remove(&**k),
                };
            }
        }
        for (k, v) in self.batch.tables[table.index()].in_range(lo, hi) {
            match v {
                Some(v) => merged.insert(k.to_vec(), v.to_vec()),
                None => merged.remove(k),
            };
        }
        Ok(merged.into_iter().collect())
    }

    /// Writes this transaction's map changes straight to the map's table instead of its log,
    /// if nothing is pending (else they are deferred as usual). Only for a transaction no
    /// reader runs beside — a pool's format upgrade at open, which may move a whole map: its
    /// changes would otherwise all wait in memory to be written back.
    pub fn write_through(&mut self) {
        self.write_through = true;
    }

    /// Applies every change atomically; durable when it returns `Ok`.
    pub fn commit(self) -> Result<()> {
        self.commit_after(|| Ok(()))
    }

    /// [`Self::commit`], calling `ready` once the changes are applied to the backend's
    /// transaction and committing only if it returns `Ok`: what must be durable before the
    /// changes are (the records they point at) can be made so while the backend works.
    pub fn commit_after(mut self, ready: impl FnOnce() -> Result<()>) -> Result<()> {
        let mut ready = Some(ready);
        let mut ready = || ready.take().map_or(Ok(()), |f| f());
        let all = self.write_back_all && !self.pending.is_empty();
        if self.batch.is_empty() && !all {
            self.base = None;
            return ready();
        }
        // The map's changes go to its log (pages that exist as deltas over what `base`
        // holds); the slices due are written back.
        let through = self.write_through && self.pending.is_empty();
        let staged = match through {
            true => None,
            false => {
                let base = self.base.as_deref().expect("released only below");
                let (cache, generation) = (&self.store.cache, self.generation);
                let pending = &self.pending;
                let committed = |key: &[u8]| match pending.get(key) {
                    Some(v) => Ok(v.map(<[u8]>::to_vec)),
                    None => cached_get(cache, generation, base, deferred::DEFERRED, key),
                };
                let deferred = &self.store.deferred;
                let logged = deferred::Logged {
                    deltas: &self.deltas,
                    committed: &committed,
                };
                Some(deferred.stage(&mut self.batch, &self.pending, all, &logged)?)
            }
        };
        self.base = None;
        let cache = &self.store.cache;
        cache.begin(&self.batch);
        let written = self.store.backend.write(&self.batch, &mut ready);
        cache.end(&self.batch, written.is_ok());
        if let (Ok(()), Some(staged)) = (&written, staged) {
            self.store.deferred.publish(staged);
        }
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta;

    /// A batch's changes come out in key order whatever order they were made in, the last
    /// change to a key winning; a range sees only its own keys.
    #[test]
    fn table_ops_sort_and_keep_the_last_change() {
        let mut ops = TableOps::default();
        for (k, v) in [
            (3u8, Some(30u8)),
            (1, Some(10)),
            (2, None),
            (3, None),
            (2, Some(21)),
        ] {
            ops.set(vec![k], v.map(|v| vec![v]));
        }
        let expect: Vec<(&[u8], Option<&[u8]>)> = vec![
            (&[1], Some(&[10][..])),
            (&[2], Some(&[21][..])),
            (&[3], None),
        ];
        assert_eq!(ops.sorted(), expect);
        assert_eq!(ops.get(&[3]), Some(None));
        assert_eq!(ops.get(&[2]), Some(Some(vec![21])));
        assert_eq!(ops.get(&[5]), None);
        let r = ops.in_range(Bound::Excluded(&[1][..]), Bound::Unbounded);
        assert_eq!(r, expect[1..].to_vec());
        // Changes after a read are seen by the next one.
        ops.set(vec![3], Some(vec![31]));
        ops.set(vec![4], None);
        assert_eq!(ops.get(&[3]), Some(Some(vec![31])));
        assert_eq!(ops.get(&[4]), Some(None));
        ops.set(vec![4], Some(vec![40]));
        assert_eq!(ops.sorted().last(), Some(&(&[4][..], Some(&[40][..]))));
        ops.clear();
        assert!(ops.is_empty());
        assert_eq!(ops.get(&[1]), None, "cleared");
    }

    /// Both backends: a batch is visible after commit, a write transaction reads its own
    /// changes, range scans are in numeric key order, and a reopened store keeps its backend.
    #[test]
    fn backends_round_trip() -> Result<()> {
        for kind in [Backend::Redb, Backend::Fjall] {
            let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
            {
                let store = Store::create(dir.path(), kind)?;
                let mut txn = store.write()?;
                for id in [3u64, 1, 256, 2] {
                    txn.insert(meta::LAYERS, &id, &(id * 10));
                }
                txn.remove(meta::LAYERS, &2);
                assert_eq!(txn.get(meta::LAYERS, &256)?, Some(2560));
                assert_eq!(txn.get(meta::LAYERS, &2)?, None);
                txn.insert(meta::VOLUMES, "vm1", b"record".as_slice());
                txn.commit()?;
                let mut txn = store.write()?;
                let taken = txn.extract_range_if(meta::LAYERS, 1..=3, |_, _| true)?;
                assert_eq!(taken, vec![(1, 10), (3, 30)]);
                txn.commit()?;
            }
            assert_eq!(Backend::detect(&FsDisk, dir.path()), Some(kind));
            let store = Store::open(dir.path())?;
            assert_eq!(store.backend(), kind);
            let r = store.read()?;
            let all: Vec<(u64, u64)> = r.iter(meta::LAYERS)?.collect::<Result<_>>()?;
            assert_eq!(all, vec![(256, 2560)]);
            assert_eq!(r.get(meta::VOLUMES, "vm1")?, Some(b"record".to_vec()));
            assert!(store.disk_bytes() > 0);
        }
        Ok(())
    }

    /// Both backends, through the row cache (`map.pages`): a read transaction keeps seeing its
    /// snapshot's rows after a commit changed them, a new one sees the commit's, a row read
    /// during a commit's `ready` is the old one and the cache does not keep it, and a failed
    /// commit leaves the old rows served.
    #[test]
    fn cached_rows_follow_each_transactions_snapshot() -> Result<()> {
        for kind in [Backend::Redb, Backend::Fjall] {
            let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
            let store = Store::create(dir.path(), kind)?;
            let (a, b) = ([1u8; 16], [2u8; 16]);
            let row = |txn: &ReadTxn, k: &[u8; 16]| txn.get(meta::MAP_PAGES, k);
            let mut txn = store.write()?;
            txn.insert(meta::MAP_PAGES, &a, b"one".as_slice());
            txn.commit()?;
            let old = store.read()?;
            assert_eq!(row(&old, &a)?, Some(b"one".to_vec()));
            assert_eq!(row(&old, &b)?, None);
            let mut txn = store.write()?;
            txn.insert(meta::MAP_PAGES, &a, b"two".as_slice());
            txn.insert(meta::MAP_PAGES, &b, b"new".as_slice());
            assert_eq!(txn.get(meta::MAP_PAGES, &a)?, Some(b"two".to_vec()));
            txn.commit_after(|| {
                let during = store.read()?;
                assert_eq!(row(&during, &a)?, Some(b"one".to_vec()), "{kind:?}");
                Ok(())
            })?;
            assert_eq!(
                row(&old, &a)?,
                Some(b"one".to_vec()),
                "{kind:?}: old snapshot"
            );
            assert_eq!(row(&old, &b)?, None, "{kind:?}: old snapshot");
            let new = store.read()?;
            assert_eq!(row(&new, &a)?, Some(b"two".to_vec()), "{kind:?}");
            assert_eq!(row(&new, &b)?, Some(b"new".to_vec()), "{kind:?}");
            let mut txn = store.write()?;
            txn.remove(meta::MAP_PAGES, &a);
            let failed = txn.commit_after(|| Err(Error::Failed("not ready".into())));
            assert!(failed.is_err());
            assert_eq!(row(&store.read()?, &a)?, Some(b"two".to_vec()), "{kind:?}");
            assert_eq!(row(&new, &a)?, Some(b"two".to_vec()), "{kind:?}");
        }
        Ok(())
    }

    /// Both backends: `commit_after` calls `ready` once, before the changes are visible, and
    /// commits only if it succeeds; a failed `ready` is returned and changes nothing, also
    /// after a reopen. An empty transaction calls it too.
    #[test]
    fn commit_after_commits_only_once_ready() -> Result<()> {
        for kind in [Backend::Redb, Backend::Fjall] {
            let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
            {
                let store = Store::create(dir.path(), kind)?;
                let mut txn = store.write()?;
                txn.insert(meta::LAYERS, &1u64, &10u64);
                let mut calls = 0;
                let failed = txn.commit_after(|| {
                    calls += 1;
                    Err(Error::Failed("not ready".into()))
                });
                assert!(matches!(failed, Err(Error::Failed(why)) if why == "not ready"));
                assert_eq!(calls, 1);
                assert_eq!(store.read()?.get(meta::LAYERS, &1)?, None, "{kind:?}");
                let mut txn = store.write()?;
                txn.insert(meta::LAYERS, &2u64, &20u64);
                txn.commit_after(|| {
                    calls += 1;
                    // Not yet committed when `ready` runs.
                    assert_eq!(store.read()?.get(meta::LAYERS, &2)?, None);
                    Ok(())
                })?;
                assert_eq!(calls, 2);
                assert_eq!(store.read()?.get(meta::LAYERS, &2)?, Some(20));
                store.write()?.commit_after(|| {
                    calls += 1;
                    Ok(())
                })?;
                assert_eq!(calls, 3);
            }
            let store = Store::open(dir.path())?;
            let r = store.read()?;
            let all: Vec<(u64, u64)> = r.iter(meta::LAYERS)?.collect::<Result<_>>()?;
            assert_eq!(all, vec![(2, 20)], "{kind:?}");
        }
        Ok(())
    }
}
