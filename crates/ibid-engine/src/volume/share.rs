//! Copies between and within volumes (by sharing references or frames where offsets align,
//! as data elsewhere) and compare-and-write.

use super::*;

/// Blocks a metadata copy handles per step (bounds the entries it holds in memory).
pub(super) const COPY_WINDOW_BLOCKS: u64 = 1 << 20;
/// Bytes a data copy moves per step.
pub(super) const COPY_DATA_STEP_BYTES: u64 = 1 << 20;

/// One step of a copy: bytes copied as data, or whole blocks shared (by frames, or by
/// reference for small copies).
pub(super) enum CopyPiece {
    Data { src: u64, dst: u64, len: u64 },
    Share { src: u64, dst: u64, blocks: u64 },
}

impl Inner {
    /// Compare-and-write under the stripe locks of every block it touches.
    pub(super) fn compare_and_write(
        &self,
        v: &VolumeState,
        offset: u64,
        expected: &[u8],
        new: &[u8],
    ) -> Result<Option<u64>> {
        let end = offset + new.len() as u64;
        let (b0, b1) = (offset / BLOCK, end.div_ceil(BLOCK));
        let _gate = self.gate.read();
        let mut stripes: Vec<usize> = (b0..b1.min(b0 + STRIPES as u64)).map(stripe_of).collect();
        stripes.sort_unstable();
        stripes.dedup();
        let _guards: Vec<MutexGuard<()>> = stripes.iter().map(|&s| v.stripes[s].lock()).collect();
        let mut current = vec![0u8; ((b1 - b0) * BLOCK) as usize];
        self.read_range(v, b0 * BLOCK, &mut current, None)?;
        let start = (offset - b0 * BLOCK) as usize;
        let window = &mut current[start..start + new.len()];
        if let Some(i) = window.iter().zip(expected).position(|(a, b)| a != b) {
            return Ok(Some(i as u64));
        }
        window.copy_from_slice(new);
        let stamp = self.batches.stamp();
        let mut prepared = Vec::with_capacity((b1 - b0) as usize);
        for (i, block) in current.chunks(BLOCK_BYTES).enumerate() {
            match self.prepare_block(v, block, stamp, None) {
                Ok(entry) => prepared.push(Prepared {
                    block: b0 + i as u64,
                    entry,
                }),
                Err(e) => {
                    self.release(&prepared.iter().filter_map(|p| p.data()).collect::<Vec<_>>());
                    return Err(e);
                }
            }
        }
        self.install(v, b0, b1, prepared, true)?;
        Ok(None)
    }

    /// Copies a range between (or within) volumes of this pool; see [`Volume::copy_from`].
    pub(super) fn copy_range(
        &self,
        src: &Arc<VolumeState>,
        src_off: u64,
        dst: &Arc<VolumeState>,
        dst_off: u64,
        len: u64,
    ) -> Result<CopyReport> {
        let mut report = CopyReport::default();
        if len == 0 {
            return Ok(report);
        }
        // Whole blocks and long enough: by frames alone, unless the destination's stack has no
        // room (see `copy/`: such copies run beside each other). Tried once: below, a copy
        // whose frames did not fit shares block references.
        let frames_tried = src_off.is_multiple_of(BLOCK)
            && dst_off.is_multiple_of(BLOCK)
            && len.is_multiple_of(BLOCK)
            && len / BLOCK >= self.config.frame_copy_blocks_min;
        if frames_tried {
            let _framing = self.copies.framing();
            if self.copy_by_frames(src, src_off / BLOCK, dst, dst_off / BLOCK, len / BLOCK)? {
                report.shared_bytes = len;
                return Ok(report);
            }
        }
        let _exclusive = self.copies.exclusive();
        if src_off % BLOCK != dst_off % BLOCK {
            self.copy_data(src, src_off, dst, dst_off, len)?;
            report.data_bytes = len;
            return Ok(report);
        }
        // Same alignment: [head | whole blocks | tail], head and tail partial.
        let head = ((BLOCK - dst_off % BLOCK) % BLOCK).min(len);
        let blocks = (len - head) / BLOCK;
        let tail = len - head - blocks * BLOCK;
        let (sb, db) = ((src_off + head) / BLOCK, (dst_off + head) / BLOCK);
        let mut pieces = Vec::new();
        if head > 0 {
            pieces.push(CopyPiece::Data {
                src: src_off,
                dst: dst_off,
                len: head,
            });
        }
        if blocks > 0 {
            pieces.push(CopyPiece::Share {
                src: sb,
                dst: db,
                blocks,
            });
        }
        if tail > 0 {
            let at = head + blocks * BLOCK;
            pieces.push(CopyPiece::Data {
                src: src_off + at,
                dst: dst_off + at,
                len: tail,
            });
        }
        // memmove order: copying forward within one volume, do the far end first.
        if Arc::ptr_eq(src, dst) && dst_off > src_off {
            pieces.reverse();
        }
        for piece in pieces {
            match piece {
                CopyPiece::Data {
                    src: s,
                    dst: d,
                    len,
                } => self.copy_data(src, s, dst, d, len)?,
                CopyPiece::Share {
                    src: s,
                    dst: d,
                    blocks,
                } => {
                    let framed = !frames_tried
                        && blocks >= self.config.frame_copy_blocks_min
                        && self.copy_by_frames(src, s, dst, d, blocks)?;
                    if !framed {
                        self.share_windows(src, s, dst, d, blocks)?;
                    }
                }
            }
        }
        report.data_bytes = head + tail;
        report.shared_bytes = blocks * BLOCK;
        Ok(report)
    }

