//! The fjall backend: an LSM tree in the directory `meta.fjall/`, one keyspace per engine
//! table, keys and values stored exactly as the seam encodes them ([`super::Codec`]).
//!
//! Durability: a batch is one fjall `WriteBatch` across the keyspaces, committed with
//! `PersistMode::SyncData`: fjall appends it to its journal as one checksummed entry and
//! fdatasyncs before returning. At open, fjall replays the journal and drops a torn tail, so a
//! batch is all there or absent. Memtable flushes and compactions run on fjall's own threads
//! and never make a batch visible that the journal does not hold.
//!
//! Deletes are point tombstones: fjall 3 has no range tombstone, so a range delete is a scan
//! plus one tombstone per key (the seam already expresses it that way).

use super::{Batch, Codec, KvIter, MetaStore, Snapshot, Table, TABLES};
use crate::error::{Error, Result};
use ::fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode, Readable};
use std::ops::Bound;
use std::path::Path;

/// The store's directory in the pool directory.
pub const DIR: &str = "meta.fjall";

/// Block cache, shared by the keyspaces: the same bound redb uses by default.
const CACHE_BYTES: u64 = 1 << 30;
/// Journal kept before memtables are flushed: bounds what an open after a crash replays
/// (fjall's minimum; its default is 512 MiB).
const JOURNAL_BYTES_MAX: u64 = 64 << 20;

impl From<::fjall::Error> for Error {
    fn from(e: ::fjall::Error) -> Self {
        Error::Metadata(e.to_string())
    }
}

/// Metadata in a fjall database.
pub struct FjallStore {
    db: Database,
    /// Keyspaces, indexed by [`Table::index`].
    tables: Vec<Keyspace>,
}

impl FjallStore {
    /// Creates the database in `dir` with every keyspace, empty.
    pub fn create(dir: &Path) -> Result<FjallStore> {
        let path = dir.join(DIR);
        if path.exists() {
            return Err(Error::AlreadyExists(path.display().to_string()));
        }
        let store = Self::open_path(&path)?;
        store.db.persist(PersistMode::SyncAll)?;
        Ok(store)
    }

    /// Opens the database in `dir` (fjall replays its journal first), and rewrites a dedup
    /// index of an older format (fingerprint → chunk id) with the current keys.
    pub fn open(dir: &Path) -> Result<FjallStore> {
        let store = Self::open_path(&dir.join(DIR))?;
        store.migrate_index()?;
        Ok(store)
    }

    /// Rewrites every `fps` entry keyed by a whole fingerprint (format versions 1 and 2: a
    /// 32-byte key, the chunk id as value) as a prefix key ([`crate::dedup_key::fps_key`]): one
    /// durable batch, so a crash leaves either form whole.
    fn migrate_index(&self) -> Result<()> {
        let ks = self.keyspace(Table::Fps);
        let mut b = self.db.batch().durability(Some(PersistMode::SyncData));
        let mut moved = 0u64;
        for g in self.db.snapshot().iter(ks) {
            let (k, v) = g.into_inner()?;
            let Ok(fp) = <[u8; 32]>::try_from(&*k) else {
                continue;
            };
            let id = <u64 as Codec>::decode(&v)?;
            b.remove(ks, &*k);
            b.insert(
                ks,
                Codec::encode(&crate::dedup_key::fps_key(&fp, id)),
                Codec::encode(&()),
            );
            moved += 1;
        }
        if moved > 0 {
            b.commit()?;
            tracing::info!("metadata: rewrote {moved} dedup index entries with prefix keys");
        }
        Ok(())
    }

    fn open_path(path: &Path) -> Result<FjallStore> {
        let db = Database::builder(path)
            .cache_size(CACHE_BYTES)
            .max_journaling_size(JOURNAL_BYTES_MAX)
            .open()?;
        let tables = Table::ALL
            .iter()
            .map(|t| db.keyspace(t.name(), KeyspaceCreateOptions::default))
            .collect::<Result<Vec<_>, _>>()?;
        debug_assert_eq!(tables.len(), TABLES);
        Ok(FjallStore { db, tables })
    }

    fn keyspace(&self, table: Table) -> &Keyspace {
        &self.tables[table.index()]
    }
}

impl Drop for FjallStore {
    /// A clean close flushes the memtables to tables, so the next open has no journal to
    /// replay. A crash skips this; the journal then holds every committed batch.
    fn drop(&mut self) {
        for ks in &self.tables {
            if let Err(e) = ks.rotate_memtable_and_wait() {
                tracing::warn!("flush metadata keyspace at close: {e}");
            }
        }
    }
}

impl MetaStore for FjallStore {
    fn snapshot(&self) -> Result<Box<dyn Snapshot + '_>> {
        Ok(Box::new(FjallSnapshot {
            snap: self.db.snapshot(),
            store: self,
        }))
    }

    fn write(&self, batch: &Batch, ready: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let mut b = self.db.batch().durability(Some(PersistMode::SyncData));
        for t in Table::ALL {
            let ks = self.keyspace(t);
            for (k, v) in batch.tables[t.index()].sorted() {
                match v {
                    Some(v) => b.insert(ks, k, v),
                    None => b.remove(ks, k),
                }
            }
        }
        // Dropped uncommitted on an error: nothing is written.
        ready()?;
        b.commit()?;
        Ok(())
    }

    fn disk_bytes(&self) -> u64 {
        self.db.disk_space().unwrap_or(0)
    }
}

struct FjallSnapshot<'a> {
    snap: ::fjall::Snapshot,
    store: &'a FjallStore,
}

impl Snapshot for FjallSnapshot<'_> {
    fn get(&self, table: Table, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self
            .snap
            .get(self.store.keyspace(table), key)?
            .map(|v| v.to_vec()))
    }

    fn range(&self, table: Table, lo: Bound<&[u8]>, hi: Bound<&[u8]>) -> Result<KvIter<'_>> {
        let iter = self
            .snap
            .range::<&[u8], _>(self.store.keyspace(table), (lo, hi));
        Ok(Box::new(iter.map(|g| {
            let (k, v) = g.into_inner()?;
            Ok((k.to_vec(), v.to_vec()))
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta;
    use crate::store::Store;

    /// A dedup index of format version 2 (32-byte fingerprint → chunk id) opens rewritten
    /// with prefix keys; entries already in the current form are left alone.
    #[test]
    fn whole_fingerprint_index_keys_are_rewritten_at_open() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let (old, current) = (([7u8; 32], 3u64), ([8u8; 32], 4u64));
        {
            let store = FjallStore::create(dir.path())?;
            let ks = store.keyspace(Table::Fps);
            let mut b = store.db.batch().durability(Some(PersistMode::SyncData));
            b.insert(ks, old.0.as_slice(), Codec::encode(&old.1));
            let key = crate::dedup_key::fps_key(&current.0, current.1);
            b.insert(ks, Codec::encode(&key), Codec::encode(&()));
            b.commit()?;
        }
        for _ in 0..2 {
            let store = Store::open(dir.path())?;
            let keys: Vec<u128> = store
                .read()?
                .iter(meta::FPS)?
                .map(|e| e.map(|(k, ())| k))
                .collect::<Result<_>>()?;
            assert_eq!(
                keys,
                vec![
                    crate::dedup_key::fps_key(&old.0, old.1),
                    crate::dedup_key::fps_key(&current.0, current.1)
                ]
            );
        }
        Ok(())
    }
}
