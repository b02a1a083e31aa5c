//! Scrub: every live chunk read back and checked against its fingerprint, a few at a time,
//! while the pool serves, so that damage on the device is found before a reader meets it
//! (a reader of a damaged block gets an error, never wrong data, either way). The caller paces
//! the steps (the server's scrub thread, at a bounded rate) and keeps the cursor.

use crate::error::{Error, Result};
use crate::format::{VolumeRecord, BLOCK_BYTES};
use crate::meta;
use crate::pool::Pool;
use std::collections::{BTreeMap, BTreeSet};

/// What one scrub step did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScrubStep {
    /// Where the next step starts (a chunk id), or `None`: the pass is complete.
    pub next: Option<u64>,
    /// Chunks read and checked.
    pub checked: u64,
    /// Their stored bytes (what was read from the device).
    pub bytes: u64,
    /// Chunks that failed their check.
    pub damaged: Vec<DamagedChunk>,
}

/// A chunk that failed its check, and what reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DamagedChunk {
    /// Chunk id.
    pub chunk: u64,
    /// Why it failed (checksum, header or fingerprint mismatch).
    pub why: String,
    /// The blocks that read it: (volume, or `VOLUME@SNAPSHOT`, block number).
    pub places: Vec<(String, u64)>,
}

/// Most places listed per damaged chunk.
const PLACES_MAX: usize = 64;

impl Pool {
    /// Checks up to about `max_chunks` live chunks from chunk id `from` on (0: the start of a
    /// pass): each is read from its segment and checked against its checksum and fingerprint.
    /// Chunks freed or moved meanwhile are skipped or read where they are now. Takes no lock
    /// that writers wait for; a damaged chunk costs a scan of the map to name what reads it.
    pub fn scrub_step(&self, from: u64, max_chunks: usize) -> Result<ScrubStep> {
        let inner = &self.inner;
        let (records, fps) = {
            let txn = inner.db.read()?;
            let records = crate::chunk_table::from(&txn, from, max_chunks.max(1))?;
            let mut ids: Vec<u64> = records.iter().map(|&(id, _)| id).collect();
            let mut fps = std::collections::HashMap::with_capacity(ids.len());
            crate::chunk_fps::get_many(&txn, &mut ids, |id, fp| {
                fps.insert(id, fp);
            })?;
            (records, fps)
        };
        let mut step = ScrubStep {
            next: records.last().map(|&(id, _)| id + 1),
            ..ScrubStep::default()
        };
        let mut damaged: BTreeMap<u64, String> = BTreeMap::new();
        let mut block = vec![0u8; BLOCK_BYTES];
        for (id, rec) in &records {
            match inner.read_chunk(*id, &mut block) {
                Ok(true) => match fps.get(id) {
                    Some(fp) if blake3::hash(&block).as_bytes() == fp => {}
                    Some(_) => {
                        damaged.insert(*id, "content does not match its fingerprint".into());
                    }
                    None => {
                        damaged.insert(*id, "it has no fingerprint".into());
                    }
                },
                Ok(false) => continue,
                Err(Error::Corrupt(why)) => {
                    damaged.insert(*id, why);
                }
                Err(e) => return Err(e),
            }
            step.checked += 1;
            step.bytes += rec.physical_bytes();
        }
        if !damaged.is_empty() {
            let ids: BTreeSet<u64> = damaged.keys().copied().collect();
            let mut places = places_of(self, &ids)?;
            step.damaged = damaged
                .into_iter()
                .map(|(chunk, why)| DamagedChunk {
                    chunk,
                    why,
                    places: places.remove(&chunk).unwrap_or_default(),
                })
                .collect();
        }
        Ok(step)
    }
}

/// The blocks of every volume and snapshot that read each of `ids` (committed state), at most
/// [`PLACES_MAX`] per chunk.
fn places_of(pool: &Pool, ids: &BTreeSet<u64>) -> Result<BTreeMap<u64, Vec<(String, u64)>>> {
    let txn = pool.inner.db.read()?;
    let mut stacks: Vec<(String, VolumeRecord)> = Vec::new();
    for table in [meta::VOLUMES, meta::SNAPSHOTS] {
        for item in txn.iter(table)? {
            let (k, v) = item?;
            stacks.push((k, VolumeRecord::decode(&v)?));
        }
    }
    let mut entries = crate::stack::LoadedMap::new();
    crate::map_table::for_each(&txn, |layer, block, v| {
        entries.entry(layer).or_default().insert(block, v);
        Ok(())
    })?;
    let mut out: BTreeMap<u64, Vec<(String, u64)>> = BTreeMap::new();
    for (name, r) in &stacks {
        for (b, id) in crate::stack::resolve_loaded(&r.layers, &entries)? {
            if ids.contains(&id) {
                let list = out.entry(id).or_default();
                if list.len() < PLACES_MAX {
                    list.push((name.clone(), b));
                }
            }
        }
    }
    Ok(out)
}
