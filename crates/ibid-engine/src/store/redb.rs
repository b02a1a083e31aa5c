//! The redb backend: one file, `meta.redb`, with one typed redb table per engine table.
//!
//! The typed tables are those of the pools written before the [`super::MetaStore`] seam existed,
//! so such pools open unchanged: keys and values are converted between the seam's bytes
//! ([`super::Codec`]) and redb's types at this boundary.
//!
//! Durability: every batch is one redb write transaction with the default durability
//! (`Immediate`): its commit fsyncs before returning (redb's 1PC+C protocol), so a batch is
//! atomic and survives a crash once [`super::MetaStore::write`] returns.

use super::{Batch, KvIter, MetaStore, Snapshot, Table, TableOps, TABLES};
use crate::error::{Error, Result};
use ::redb::{
    Database, Key, ReadOnlyTable, ReadTransaction, ReadableDatabase, TableDefinition, Value,
};
use std::any::Any;
use std::cell::OnceCell;
use std::ops::Bound;
use std::path::{Path, PathBuf};

/// The store's file in the pool directory.
pub const FILE: &str = "meta.redb";

const POOL: TableDefinition<&str, &[u8]> = TableDefinition::new("pool");
const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");
const MAP: TableDefinition<[u8; 16], u64> = TableDefinition::new("map");
const CHUNKS: TableDefinition<u64, &[u8]> = TableDefinition::new("chunks");
const FPS: TableDefinition<[u8; 32], u64> = TableDefinition::new("fps");
const SEGMENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("segments");
const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
const LAYERS: TableDefinition<u64, u64> = TableDefinition::new("layers");
const ORPHANS: TableDefinition<u64, ()> = TableDefinition::new("orphans");

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
        }
    };
}

/// Conversion between a redb type and the seam's byte encoding ([`super::Codec`]).
trait Conv: Value + 'static {
    fn decode_seam(b: &[u8]) -> Result<Self::SelfType<'_>>;
    fn encode_seam(v: &Self::SelfType<'_>) -> Vec<u8>;
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
}

impl<const N: usize> Conv for [u8; N] {
    fn decode_seam(b: &[u8]) -> Result<[u8; N]> {
        b.try_into().map_err(|_| bad("fixed-size key", b))
    }
    fn encode_seam(v: &[u8; N]) -> Vec<u8> {
        v.to_vec()
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
    db: Database,
    path: PathBuf,
}

impl RedbStore {
    /// Creates the database in `dir` with every table, empty.
    pub fn create(dir: &Path) -> Result<RedbStore> {
        let path = dir.join(FILE);
        let db = Database::create(&path)?;
        let txn = db.begin_write()?;
        for t in Table::ALL {
            dispatch!(t, create_table, &txn)?;
        }
        txn.commit()?;
        Ok(RedbStore { db, path })
    }

    /// Opens the database in `dir` (redb repairs it first if it was not closed cleanly).
    pub fn open(dir: &Path) -> Result<RedbStore> {
        let path = dir.join(FILE);
        let db = Database::open(&path)?;
        Ok(RedbStore { db, path })
    }
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
        Ok(Box::new(RedbSnapshot {
            tables: Default::default(),
            txn: self.db.begin_read()?,
        }))
    }

    fn write(&self, batch: &Batch) -> Result<()> {
        let txn = self.db.begin_write()?;
        for t in Table::ALL {
            let ops = &batch.tables[t.index()];
            if !ops.is_empty() {
                dispatch!(t, apply_ops, &txn, ops)?;
            }
        }
        txn.commit()?;
        Ok(())
    }

    fn disk_bytes(&self) -> u64 {
        std::fs::metadata(&self.path).map_or(0, |m| m.len())
    }
}

fn apply_ops<K: Key + Conv, V: Conv>(
    def: TableDefinition<K, V>,
    txn: &::redb::WriteTransaction,
    ops: &TableOps,
) -> Result<()> {
    let mut table = txn.open_table(def)?;
    for (k, v) in ops {
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

struct RedbSnapshot {
    /// Tables opened so far, by [`Table::index`] (each a `ReadOnlyTable<K, V>`): opening a
    /// table looks it up in redb's table tree and checks its types, which cost more than the
    /// point lookup itself when done per get. Declared first, so dropped before `txn`.
    tables: [OnceCell<Box<dyn Any>>; TABLES],
    txn: ReadTransaction,
}

impl RedbSnapshot {
    /// Table `table` (definition `def`), opened on first use.
    fn table<K: Key + Conv, V: Conv>(
        &self,
        table: Table,
        def: TableDefinition<K, V>,
    ) -> Result<&ReadOnlyTable<K, V>> {
        let cell = &self.tables[table.index()];
        if cell.get().is_none() {
            let opened: Box<dyn Any> = Box::new(self.txn.open_table(def)?);
            // Not `Sync`, so no other thread can have filled the cell meanwhile.
            let _ = cell.set(opened);
        }
        cell.get()
            .and_then(|t| t.downcast_ref::<ReadOnlyTable<K, V>>())
            .ok_or_else(|| Error::Corrupt(format!("redb table {} has another type", table.name())))
    }
}

impl Snapshot for RedbSnapshot {
    fn get(&self, table: Table, key: &[u8]) -> Result<Option<Vec<u8>>> {
        dispatch!(table, get_in, self, table, key)
    }

    fn range(&self, table: Table, lo: Bound<&[u8]>, hi: Bound<&[u8]>) -> Result<KvIter<'_>> {
        dispatch!(table, range_in, &self.txn, lo, hi)
    }
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

fn range_in<K: Key + Conv, V: Conv>(
    def: TableDefinition<K, V>,
    txn: &ReadTransaction,
    lo: Bound<&[u8]>,
    hi: Bound<&[u8]>,
) -> Result<KvIter<'static>> {
    let table = txn.open_table(def)?;
    let range = table.range::<K::SelfType<'_>>((bound::<K>(lo)?, bound::<K>(hi)?))?;
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
