//! The two candidate stores behind one small interface shaped like the engine's metadata layer:
//! three tables (volume map, chunk table, dedup index), writes buffered in engine memory and
//! applied in one durable transaction per commit.

use std::path::Path;

/// Volume map key: (layer_id u64 BE, block u64 BE).
pub type MapKey = [u8; 16];
/// Dedup key: BLAKE3-256 of the block.
pub type Hash = [u8; 32];
/// Chunk record: segment id, offset, length, crc32c, refcount (packed to 32 bytes).
pub type ChunkRec = [u8; 32];

/// Writes accumulated in engine memory until the next commit (flush/FUA or ~64k dirty blocks).
#[derive(Default)]
pub struct Pending {
    pub map: Vec<(MapKey, u64)>,
    pub chunks: Vec<(u64, ChunkRec)>,
    pub dedup: Vec<(Hash, u64)>,
}

impl Pending {
    pub fn clear(&mut self) {
        self.map.clear();
        self.chunks.clear();
        self.dedup.clear();
    }
}

/// A read view used while a batch is being built (dedup lookups, read-modify-write of chunks).
pub trait View {
    fn dedup_get(&self, h: &Hash) -> Option<u64>;
    fn map_get(&self, k: &MapKey) -> Option<u64>;
    fn chunk_get(&self, id: u64) -> Option<ChunkRec>;
}

pub trait Kv: Send + Sync {
    /// A read view of the last committed state.
    fn view(&self) -> Box<dyn View + '_>;
    /// Applies `p` in one atomic transaction, durable (fsync) when this returns.
    fn commit(&self, p: &Pending);
    /// Point reads of map keys; returns hits. One read transaction/snapshot per call.
    fn map_get_many(&self, keys: &[MapKey]) -> usize;
    /// Point lookups in the dedup index; returns hits.
    fn dedup_get_many(&self, keys: &[Hash]) -> usize;
    /// Scans map entries in [lo, hi); returns the count.
    fn map_scan(&self, lo: MapKey, hi: MapKey) -> usize;
    /// Deletes map entries in [lo, hi) in one durable transaction; returns the count deleted.
    fn map_delete_range(&self, lo: MapKey, hi: MapKey) -> usize;
    /// Entry counts of (map, chunks, dedup), by full scan.
    fn counts(&self) -> (usize, usize, usize);
    /// What the engine does on a clean shutdown before dropping the store.
    fn clean_close(&self) {}
}

pub fn map_key(layer: u64, block: u64) -> MapKey {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&layer.to_be_bytes());
    k[8..].copy_from_slice(&block.to_be_bytes());
    k
}

fn u64_of(v: &[u8]) -> u64 {
    u64::from_be_bytes(v.try_into().expect("8-byte value"))
}

// ---------------------------------------------------------------- fjall

pub struct Fjall {
    db: fjall::Database,
    map: fjall::Keyspace,
    chunks: fjall::Keyspace,
    dedup: fjall::Keyspace,
}

impl Fjall {
    pub fn open(dir: &Path, cache_bytes: u64) -> Self {
        let db = fjall::Database::builder(dir)
            .cache_size(cache_bytes)
            .open()
            .expect("fjall open");
        let map = db
            .keyspace("map", fjall::KeyspaceCreateOptions::default)
            .expect("ks");
        let chunks = db
            .keyspace("chunks", fjall::KeyspaceCreateOptions::default)
            .expect("ks");
        let dedup = db
            .keyspace("dedup", fjall::KeyspaceCreateOptions::default)
            .expect("ks");
        Fjall {
            db,
            map,
            chunks,
            dedup,
        }
    }
}

struct FjallView<'a>(&'a Fjall);

