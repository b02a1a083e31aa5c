//! The read path: resolving blocks through a volume's stack of frames (uncommitted changes
//! over the committed map), locating chunks, and reading and checking their records,
//! grouped by segment when they lie close together.

use super::*;

impl Inner {
    /// Reads `buf.len()` bytes at `offset` (range already checked). The records of the range's
    /// blocks that lie close together in a segment (data written sequentially, spread over
    /// the segment writers) are read with one read per group; a lone record, or anything
    /// unusual (a chunk gone or moved meanwhile), goes by the block-by-block path with its
    /// retries.
    pub(crate) fn read_range(&self, v: &VolumeState, offset: u64, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let end = offset + buf.len() as u64;
        let (b0, b1) = (offset / BLOCK, end.div_ceil(BLOCK));
        let entries = self.lookup_range(v, b0, b1)?;
        for b in (b0..b1).filter(|b| !entries.contains_key(b)) {
            copy_part(buf, offset, b, None);
        }
        let locations = self.chunk_locations(entries.values().copied())?;
        let mut block = vec![0u8; BLOCK_BYTES];
        let mut lone = Vec::new();
        for group in read_groups(&entries, &locations, &mut lone) {
            let (first, last) = (group[0].2, group[group.len() - 1].2);
            let len = (last.offset as u64 + last.physical_bytes() - first.offset as u64) as usize;
            let Some(bytes) = self.segments.read_span(first.segment, first.offset, len)? else {
                lone.extend(group.iter().map(|&(b, id, _)| (b, id)));
                continue;
            };
            for &(b, id, rec) in &group {
                let at = (rec.offset - first.offset) as usize;
                decode_chunk(
                    id,
                    &rec,
                    &bytes[at..at + rec.physical_bytes() as usize],
                    &mut block,
                )?;
                copy_part(buf, offset, b, Some(&block));
            }
        }
        for (b, chunk) in lone {
            // Located already: one read; the block-by-block path (which looks it up again)
            // only if the chunk was not found or its segment is gone.
            let read = match locations.get(&chunk) {
                Some(rec) => self.read_located(chunk, rec, &mut block)?,
                None => false,
            };
            if !read {
                self.read_block(v, b, chunk, &mut block)?;
            }
            copy_part(buf, offset, b, Some(&block));
        }
        Ok(())
    }

    /// Where each of `ids` is (those found: uncommitted records first, then one read of the
    /// store).
    pub(super) fn chunk_locations(
        &self,
        ids: impl Iterator<Item = u64>,
    ) -> Result<HashMap<u64, format::ChunkRecord>> {
        let mut out = HashMap::new();
        let mut stored = Vec::new();
        for id in ids {
            match self.uncommitted_location(id) {
                Some(r) => {
                    out.insert(id, r);
                }
                None => stored.push(id),
            }
        }
        if !stored.is_empty() {
            let txn = self.db.read()?;
            for id in stored {
                if let Some(rec) = crate::chunk_table::get(&txn, id)? {
                    out.insert(id, rec);
                }
            }
        }
        Ok(out)
    }
}

impl Inner {
    /// The data-mapped blocks in `[b0, b1)`: uncommitted changes over the committed map.
    pub(crate) fn lookup_range(
        &self,
        v: &VolumeState,
        b0: u64,
        b1: u64,
    ) -> Result<BTreeMap<u64, u64>> {
        // The stack can change under a reader (a range copy's frames made permanent drop
        // layers); the map's generation moves when it does, and the walk is done again.
        let out = loop {
            let (generation, stack, committing, dirty) = {
                let map = v.map.lock();
                if map.deleted {
                    return Err(Error::NotFound(v.name.clone()));
                }
                // Cheap to hold: the committing overlay is shared, the dirty one is copied
                // only over the range (and only when it changed anything there).
                let dirty = map.dirty.window(b0, b1);
                (
                    map.generation,
                    map.stack.clone(),
                    map.committing.clone(),
                    dirty,
                )
            };
            // A zeroed range hiding the whole window: nothing below it to read.
            let hidden = dirty.covers_all(b0, b1) || committing.covers_all(b0, b1);
            let mut out = if hidden {
                BTreeMap::new()
            } else {
                self.stored_stack(&stack, b0, b1)?
            };
            if v.map.lock().generation == generation {
                out.retain(|_, id| *id != format::ZERO_TOMBSTONE);
                committing.apply_to(b0, b1, &mut out);
                dirty.apply_to(b0, b1, &mut out);
                break out;
            }
        };
        Ok(out)
    }

