//! A full consistency check of a pool (an fsck): every reference count, index entry, segment
//! usage figure and counter recomputed from scratch and compared, and every live chunk read
//! back and checked against its fingerprint. Tests run it after every step that matters.
//! Damaged data does not stop the read-back: every damaged chunk is named, with the blocks of
//! the volumes and snapshots that read it, in one `Corrupt` error; a structural problem (a
//! count that does not add up) ends the check at once.

use crate::dedup_index::Runs;
use crate::error::{Error, Result};
use crate::format::{self, SegmentUsage, VolumeRecord, BLOCK_BYTES};
use crate::inner::Inner;
use crate::meta::{self, PoolRecord};
use crate::store::Reader;
use std::collections::{BTreeMap, HashMap};

/// What the check found (all figures recomputed from the tables).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Volumes.
    pub volumes: u64,
    /// Map entries across all layers.
    pub map_entries: u64,
    /// Live chunks.
    pub chunks: u64,
    /// Physical bytes of live chunks.
    pub physical_bytes: u64,
    /// Chunks kept at zero references (normally none after a commit).
    pub orphans: u64,
}

fn fail(msg: String) -> Error {
    Error::Corrupt(format!("verify: {msg}"))
}

/// Checks the whole pool; call with no writes in flight for exact results.
pub(crate) fn verify(inner: &Inner) -> Result<VerifyReport> {
    let cs = inner.commit.lock();
    let txn = inner.db.read()?;
    let pool = PoolRecord::decode(
        &txn.get(meta::POOL, meta::POOL_KEY)?
            .ok_or_else(|| fail("no pool record".into()))?,
    )?;
    let mut report = VerifyReport::default();
    let mut stacks: Vec<(String, VolumeRecord)> = Vec::new();
    for table in [meta::VOLUMES, meta::SNAPSHOTS] {
        for item in txn.iter(table)? {
            let (k, v) = item?;
            stacks.push((k, VolumeRecord::decode(&v)?));
        }
    }
    report.volumes = stacks.len() as u64;
    let (thick_unwritten, thick_blocks) =
        crate::provision::thick_totals(stacks.iter().map(|(_, r)| r));
    let counted = inner.space.thick_counts().0;
    if counted != thick_unwritten as i64 {
        return Err(fail(format!(
            "thick volumes hold {thick_unwritten} unwritten blocks, the reservation counts {counted}"
        )));
    }
    let counted = inner.space.thick_counts().1;
    if counted != thick_blocks as i64 {
        return Err(fail(format!(
            "thick volumes have {thick_blocks} blocks, the overwrite headroom counts {counted}"
        )));
    }
    let mut expected_layer_refs: HashMap<u64, u64> = HashMap::new();
    for (_, r) in &stacks {
        for l in format::referenced_layers(&r.layers) {
            *expected_layer_refs.entry(l).or_default() += 1;
        }
    }
    let mut layer_refs: HashMap<u64, u64> = HashMap::new();
    for item in txn.iter(meta::LAYERS)? {
        let (k, v) = item?;
        layer_refs.insert(k, v);
    }
    if layer_refs != expected_layer_refs {
        return Err(fail(format!(
            "layer refcounts {layer_refs:?}, stacks say {expected_layer_refs:?}"
        )));
    }
    // Layers being built are in no stack yet; their entries hold references like any other
    // (`copy/layer_build.rs`).
    let building = crate::copy::layer_build::listed(&txn)?;
    if let Some(l) = building.iter().find(|l| layer_refs.contains_key(l)) {
        return Err(fail(format!("layer {l} is being built and in a stack")));
    }
    let mut refs: HashMap<u64, u64> = HashMap::new();
    let mut entries = crate::stack::LoadedMap::new();
    if txn.iter(meta::MAP)?.next().is_some() {
        return Err(fail("map rows of format 10 left beside the pages".into()));
    }
    crate::map_table::for_each(&txn, |layer, block, v| {
        if !layer_refs.contains_key(&layer) && !building.contains(&layer) {
            return Err(fail(format!("map entry for unreferenced layer {layer}")));
        }
        if inner.layer_filters.excludes(layer, block) {
            return Err(fail(format!(
                "layer {layer} has an entry for block {block} its filter lacks"
            )));
        }
        if v != format::ZERO_TOMBSTONE {
            *refs.entry(v).or_default() += 1;
        }
        entries.entry(layer).or_default().insert(block, v);
        report.map_entries += 1;
        Ok(())
    })?;
    for (name, r) in &stacks {
        let mut visible = crate::stack::resolve_loaded(&r.layers, &entries)?;
        visible.retain(|_, id| *id != format::ZERO_TOMBSTONE);
        if let Some((&b, _)) = visible.iter().next_back() {
            if (b + 1) * BLOCK_BYTES as u64 > r.size.next_multiple_of(BLOCK_BYTES as u64) {
                return Err(fail(format!("{name}: block {b} beyond its size")));
            }
        }
        if visible.len() as u64 != r.mapped_blocks {
            return Err(fail(format!(
                "{name}: record says {} mapped blocks, map shows {}",
                r.mapped_blocks,
                visible.len()
            )));
        }
    }
    // The map changes pending in memory (read above over the written-back pages) are the
    // ones the log rows hold.
    inner.db.check_pending().map_err(|e| fail(e.to_string()))?;
    let runs = Runs::load(&txn)?;
    let held = inner.dedup.runs();
    if runs.summary() != held.summary() || runs.marks() != held.marks() {
        return Err(fail(format!(
            "dedup index runs stored {:?} (merge marks {:?}), held in memory {:?} ({:?})",
            runs.summary(),
            runs.marks(),
            held.summary(),
            held.marks()
        )));
    }
    if let Some(k) = runs.dead().find(|&k| !runs.contains(k)) {
        return Err(fail(format!("dead index key {k:#x} is in no run")));
    }
    for k in runs.keys() {
        if txn.get(meta::FPS, &k)?.is_some() {
            return Err(fail(format!("index key {k:#x} is in a run and the B-tree")));
        }
    }
    // A gone key is in a run (dead there) or still in the B-tree, and its chunk is no more.
    let mut gone_in_tree = 0usize;
    let mut gone_seen = std::collections::HashSet::new();
    for (no, k) in Runs::load_gone(&txn)? {
        if !gone_seen.insert(k) {
            return Err(fail(format!(
                "gone index key {k:#x} (row {no}) listed twice"
            )));
        }
        if !runs.contains(k) {
            if txn.get(meta::FPS, &k)?.is_none() {
                return Err(fail(format!(
                    "gone index key {k:#x} (row {no}) is in no run and not in the B-tree"
                )));
            }
            gone_in_tree += 1;
        }
        if crate::chunk_table::get(&txn, meta::fps_key_chunk(k))?.is_some() {
            return Err(fail(format!(
                "gone index key {k:#x} (row {no}) names a stored chunk"
            )));
        }
    }
    let mut usage: HashMap<u64, u64> = HashMap::new();
    let mut damaged: BTreeMap<u64, String> = BTreeMap::new();
    let mut block = vec![0u8; BLOCK_BYTES];
    if let Some(item) = txn.iter(meta::CHUNKS_BY_ID)?.next() {
        return Err(fail(format!(
            "chunk {:#x} is still in the table of format version 5",
            item?.0
        )));
    }
    // A chunk's count is its record's plus the deltas logged for it (see ref_log.rs).
    let mut logged = crate::ref_log::pending(&txn)?;
    if logged.len() as u64 > cs.ref_log.entries() {
        return Err(fail(format!(
            "the reference log holds deltas for {} chunks, the log in memory counts {} deltas",
            logged.len(),
            cs.ref_log.entries()
        )));
    }
    // The fingerprints, matched to the records in id order: every chunk has one; the rest are
    // stale (their chunk died), as many as the committer counts.
    let mut fps = Vec::new();
    crate::chunk_fps::for_each(&txn, |id, fp| {
        fps.push((id, fp));
        Ok(())
    })?;
    let mut fps = fps.into_iter().peekable();
    let mut stale = 0u64;
    crate::chunk_table::for_each(&txn, |id, rec| {
        stale += std::iter::from_fn(|| fps.next_if(|&(i, _)| i < id)).count() as u64;
        let Some((_, fingerprint)) = fps.next_if(|&(i, _)| i == id) else {
            return Err(fail(format!("chunk {id:#x} has no fingerprint")));
        };
        let counted = refs.remove(&id).unwrap_or(0);
        let delta = logged.remove(&id).unwrap_or(0);
        if rec.refs as i64 + delta != counted as i64 {
            return Err(fail(format!(
                "chunk {id:#x}: refcount {} {delta:+} logged but {counted} map entries",
                rec.refs
            )));
        }
        if counted == 0 {
            // Kept for a newer write, or left with no reference by deltas not folded yet.
            if delta == 0 && txn.get(meta::ORPHANS, &id)?.is_none() {
                return Err(fail(format!(
                    "chunk {id:#x} has no references and is not an orphan"
                )));
            }
            report.orphans += 1;
        }
        let key = meta::fps_key(&fingerprint, id);
        if !runs.holds(key) && txn.get(meta::FPS, &key)?.is_none() {
            return Err(fail(format!("chunk {id:#x} is not in the dedup index")));
        }
        // Damaged data is noted and the check goes on, to name every damaged chunk and what
        // holds it; I/O errors end the check.
        match inner.read_chunk(id, &mut block) {
            Ok(true) if blake3::hash(&block).as_bytes() != &fingerprint => {
                damaged.insert(id, "content does not match its fingerprint".into());
            }
            Ok(true) => {}
            Ok(false) => {
                damaged.insert(id, "its record cannot be found".into());
            }
            Err(Error::Corrupt(why)) => {
                damaged.insert(id, why);
            }
            Err(e) => return Err(e),
        }
        *usage.entry(rec.segment).or_default() += rec.physical_bytes();
        report.chunks += 1;
        report.physical_bytes += rec.physical_bytes();
        Ok(())
    })?;
    stale += fps.count() as u64;
    if stale != cs.fps_stale.total() {
        return Err(fail(format!(
            "{stale} stored fingerprints have no chunk, the committer counts {}",
            cs.fps_stale.total()
        )));
    }
    if !damaged.is_empty() {
        return Err(fail(damage_report(&damaged, &stacks, &entries)?));
    }
    if let Some((id, d)) = logged.into_iter().next() {
        return Err(fail(format!(
            "the reference log holds {d:+} for chunk {id:#x}, which has no record"
        )));
    }
    if let Some((id, n)) = refs.into_iter().next() {
        return Err(fail(format!(
            "{n} map entries reference missing chunk {id:#x}"
        )));
    }
    // The B-tree's keys whose chunks died wait there for the next merge (see dedup_index.rs).
    let index_entries =
        txn.iter(meta::FPS)?.count() as u64 - gone_in_tree as u64 + runs.keys().count() as u64;
    if index_entries != report.chunks {
        return Err(fail(format!(
            "index has {index_entries} entries for {} chunks",
            report.chunks
        )));
    }
    for item in txn.iter(meta::SEGMENTS)? {
        let (k, v) = item?;
        let u = SegmentUsage::decode(&v)?;
        let live = usage.remove(&k).unwrap_or(0);
        if u.live_bytes != live {
            return Err(fail(format!(
                "segment {k:016x}: usage says {} live bytes, chunks hold {live}",
                u.live_bytes
            )));
        }
    }
    if let Some((seg, _)) = usage.into_iter().next() {
        return Err(fail(format!(
            "segment {seg:016x} holds chunks but has no usage record"
        )));
    }
    if pool.live_chunks != report.chunks || pool.live_bytes != report.physical_bytes {
        return Err(fail(format!(
            "pool record says {} chunks / {} bytes, tables hold {} / {}",
            pool.live_chunks, pool.live_bytes, report.chunks, report.physical_bytes
        )));
    }
    Ok(report)
}