impl View for FjallView<'_> {
    fn dedup_get(&self, h: &Hash) -> Option<u64> {
        self.0.dedup.get(h).expect("get").map(|v| u64_of(&v))
    }
    fn map_get(&self, k: &MapKey) -> Option<u64> {
        self.0.map.get(k).expect("get").map(|v| u64_of(&v))
    }
    fn chunk_get(&self, id: u64) -> Option<ChunkRec> {
        self.0
            .chunks
            .get(id.to_be_bytes())
            .expect("get")
            .map(|v| v.as_ref().try_into().expect("32"))
    }
}

impl Kv for Fjall {
    fn view(&self) -> Box<dyn View + '_> {
        Box::new(FjallView(self))
    }
    fn commit(&self, p: &Pending) {
        let mut b = self
            .db
            .batch()
            .durability(Some(fjall::PersistMode::SyncData));
        for (k, v) in &p.map {
            b.insert(&self.map, k.as_slice(), v.to_be_bytes().as_slice());
        }
        for (id, rec) in &p.chunks {
            b.insert(&self.chunks, id.to_be_bytes().as_slice(), rec.as_slice());
        }
        for (h, id) in &p.dedup {
            b.insert(&self.dedup, h.as_slice(), id.to_be_bytes().as_slice());
        }
        b.commit().expect("fjall commit");
    }
    fn map_get_many(&self, keys: &[MapKey]) -> usize {
        keys.iter()
            .filter(|k| self.map.get(k).expect("get").is_some())
            .count()
    }
    fn dedup_get_many(&self, keys: &[Hash]) -> usize {
        keys.iter()
            .filter(|k| self.dedup.get(k).expect("get").is_some())
            .count()
    }
    fn map_scan(&self, lo: MapKey, hi: MapKey) -> usize {
        let mut n = 0;
        let mut sum = 0u64;
        for g in self.map.range(lo..hi) {
            let (_k, v) = g.into_inner().expect("iter");
            sum = sum.wrapping_add(u64_of(&v));
            n += 1;
        }
        std::hint::black_box(sum);
        n
    }
    fn map_delete_range(&self, lo: MapKey, hi: MapKey) -> usize {
        // fjall 3 has no range tombstone in its public API: scan the keys, write point tombstones.
        let mut b = self
            .db
            .batch()
            .durability(Some(fjall::PersistMode::SyncData));
        let mut n = 0;
        for g in self.map.range(lo..hi) {
            let k = g.key().expect("iter");
            b.remove(&self.map, k);
            n += 1;
        }
        b.commit().expect("fjall commit");
        n
    }
    fn clean_close(&self) {
        // Flush memtables to tables so the next open has no journal to replay.
        for ks in [&self.map, &self.chunks, &self.dedup] {
            ks.rotate_memtable_and_wait().expect("flush");
        }
    }
    fn counts(&self) -> (usize, usize, usize) {
        (
            self.map.len().expect("len"),
            self.chunks.len().expect("len"),
            self.dedup.len().expect("len"),
        )
    }
}

// ---------------------------------------------------------------- redb

use redb::{ReadableDatabase, ReadableTableMetadata, TableDefinition};

const MAP: TableDefinition<MapKey, u64> = TableDefinition::new("map");
const CHUNKS: TableDefinition<u64, ChunkRec> = TableDefinition::new("chunks");
const DEDUP: TableDefinition<Hash, u64> = TableDefinition::new("dedup");

pub struct Redb {
    db: redb::Database,
    quick_repair: bool,
}

impl Redb {
    /// Opens (creating if needed) and returns the store and whether a repair ran.
    pub fn open(dir: &Path, cache_bytes: usize, quick_repair: bool) -> (Self, bool) {
        std::fs::create_dir_all(dir).expect("mkdir");
        let repaired = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let r2 = repaired.clone();
        let db = redb::Database::builder()
            .set_cache_size(cache_bytes)
            .set_repair_callback(move |_s| r2.store(true, std::sync::atomic::Ordering::Relaxed))
            .create(dir.join("meta.redb"))
            .expect("redb open");
        let s = Redb { db, quick_repair };
        // Create the tables.
        {
            let mut tx = s.db.begin_write().expect("tx");
            tx.set_quick_repair(quick_repair);
            tx.open_table(MAP).expect("t");
            tx.open_table(CHUNKS).expect("t");
            tx.open_table(DEDUP).expect("t");
            tx.commit().expect("commit");
        }
        (s, repaired.load(std::sync::atomic::Ordering::Relaxed))
    }
}