    /// Committed entries visible through `stack` (top first wins) in `[b0, b1)`, tombstones
    /// included (as [`format::ZERO_TOMBSTONE`]). A block absent from the result reads as zeros.
    pub(crate) fn stored_stack(
        &self,
        stack: &[Frame],
        b0: u64,
        b1: u64,
    ) -> Result<BTreeMap<u64, u64>> {
        if stack.is_empty() {
            return Ok(BTreeMap::new());
        }
        // One read transaction for the whole walk.
        let txn = self.db.read()?;
        Ok(resolve_stored(&txn, &self.layer_filters, stack, b0, b1, false)?.entries)
    }

    /// Reads block `b` (mapped to `chunk` when looked up) into `out`, retrying if the chunk was
    /// concurrently overwritten and freed, or moved by the cleaner.
    pub(crate) fn read_block(
        &self,
        v: &VolumeState,
        b: u64,
        mut chunk: u64,
        out: &mut [u8],
    ) -> Result<()> {
        for _ in 0..READ_RETRIES_MAX {
            match self.read_chunk(chunk, out)? {
                true => return Ok(()),
                false => match self.lookup_range(v, b, b + 1)?.get(&b) {
                    Some(&c) => chunk = c,
                    None => {
                        out.fill(0);
                        return Ok(());
                    }
                },
            }
        }
        Err(Error::Corrupt(format!(
            "block {b} of {}: chunk {chunk:#x} keeps vanishing",
            v.name
        )))
    }

    /// Where a chunk is: uncommitted records first, then the store. `None` if it is gone.
    pub(super) fn chunk_location(&self, id: u64) -> Result<Option<format::ChunkRecord>> {
        if let Some(r) = self.uncommitted_location(id) {
            return Ok(Some(r));
        }
        crate::chunk_table::get(&self.db.read()?, id)
    }

    /// Where a chunk created since the last commit is (`None` for committed chunks).
    pub(super) fn uncommitted_location(&self, id: u64) -> Option<format::ChunkRecord> {
        let s = self.shards[shard_of_chunk(id)].lock();
        s.dirty
            .new_chunks
            .get(&id)
            .or_else(|| s.committing.new_chunks.get(&id))
            .copied()
    }

    /// Reads and verifies chunk `id` into `out` (4 KiB). `Ok(false)` if the chunk is gone.
    pub(crate) fn read_chunk(&self, id: u64, out: &mut [u8]) -> Result<bool> {
        match self.chunk_location(id)? {
            Some(rec) => self.read_located(id, &rec, out),
            None => Ok(false),
        }
    }

    /// Reads and verifies chunk `id`, whose record is at `rec`, into `out`. `Ok(false)` if its
    /// segment is gone (cleaned: the caller looks the chunk up again).
    pub(super) fn read_located(
        &self,
        id: u64,
        rec: &format::ChunkRecord,
        out: &mut [u8],
    ) -> Result<bool> {
        let Some(raw) = self
            .segments
            .read_record(rec.segment, rec.offset, rec.stored_len)?
        else {
            return Ok(false);
        };
        decode_chunk(id, rec, &raw, out)?;
        Ok(true)
    }
}

/// Resolves `[b0, b1)` through `stack` from the committed map in `txn`, skipping the layers
/// whose filters rule the range out.
pub(crate) fn resolve_stored(
    txn: &ReadTxn,
    filters: &LayerFilters,
    stack: &[Frame],
    b0: u64,
    b1: u64,
    track_frames: bool,
) -> Result<Resolved> {
    crate::stack::resolve(stack, b0, b1, track_frames, |layer, s0, s1, found| {
        scan_layer(txn, filters, layer, s0, s1, found)
    })
}

/// Calls `found(block, value)` for `layer`'s committed entries in `[b0, b1)`; reads nothing
/// when the layer's filter rules the range out.
pub(crate) fn scan_layer(
    txn: &ReadTxn,
    filters: &LayerFilters,
    layer: u64,
    b0: u64,
    b1: u64,
    found: &mut Found<'_>,
) -> Result<()> {
    if !filters.may_hold(layer, b0, b1) {
        return Ok(());
    }
    if b1 == b0 + 1 {
        if let Some(v) = txn.get(meta::MAP, &format::map_key(layer, b0))? {
            found(b0, v);
        }
        return Ok(());
    }
    for item in txn.range(
        meta::MAP,
        format::map_key(layer, b0)..format::map_key(layer, b1),
    )? {
        let (k, v) = item?;
        found(format::decode_map_key(&k).1, v);
    }
    Ok(())
}