    /// Shares `n` blocks in windows of [`COPY_WINDOW_BLOCKS`], in memmove order.
    pub(super) fn share_windows(
        &self,
        src: &VolumeState,
        sb: u64,
        dst: &VolumeState,
        db: u64,
        n: u64,
    ) -> Result<()> {
        for w in memmove_steps(src, sb, dst, db, n, COPY_WINDOW_BLOCKS) {
            let len = COPY_WINDOW_BLOCKS.min(n - w);
            self.share_blocks(src, sb + w, dst, db + w, len)?;
        }
        Ok(())
    }

    /// Makes `n` blocks of `dst` from `db` reference the chunks of `src` from `sb`: no data I/O.
    /// The source's references are captured, and taken, before the destination changes, so an
    /// overlapping copy within one volume is correct.
    pub(super) fn share_blocks(
        &self,
        src: &VolumeState,
        sb: u64,
        dst: &VolumeState,
        db: u64,
        n: u64,
    ) -> Result<()> {
        let _gate = self.gate.read();
        let entries = self.lookup_range(src, sb, sb + n)?;
        self.add_refs(entries.values().copied(), 1);
        self.zero_blocks_gated(dst, db, db + n)?;
        let prepared = entries
            .into_iter()
            .map(|(b, id)| Prepared {
                block: b - sb + db,
                entry: Entry::Data(id),
            })
            .collect();
        self.install(dst, db, db + n, prepared, false)
    }

    /// Copies bytes by reading and writing them, in steps, in memmove order.
    pub(super) fn copy_data(
        &self,
        src: &VolumeState,
        src_off: u64,
        dst: &VolumeState,
        dst_off: u64,
        len: u64,
    ) -> Result<()> {
        let mut buf = Vec::new();
        for at in memmove_steps(src, src_off, dst, dst_off, len, COPY_DATA_STEP_BYTES) {
            let n = COPY_DATA_STEP_BYTES.min(len - at);
            buf.resize(n as usize, 0);
            self.read_range(src, src_off + at, &mut buf, None)?;
            self.write_range(dst, dst_off + at, &buf)?;
        }
        Ok(())
    }
}

/// Offsets `0, step, 2 * step, ...` below `len`, in the order a copy of `len` units from
/// `src_at` to `dst_at` must take them: from the far end when copying forward within one
/// volume, so no step overwrites source units a later step still reads.
pub(super) fn memmove_steps(
    src: &VolumeState,
    src_at: u64,
    dst: &VolumeState,
    dst_at: u64,
    len: u64,
    step: u64,
) -> Vec<u64> {
    let mut steps: Vec<u64> = (0..len).step_by(step as usize).collect();
    if std::ptr::eq(src, dst) && dst_at > src_at {
        steps.reverse();
    }
    steps
}
