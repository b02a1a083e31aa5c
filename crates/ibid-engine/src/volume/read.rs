//! The read path: resolving blocks through a volume's stack of frames (uncommitted changes
//! over the committed map), locating chunks, and reading and checking their records,
//! grouped by segment when they lie close together.

use super::*;
use rustc_hash::FxHashMap;

impl Inner {
    /// Reads `buf.len()` bytes at `offset` (range already checked). The whole blocks found in
    /// the read cache are copied from it, or, given `held`, left there and added to `held`
    /// (`buf` then has holes where they go). The records of the other blocks that lie close
    /// together in a segment (data written sequentially, spread over the segment writers) are
    /// read with one read per group; a lone record, or anything unusual (a chunk gone or
    /// moved meanwhile), goes by the block-by-block path with its retries. Whole blocks read
    /// from their records are offered to the read cache.
    pub(crate) fn read_range(
        &self,
        v: &VolumeState,
        offset: u64,
        buf: &mut [u8],
        held: Option<&mut HeldBlocks>,
    ) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let end = offset + buf.len() as u64;
        let (b0, b1) = (offset / BLOCK, end.div_ceil(BLOCK));
        let mut entries = self.lookup_range(v, b0, b1)?;
        for b in (b0..b1).filter(|b| !entries.contains_key(b)) {
            copy_part(buf, offset, b, None);
        }
        let caching = self.read_cache.enabled();
        if caching && !entries.is_empty() {
            entries = self.take_cached_blocks(&entries, buf, offset, held);
            if entries.is_empty() {
                return Ok(());
            }
        }
        let locations = self.chunk_locations(entries.values().copied())?;
        let mut block = vec![0u8; BLOCK_BYTES];
        let mut lone = Vec::new();
        // Whole blocks read from their chunk's record: (chunk, where in `buf`).
        let mut read_whole: Vec<(u64, usize)> = Vec::new();
        let mut span = SpanBuffer::take();
        for group in read_groups(&entries, &locations, &mut lone) {
            if self.read_group(
                &group,
                buf,
                offset,
                span.get(group_bytes(&group)),
                &mut block,
            )? {
                read_whole.extend(group.iter().filter_map(|&(b, id, _)| {
                    Some((id, whole_block_range(buf, offset, b)?.start))
                }));
            } else {
                lone.extend(group.iter().map(|&(b, id, _)| (b, id)));
            }
        }
        drop(span);
        for (b, chunk) in lone {
            // Located already: one read; the block-by-block path (which looks it up again)
            // only if the chunk was not found or its segment is gone.
            let read = match locations.get(&chunk) {
                Some(rec) => self.read_located(chunk, rec, &mut block)?,
                None => false,
            };
            if read {
                if let Some(range) = whole_block_range(buf, offset, b) {
                    read_whole.push((chunk, range.start));
                }
            } else {
                // Possibly another chunk's bytes (the block was overwritten meanwhile):
                // not offered under `chunk`.
                self.read_block(v, b, chunk, &mut block)?;
            }
            copy_part(buf, offset, b, Some(&block));
        }
        if caching {
            let buf = &*buf;
            self.read_cache.offer(
                read_whole
                    .iter()
                    .map(|&(id, at)| (id, &buf[at..at + BLOCK_BYTES])),
            );
        }
        Ok(())
    }

    /// Serves from the read cache the whole blocks of `entries` (a read of `buf` at `offset`)
    /// that it holds — copied into `buf`, or, given `held`, added to it — and returns the
    /// entries left to read.
    fn take_cached_blocks(
        &self,
        entries: &BTreeMap<u64, u64>,
        buf: &mut [u8],
        offset: u64,
        mut held: Option<&mut HeldBlocks>,
    ) -> BTreeMap<u64, u64> {
        let mut rest = BTreeMap::new();
        let whole =
            entries
                .iter()
                .filter_map(|(&b, &id)| match whole_block_range(buf, offset, b) {
                    Some(range) => Some((id, (b, range.start))),
                    None => {
                        rest.insert(b, id);
                        None
                    }
                });
        let wanted: Vec<(u64, (u64, usize))> = whole.collect();
        let cache = &self.read_cache;
        // Without `held`, the hits are copied once the shard locks are let go.
        let mut hits = Vec::new();
        cache.lookup(
            wanted.into_iter(),
            |(_, at), slot| match held.as_deref_mut() {
                Some(held) => held.push(at, slot),
                None => hits.push((at, slot)),
            },
            |id, (b, _)| {
                rest.insert(b, id);
            },
        );
        for (at, slot) in hits {
            // SAFETY: held by the lookup; the bytes are copied, then the hold released once.
            buf[at..at + BLOCK_BYTES].copy_from_slice(unsafe { cache.bytes(slot) });
            unsafe { cache.release(slot) };
        }
        rest
    }

    /// Reads `group` (records close together in one segment, in file order) for the read of
    /// `buf` at `offset`, with one scattered read: a record stored whole (uncompressed) whose
    /// block the read covers lands straight in `buf`; the headers, the gaps between records
    /// and the other payloads land in `scratch` (the span's size, at their place in it). Then
    /// every record is checked and the others decoded. `Ok(false)` if the segment is gone.
    fn read_group(
        &self,
        group: &[Located],
        buf: &mut [u8],
        offset: u64,
        scratch: &mut [u8],
        block: &mut [u8],
    ) -> Result<bool> {
        let first = group[0].2;
        let direct: Vec<bool> = group
            .iter()
            .map(|&(b, _, rec)| stored_whole(&rec) && whole_block_range(buf, offset, b).is_some())
            .collect();
        {
            let mut slots = BlockSlots::new(buf, offset);
            let mut pieces: Vec<&mut [u8]> = Vec::with_capacity(2 * group.len());
            let mut rest = &mut scratch[..];
            let mut at = first.offset as u64;
            for (&(b, _, rec), &direct) in group.iter().zip(&direct) {
                let head = (rec.offset as u64 - at) as usize + RECORD_HEADER_BYTES;
                let (piece, tail) = rest.split_at_mut(head);
                let (payload, tail) = tail.split_at_mut(rec.stored_len as usize);
                rest = tail;
                pieces.push(piece);
                pieces.push(if direct { slots.take(b) } else { payload });
                at = rec.offset as u64 + rec.physical_bytes();
            }
            if !self
                .segments
                .read_span_scattered(first.segment, first.offset, &mut pieces)?
            {
                return Ok(false);
            }
        }
        for (&(b, id, rec), &direct) in group.iter().zip(&direct) {
            let at = (rec.offset - first.offset) as usize;
            let header = &scratch[at..at + RECORD_HEADER_BYTES];
            if direct {
                let range = whole_block_range(buf, offset, b).expect("chosen as whole");
                check_record(id, &rec, header, &buf[range])?;
                continue;
            }
            let payload = &scratch[at + RECORD_HEADER_BYTES..at + rec.physical_bytes() as usize];
            check_record(id, &rec, header, payload)?;
            match whole_block_range(buf, offset, b) {
                Some(range) => decode_payload(id, &rec, payload, &mut buf[range])?,
                None => {
                    decode_payload(id, &rec, payload, block)?;
                    copy_part(buf, offset, b, Some(block));
                }
            }
        }
        Ok(true)
    }

    /// Where each of `ids` is (those found: uncommitted records first, then one read of the
    /// store).
    pub(super) fn chunk_locations(
        &self,
        ids: impl Iterator<Item = u64>,
    ) -> Result<FxHashMap<u64, format::ChunkRecord>> {
        // Sized up front: a 1 MiB read locates 256 chunks, and growing the map as it fills
        // cost ~3 % of a sequential read's CPU.
        let mut out = FxHashMap::with_capacity_and_hasher(ids.size_hint().0, Default::default());
        let mut stored = Vec::with_capacity(ids.size_hint().0);
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
            crate::chunk_table::get_many(&txn, &mut stored, |id, rec| {
                out.insert(id, rec);
            })?;
        }
        Ok(out)
    }

    /// The fingerprint of each of `ids` that has one (uncommitted chunks first, then one read
    /// of the store; a chunk freed meanwhile may still have its fingerprint stored, which is
    /// still its content's: chunk ids are never reused).
    pub(super) fn chunk_fingerprints(
        &self,
        ids: impl Iterator<Item = u64>,
    ) -> Result<FxHashMap<u64, format::Fingerprint>> {
        let mut out = FxHashMap::with_capacity_and_hasher(ids.size_hint().0, Default::default());
        let mut stored = Vec::with_capacity(ids.size_hint().0);
        for id in ids {
            match self.uncommitted_chunk(id) {
                Some(new) => {
                    out.insert(id, new.fingerprint);
                }
                None => stored.push(id),
            }
        }
        if !stored.is_empty() {
            let txn = self.db.read()?;
            crate::chunk_fps::get_many(&txn, &mut stored, |id, fp| {
                out.insert(id, fp);
            })?;
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
        self.uncommitted_chunk(id).map(|new| new.rec)
    }

    /// A chunk created since the last commit, with its fingerprint (`None` for committed
    /// chunks).
    fn uncommitted_chunk(&self, id: u64) -> Option<format::NewChunkRecord> {
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

/// [`crate::stack::resolve_each`] over the committed map in `txn`: `visit(block, value,
/// frame)` for every block of `[b0, b1)` that `stack` shows an entry at, skipping the layers
/// whose filters rule the range out.
pub(crate) fn resolve_stored_each(
    txn: &ReadTxn,
    filters: &LayerFilters,
    stack: &[Frame],
    b0: u64,
    b1: u64,
    visit: impl FnMut(u64, u64, usize),
) -> Result<()> {
    crate::stack::resolve_each(
        stack,
        b0,
        b1,
        |layer, s0, s1, found| scan_layer(txn, filters, layer, s0, s1, found),
        visit,
    )
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
        if let Some(v) = crate::map_table::get(txn, layer, b0)? {
            found(b0, v);
        }
        return Ok(());
    }
    crate::map_table::scan(txn, layer, b0, b1, found)
}

/// Checks a chunk's record `raw` (header and payload, as found at `rec`) and decodes its
/// 4 KiB block into `out`.
pub(super) fn decode_chunk(
    id: u64,
    rec: &format::ChunkRecord,
    raw: &[u8],
    out: &mut [u8],
) -> Result<()> {
    if raw.len() < RECORD_HEADER_BYTES {
        return Err(Error::Corrupt(format!("chunk {id:#x}: record truncated")));
    }
    let (header, payload) = raw.split_at(RECORD_HEADER_BYTES);
    check_record(id, rec, header, payload)?;
    decode_payload(id, rec, payload, out)
}

/// Checks a chunk's record, read as `header` and `payload`, against `rec` (where it was
/// found): the header's magic, id and length, and the checksum over both.
pub(super) fn check_record(
    id: u64,
    rec: &format::ChunkRecord,
    header: &[u8],
    payload: &[u8],
) -> Result<()> {
    let h = format::decode_record_header(header).map_err(|e| {
        Error::Corrupt(format!(
            "chunk {id:#x} in segment {:016x}: {e}",
            rec.segment
        ))
    })?;
    if h.chunk_id != id
        || h.stored_len != rec.stored_len
        || h.crc != rec.crc
        || payload.len() != rec.stored_len as usize
        || !format::record_parts_crc_ok(header, payload, rec.crc)
    {
        return Err(Error::Corrupt(format!(
            "chunk {id:#x} in segment {:016x} at offset {}: checksum or header mismatch",
            rec.segment, rec.offset
        )));
    }
    Ok(())
}

/// Whether a chunk's payload is its block as it is (not compressed): such a payload can be
/// read straight into the reader's buffer.
fn stored_whole(rec: &format::ChunkRecord) -> bool {
    rec.flags & RECORD_FLAG_LZ4 == 0 && rec.stored_len as usize == BLOCK_BYTES
}

/// Decodes a checked chunk payload into its 4 KiB block `out`.
fn decode_payload(
    id: u64,
    rec: &format::ChunkRecord,
    payload: &[u8],
    out: &mut [u8],
) -> Result<()> {
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
    locations: &FxHashMap<u64, format::ChunkRecord>,
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

/// Bytes of a group's span: from its first record's start to its last record's end.
fn group_bytes(group: &[Located]) -> usize {
    let (first, last) = (group[0].2, group[group.len() - 1].2);
    (last.offset as u64 + last.physical_bytes() - first.offset as u64) as usize
}

/// Where in `buf` (a read at `offset`) block `b` is, if the read covers all of it.
fn whole_block_range(buf: &[u8], offset: u64, b: u64) -> Option<std::ops::Range<usize>> {
    let start = (b * BLOCK).checked_sub(offset)? as usize;
    (start + BLOCK_BYTES <= buf.len()).then_some(start..start + BLOCK_BYTES)
}

/// The whole blocks of a read's buffer as separate slices, each handed out once: a
/// scattered read fills them in the order their records lie on disk.
struct BlockSlots<'a> {
    /// The first whole block.
    first: u64,
    slots: Vec<Option<&'a mut [u8]>>,
}

impl<'a> BlockSlots<'a> {
    fn new(buf: &'a mut [u8], offset: u64) -> BlockSlots<'a> {
        let first = offset.div_ceil(BLOCK);
        let skip = ((first * BLOCK - offset) as usize).min(buf.len());
        let slots = buf[skip..]
            .chunks_exact_mut(BLOCK_BYTES)
            .map(Some)
            .collect();
        BlockSlots { first, slots }
    }

    /// Block `b`'s slice (a whole block of the read, not handed out before).
    fn take(&mut self, b: u64) -> &'a mut [u8] {
        self.slots[(b - self.first) as usize]
            .take()
            .expect("each block's slot is taken once")
    }
}

thread_local! {
    /// Each reading thread's buffer for grouped reads, kept between reads so that it is
    /// allocated and zeroed once rather than per read.
    static SPAN_BUFFER: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A thread's span buffer, taken for one read and given back when dropped (a nested read
/// on the same thread would find none and use a fresh one).
struct SpanBuffer(Vec<u8>);

impl SpanBuffer {
    fn take() -> SpanBuffer {
        SpanBuffer(SPAN_BUFFER.with(|b| b.take()))
    }

    /// The first `len` bytes of the buffer, grown if needed (grown bytes are zeroed once;
    /// the bytes handed out hold whatever an earlier read left there).
    fn get(&mut self, len: usize) -> &mut [u8] {
        if self.0.len() < len {
            self.0.resize(len, 0);
        }
        &mut self.0[..len]
    }
}

/// Largest span buffer a thread keeps between reads (a 1 MiB read's records, with room);
/// a larger one is freed after its read.
const SPAN_BUFFER_KEPT_MAX: usize = 2 << 20;

impl Drop for SpanBuffer {
    fn drop(&mut self) {
        if self.0.len() <= SPAN_BUFFER_KEPT_MAX {
            let buf = std::mem::take(&mut self.0);
            SPAN_BUFFER.with(|b| b.set(buf));
        }
    }
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