/// Checks a chunk's record `raw` (header and payload, as found at `rec`) and decodes its
/// 4 KiB block into `out`.
pub(super) fn decode_chunk(
    id: u64,
    rec: &format::ChunkRecord,
    raw: &[u8],
    out: &mut [u8],
) -> Result<()> {
    let h = format::decode_record_header(raw).map_err(|e| {
        Error::Corrupt(format!(
            "chunk {id:#x} in segment {:016x}: {e}",
            rec.segment
        ))
    })?;
    if h.chunk_id != id
        || h.stored_len != rec.stored_len
        || h.crc != rec.crc
        || !format::record_crc_ok(raw, rec.crc)
    {
        return Err(Error::Corrupt(format!(
            "chunk {id:#x} in segment {:016x} at offset {}: checksum or header mismatch",
            rec.segment, rec.offset
        )));
    }
    let payload = &raw[RECORD_HEADER_BYTES..];
    if rec.flags & RECORD_FLAG_LZ4 != 0 {
        match lz4_flex::block::decompress_into(payload, out) {
            Ok(n) if n == BLOCK_BYTES => Ok(()),
            _ => Err(Error::Corrupt(format!(
                "chunk {id:#x}: bad compressed payload"
            ))),
        }
    } else if payload.len() == BLOCK_BYTES {
        out.copy_from_slice(payload);
        Ok(())
    } else {
        Err(Error::Corrupt(format!(
            "chunk {id:#x}: payload of {} bytes",
            payload.len()
        )))
    }
}

/// Most bytes one grouped read covers.
pub(super) const READ_SPAN_BYTES_MAX: u64 = 4 << 20;
/// Largest gap between two records that one grouped read still spans (the gap is read and
/// thrown away: other writes' records).
pub(super) const READ_GAP_BYTES_MAX: u64 = 16 << 10;

/// A block, its chunk and where the chunk's record is.
pub(super) type Located = (u64, u64, format::ChunkRecord);

/// Groups the mapped blocks of a read by where their records are: each group is two or more
/// records of one segment, in file order, each within [`READ_GAP_BYTES_MAX`] of the previous
/// one, spanning at most [`READ_SPAN_BYTES_MAX`]. Blocks left alone (or whose chunk was not
/// located) go to `lone` as (block, chunk).
pub(super) fn read_groups(
    entries: &BTreeMap<u64, u64>,
    locations: &HashMap<u64, format::ChunkRecord>,
    lone: &mut Vec<(u64, u64)>,
) -> Vec<Vec<Located>> {
    let mut located: Vec<Located> = Vec::with_capacity(entries.len());
    for (&b, &id) in entries {
        match locations.get(&id) {
            Some(rec) => located.push((b, id, *rec)),
            None => lone.push((b, id)),
        }
    }
    located.sort_unstable_by_key(|&(b, _, rec)| (rec.segment, rec.offset, b));
    let mut groups: Vec<Vec<Located>> = Vec::new();
    let mut current: Vec<Located> = Vec::new();
    for item in located {
        let joins = current.last().is_some_and(|&(_, _, prev)| {
            let first = current[0].2;
            let prev_end = prev.offset as u64 + prev.physical_bytes();
            item.2.segment == prev.segment
                && item.2.offset as u64 >= prev_end
                && item.2.offset as u64 - prev_end <= READ_GAP_BYTES_MAX
                && item.2.offset as u64 + item.2.physical_bytes() - first.offset as u64
                    <= READ_SPAN_BYTES_MAX
        });
        if !joins {
            flush_group(&mut current, &mut groups, lone);
        }
        current.push(item);
    }
    flush_group(&mut current, &mut groups, lone);
    groups
}

/// Ends the group being built: a group of one goes to `lone`.
pub(super) fn flush_group(
    current: &mut Vec<Located>,
    groups: &mut Vec<Vec<Located>>,
    lone: &mut Vec<(u64, u64)>,
) {
    match current.len() {
        0 => {}
        1 => lone.push((current[0].0, current[0].1)),
        _ => groups.push(std::mem::take(current)),
    }
    current.clear();
}

/// Copies the part of block `b` (`None`: zeros) that falls in the read `[offset, offset +
/// buf.len())` into `buf`.
pub(super) fn copy_part(buf: &mut [u8], offset: u64, b: u64, block: Option<&[u8]>) {
    let block_start = b * BLOCK;
    let lo = offset.max(block_start);
    let hi = (offset + buf.len() as u64).min(block_start + BLOCK);
    let dst = &mut buf[(lo - offset) as usize..(hi - offset) as usize];
    match block {
        None => dst.fill(0),
        Some(block) => {
            dst.copy_from_slice(&block[(lo - block_start) as usize..(hi - block_start) as usize])
        }
    }
}
