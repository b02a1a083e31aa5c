//! Zeroing: whole blocks become a range in the volume's dirty overlay, settled by commits.

use super::*;

impl Inner {
    /// Zeroes whole blocks `[b0, b1)`: records the range in the volume's dirty overlay (see
    /// `overlay.rs`). Costs the uncommitted entries inside the range, not its length or its
    /// committed data: the commit drops the committed entries and their references.
    pub(crate) fn zero_blocks(&self, v: &VolumeState, b0: u64, b1: u64) -> Result<()> {
        let _gate = self.gate.read();
        self.zero_blocks_gated(v, b0, b1)
    }

    /// [`Inner::zero_blocks`] for a caller that already holds the gate.
    pub(super) fn zero_blocks_gated(&self, v: &VolumeState, b0: u64, b1: u64) -> Result<()> {
        if b0 >= b1 {
            return Ok(());
        }
        // Every stripe: no read-modify-write of a partial block in the range is half done.
        let _guards: Vec<MutexGuard<()>> = v.stripes.iter().map(|s| s.lock()).collect();
        let mut map = v.map.lock();
        if map.deleted {
            return Err(Error::NotFound(v.name.clone()));
        }
        // The dirty entries the range replaces: their references are ours to drop and what
        // they showed is known now; the rest of the range is settled by the commit.
        let under = map.committing.clone();
        let removed = map.dirty.zero(b0, b1, &under);
        let mut released = Vec::new();
        for (_, e) in removed {
            if let Entry::Data(id) = e {
                released.push(id);
            }
        }
        let unmapped = released.len() as u64;
        map.mapped_blocks -= unmapped;
        self.note_mapped_change(v, -(unmapped as i64));
        // The caller holds the gate, so no cut moves the stamp meanwhile.
        let stamp = self.batches.stamp();
        self.journal.append(
            stamp,
            Change::Zero {
                volume: v.id,
                b0,
                b1,
            },
        );
        drop(map);
        self.batches.add_dirty(1);
        self.release(&released);
        if v.format().is_thick() {
            // Its reservation grows back only when the range's blocks are counted: soon.
            self.wake_background();
        }
        Ok(())
    }

    /// `v`'s map, locked, with the committed entries in `[b0, b1)` of its top layer and of the
    /// layers below, read consistently with it: if a commit published between the read and the
    /// lock (the map's generation moved), read again.
    pub(super) fn lock_map_with_committed<'a>(
        &self,
        v: &'a VolumeState,
        b0: u64,
        b1: u64,
    ) -> Result<LockedMap<'a>> {
        loop {
            let (generation, stack) = {
                let m = v.map.lock();
                (m.generation, m.stack.clone())
            };
            let (top, lower) = stack.split_last().expect("a stack has a layer");
            // One read transaction for the top layer and the frames below it.
            let txn = self.db.read()?;
            let mut stored_top = BTreeMap::new();
            scan_layer(&txn, &self.layer_filters, top.layer, b0, b1, &mut |b, v| {
                stored_top.insert(b, v);
            })?;
            // The layers below matter only where the top has no entry (an overwrite of a
            // block already in the top layer reads nothing below it).
            let stored_lower = if lower.is_empty() || stored_top.len() as u64 == b1 - b0 {
                BTreeMap::new()
            } else {
                resolve_stored(&txn, &self.layer_filters, lower, b0, b1, false)?.entries
            };
            drop(txn);
            let map = v.map.lock();
            if map.deleted {
                return Err(Error::NotFound(v.name.clone()));
            }
            if map.generation == generation {
                return Ok((map, stored_top, stored_lower));
            }
        }
    }
}

/// A volume's locked map with the committed entries of its top layer and of the layers below.
pub(super) type LockedMap<'a> = (
    MutexGuard<'a, VolumeMap>,
    BTreeMap<u64, u64>,
    BTreeMap<u64, u64>,
);