/// Most damaged chunks, and places per chunk, a damage report names.
const DAMAGE_LISTED_MAX: usize = 8;

/// Names each damaged chunk, why, and the blocks of the volumes and snapshots (`VOLUME@SNAPSHOT`)
/// that read it: "2 damaged chunks: chunk 0x5 (why) is block 3 of \"vm1\", block 3 of
/// \"vm1@s\"; ...". Only called when there is damage: it resolves every stack again.
fn damage_report(
    damaged: &BTreeMap<u64, String>,
    stacks: &[(String, VolumeRecord)],
    entries: &crate::stack::LoadedMap,
) -> Result<String> {
    let mut places: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    let mut counted: BTreeMap<u64, usize> = BTreeMap::new();
    for (name, r) in stacks {
        let visible = crate::stack::resolve_loaded(&r.layers, entries)?;
        for (b, id) in visible {
            if damaged.contains_key(&id) {
                *counted.entry(id).or_default() += 1;
                let list = places.entry(id).or_default();
                if list.len() < DAMAGE_LISTED_MAX {
                    list.push(format!("block {b} of {name:?}"));
                }
            }
        }
    }
    let mut parts = Vec::new();
    for (id, why) in damaged.iter().take(DAMAGE_LISTED_MAX) {
        let held = match places.get(id) {
            Some(list) => {
                let more = counted[id] - list.len();
                let mut text = list.join(", ");
                if more > 0 {
                    text.push_str(&format!(" and {more} more"));
                }
                format!("is {text}")
            }
            None => "is in no volume or snapshot".to_string(),
        };
        parts.push(format!("chunk {id:#x} ({why}) {held}"));
    }
    if damaged.len() > DAMAGE_LISTED_MAX {
        parts.push(format!(
            "and {} more chunks",
            damaged.len() - DAMAGE_LISTED_MAX
        ));
    }
    Ok(format!(
        "{} damaged chunk{}: {}",
        damaged.len(),
        if damaged.len() == 1 { "" } else { "s" },
        parts.join("; ")
    ))
}