struct RedbView {
    map: redb::ReadOnlyTable<MapKey, u64>,
    chunks: redb::ReadOnlyTable<u64, ChunkRec>,
    dedup: redb::ReadOnlyTable<Hash, u64>,
}

impl View for RedbView {
    fn dedup_get(&self, h: &Hash) -> Option<u64> {
        self.dedup.get(h).expect("get").map(|g| g.value())
    }
    fn map_get(&self, k: &MapKey) -> Option<u64> {
        self.map.get(k).expect("get").map(|g| g.value())
    }
    fn chunk_get(&self, id: u64) -> Option<ChunkRec> {
        self.chunks.get(id).expect("get").map(|g| g.value())
    }
}

impl Kv for Redb {
    fn view(&self) -> Box<dyn View + '_> {
        let tx = self.db.begin_read().expect("read tx");
        Box::new(RedbView {
            map: tx.open_table(MAP).expect("t"),
            chunks: tx.open_table(CHUNKS).expect("t"),
            dedup: tx.open_table(DEDUP).expect("t"),
        })
    }
    fn commit(&self, p: &Pending) {
        let mut tx = self.db.begin_write().expect("tx");
        tx.set_quick_repair(self.quick_repair);
        {
            let mut t = tx.open_table(MAP).expect("t");
            for (k, v) in &p.map {
                t.insert(k, v).expect("insert");
            }
            let mut t = tx.open_table(CHUNKS).expect("t");
            for (id, rec) in &p.chunks {
                t.insert(id, rec).expect("insert");
            }
            let mut t = tx.open_table(DEDUP).expect("t");
            for (h, id) in &p.dedup {
                t.insert(h, id).expect("insert");
            }
        }
        tx.commit().expect("redb commit");
    }
    fn map_get_many(&self, keys: &[MapKey]) -> usize {
        let tx = self.db.begin_read().expect("read tx");
        let t = tx.open_table(MAP).expect("t");
        keys.iter()
            .filter(|k| t.get(*k).expect("get").is_some())
            .count()
    }
    fn dedup_get_many(&self, keys: &[Hash]) -> usize {
        let tx = self.db.begin_read().expect("read tx");
        let t = tx.open_table(DEDUP).expect("t");
        keys.iter()
            .filter(|k| t.get(*k).expect("get").is_some())
            .count()
    }
    fn map_scan(&self, lo: MapKey, hi: MapKey) -> usize {
        let tx = self.db.begin_read().expect("read tx");
        let t = tx.open_table(MAP).expect("t");
        let mut n = 0;
        let mut sum = 0u64;
        for e in t.range(lo..hi).expect("range") {
            let (_k, v) = e.expect("iter");
            sum = sum.wrapping_add(v.value());
            n += 1;
        }
        std::hint::black_box(sum);
        n
    }
    fn map_delete_range(&self, lo: MapKey, hi: MapKey) -> usize {
        let mut tx = self.db.begin_write().expect("tx");
        tx.set_quick_repair(self.quick_repair);
        let mut n = 0;
        {
            let mut t = tx.open_table(MAP).expect("t");
            t.retain_in(lo..hi, |_, _| {
                n += 1;
                false
            })
            .expect("retain_in");
        }
        tx.commit().expect("redb commit");
        n
    }
    fn counts(&self) -> (usize, usize, usize) {
        let tx = self.db.begin_read().expect("read tx");
        (
            tx.open_table(MAP).expect("t").len().expect("len") as usize,
            tx.open_table(CHUNKS).expect("t").len().expect("len") as usize,
            tx.open_table(DEDUP).expect("t").len().expect("len") as usize,
        )
    }
}
