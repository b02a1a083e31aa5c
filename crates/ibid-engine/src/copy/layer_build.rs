//! Layers in no stack that still have map entries, listed in [`meta::BUILDING_KEY`]: a new
//! layer written in bounded steps before any stack shows it (making range-copy frames
//! permanent, see the parent module), and a layer whose last stack reference went (a deleted
//! volume's or snapshot's, a copy's group's), whose entries are deleted in bounded steps — so
//! that no single transaction, and no hold of the commit lock, grows with a layer.
//!
//! A build's steps are each one transaction under the commit lock: the layer's next map
//! entries and the chunk references they take (logged, `ref_log.rs`); the first step also
//! allocates the layer's id and lists it. The caller checks before each step that the stack
//! the entries were read from still shows them: its layers keep the chunks alive until the new
//! entries' references are logged. The caller's last step puts the layer in a stack and takes
//! it off the list ([`Inner::finish_build`]).
//!
//! A listed layer that no running build owns ([`CommitState::building`]) is **abandoned**:
//! its build gave up, or the pool closed or crashed during it, or it was dropped
//! ([`list_dropped`]: abandoned from the start). The background deletes an abandoned layer's
//! entries in steps, dropping their references, and then takes it off the list
//! ([`Inner::discard_abandoned_layers`]; [`crate::Pool::sync`] and a write that meets
//! `NoSpace` do it too), checking before each step, under the commit lock, that the layer is
//! still listed and unowned (a build that finished meanwhile has put it in a stack and
//! unlisted it). A committed layer id is never reused, so an abandoned layer stays abandoned.
//! `verify` accepts map entries of listed layers and counts their references: until its
//! entries are gone, a dropped layer keeps its chunks alive, and the space they hold comes
//! back as the steps go (and their slices of the reference log are folded).

use crate::commit_state::CommitState;
use crate::error::{Error, Result};
use crate::format;
use crate::inner::Inner;
use crate::map_table;
use crate::meta;
use crate::ref_log::{by_slice, Deltas};
use crate::store::{Reader, WriteTxn};
use std::sync::atomic::{AtomicBool, Ordering};

/// The layers listed as being built in `txn`'s view.
pub(crate) fn listed(txn: &impl Reader) -> Result<Vec<u64>> {
    let Some(v) = txn.get(meta::POOL, meta::BUILDING_KEY)? else {
        return Ok(Vec::new());
    };
    if v.len() % 8 != 0 {
        return Err(Error::Corrupt(format!(
            "the list of layers being built is {} bytes long",
            v.len()
        )));
    }
    Ok(v.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// Writes the list of layers being built or deleted, ascending (removing the row when it is
/// empty).
fn write_list(txn: &mut WriteTxn, layers: &mut [u64]) {
    if layers.is_empty() {
        txn.remove(meta::POOL, meta::BUILDING_KEY);
        return;
    }
    layers.sort_unstable();
    let bytes: Vec<u8> = layers.iter().flat_map(|l| l.to_le_bytes()).collect();
    txn.insert(meta::POOL, meta::BUILDING_KEY, bytes.as_slice());
}

/// Lists `layer`, whose last stack reference `txn` removes, for its entries to be deleted in
/// steps by [`Inner::discard_abandoned_layers`] (no build owns it: it is abandoned at once).
pub(crate) fn list_dropped(txn: &mut WriteTxn, layer: u64) -> Result<()> {
    let mut list = listed(txn)?;
    if !list.contains(&layer) {
        list.push(layer);
    }
    write_list(txn, &mut list);
    Ok(())
}

/// One build: the layer once its first step has allocated it.
#[derive(Debug, Default)]
pub(crate) struct LayerBuild {
    layer: Option<u64>,
    /// The pool record with the layer allocated, until the allocating step commits.
    allocating: Option<meta::PoolRecord>,
    /// Entries written so far.
    pub entries: u64,
}

impl Inner {
    /// Adds `entries` (block, chunk id or tombstone) to `build`'s layer in `txn`, allocating the
    /// layer first if this is the build's first step; the references the entries take are
    /// added to `deltas`. Call holding the commit lock, then [`Inner::commit_build_step`] (or
    /// finish the build in the same transaction). Returns the layer.
    pub(crate) fn write_build_step(
        &self,
        cs: &CommitState,
        txn: &mut WriteTxn,
        build: &mut LayerBuild,
        entries: &[(u64, u64)],
        deltas: &mut Deltas,
    ) -> Result<u64> {
        let layer = match build.layer {
            Some(l) => l,
            None => {
                let layer = cs.record.next_layer_id;
                let mut rec = cs.record.clone();
                rec.next_layer_id += 1;
                txn.insert(meta::POOL, meta::POOL_KEY, rec.encode().as_slice());
                let mut list = listed(txn)?;
                list.push(layer);
                write_list(txn, &mut list);
                self.layer_filters.fresh(layer);
                build.layer = Some(layer);
                build.allocating = Some(rec);
                layer
            }
        };
        let mut map = map_table::Changes::new();
        for &(b, id) in entries {
            map.set(layer, b, id);
            if id != format::ZERO_TOMBSTONE {
                *deltas.entry(id).or_default() += 1;
            }
        }
        map.write(txn)?;
        // Before the commit (see layer_filter.rs).
        self.layer_filters
            .grow(layer, entries.iter().map(|&(b, _)| b));
        build.entries += entries.len() as u64;
        Ok(layer)
    }

    /// Commits a step [`Inner::write_build_step`] wrote, with its references logged.
    pub(crate) fn commit_build_step(
        &self,
        cs: &mut CommitState,
        mut txn: WriteTxn,
        build: &mut LayerBuild,
        deltas: &Deltas,
    ) -> Result<()> {
        cs.ref_log.append(&mut txn, &by_slice(deltas));
        txn.commit()?;
        self.built_step_committed(cs, build);
        Ok(())
    }

    /// Takes the build's layer off the list in `txn`, the transaction that puts it in a stack;
    /// call [`Inner::built_step_committed`] once it commits.
    pub(crate) fn finish_build(&self, txn: &mut WriteTxn, build: &LayerBuild) -> Result<()> {
        let Some(layer) = build.layer else {
            return Ok(());
        };
        let mut list = listed(txn)?;
        list.retain(|&l| l != layer);
        write_list(txn, &mut list);
        Ok(())
    }

    /// Records in the commit state what a committed step of `build` changed: the pool record
    /// with the layer allocated, and the layer owned by the build.
    pub(crate) fn built_step_committed(&self, cs: &mut CommitState, build: &mut LayerBuild) {
        if let Some(rec) = build.allocating.take() {
            cs.record = rec;
            cs.building.extend(build.layer);
        }
    }

    /// Gives up `build`: its layer, if any, becomes abandoned (deleted by the background).
    pub(crate) fn abandon_build(&self, cs: &mut CommitState, build: &mut LayerBuild) {
        if let Some(layer) = build.layer {
            self.event(|| format!("layer {layer} abandoned after {} entries", build.entries));
        }
        self.end_build(cs, build);
    }

    /// Marks a finished build's layer as no longer being built (it is in a stack now).
    pub(crate) fn end_build(&self, cs: &mut CommitState, build: &mut LayerBuild) {
        if let Some(layer) = build.layer.take() {
            cs.building.remove(&layer);
        }
    }

    /// Deletes the entries of abandoned layers (see the module doc), `flatten_step_entries`
    /// per transaction, and takes each emptied layer off the list. Gives up between steps once
    /// `stop` is set, or, with `yield_to_commits` (the background thread, which is also the
    /// committer), once a commit has been asked for: the next round goes on where this one
    /// stopped. Returns the entries deleted.
    pub(crate) fn discard_abandoned_layers(
        &self,
        stop: &AtomicBool,
        yield_to_commits: bool,
    ) -> Result<u64> {
        let layers = listed(&self.db.read()?)?;
        let t0 = std::time::Instant::now();
        let deleted = self.discard_if_abandoned(&layers, stop, yield_to_commits)?;
        if deleted > 0 {
            tracing::debug!(
                "discard: {deleted} entries of layers no stack shows deleted in {:?} \
                 ({} listed before)",
                t0.elapsed(),
                layers.len()
            );
            // Their references went to the log: fold it while the pool is idle (freed space
            // shows within seconds).
            self.wake_background();
        }
        Ok(deleted)
    }

    /// Discards every abandoned layer to the end, without yielding (for tests).
    #[cfg(test)]
    fn discard_now(&self) -> Result<u64> {
        self.discard_abandoned_layers(&AtomicBool::new(false), false)
    }

    /// [`Inner::discard_abandoned_layers`] for `layers`, a list read earlier: each is checked
    /// again, under the commit lock, before every step. A call yielding to commits makes at
    /// least one step, so that writes that keep asking for commits do not starve it.
    fn discard_if_abandoned(
        &self,
        layers: &[u64],
        stop: &AtomicBool,
        yield_to_commits: bool,
    ) -> Result<u64> {
        let step = self.config.flatten_step_entries.max(1) as usize;
        let mut deleted = 0;
        let mut stepped = false;
        for &layer in layers {
            loop {
                if stop.load(Ordering::Acquire)
                    || yield_to_commits && stepped && self.threads.wake_pending()
                {
                    return Ok(deleted);
                }
                stepped = true;
                let end = map_table::nth_block(&self.db.read()?, layer, 0, step)?;
                let mut cs = self.commit.lock();
                let mut txn = self.db.write()?;
                // Checked under the commit lock, which every change to the list and to the
                // builds' ownership holds: a build may have finished (and put the layer in a
                // stack) since the list above was read.
                if cs.building.contains(&layer) || !listed(&txn)?.contains(&layer) {
                    break;
                }
                let taken = map_table::take_all(&mut txn, layer, 0, end.unwrap_or(u64::MAX))?;
                let mut deltas = Deltas::new();
                for (_, id) in &taken {
                    if *id != format::ZERO_TOMBSTONE {
                        *deltas.entry(*id).or_default() -= 1;
                    }
                }
                if end.is_none() {
                    let mut list = listed(&txn)?;
                    list.retain(|&l| l != layer);
                    write_list(&mut txn, &mut list);
                }
                cs.ref_log.append(&mut txn, &by_slice(&deltas));
                txn.commit()?;
                drop(cs);
                deleted += taken.len() as u64;
                if end.is_none() {
                    self.layer_filters.forget(layer);
                    self.event(|| format!("layer {layer} discarded (no stack showed it)"));
                    break;
                }
            }
        }
        Ok(deleted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::noise_block;
    use crate::{Pool, PoolConfig};

    const BLOCKS: u64 = 40;

    /// A 1 GiB pool without background threads whose layers are built and discarded in
    /// steps of 7 entries.
    fn steps_of_7() -> PoolConfig {
        PoolConfig {
            capacity_bytes: Some(1 << 30),
            capacity_force: true,
            background: false,
            flatten_step_entries: 7,
            ..PoolConfig::default()
        }
    }

    /// Writes each block `b` of `blocks` of `v` with `noise_block(seed + b)`.
    fn write_noise(v: &crate::Volume, blocks: std::ops::Range<u64>, seed: u64) {
        for b in blocks {
            v.write(b * 4096, &noise_block(seed + b), false)
                .expect("write");
        }
    }

    fn listed_now(inner: &Inner) -> Vec<u64> {
        listed(&inner.db.read().expect("read")).expect("the list")
    }

    /// A layer built part way (two steps, then the build given up, or the pool closed during
    /// it) verifies clean with its entries' references counted, survives a reopen listed as
    /// being built, keeps its chunks alive after the volume they came from is deleted, and is
    /// discarded by the background in steps: every reference dropped, the chunks freed, the
    /// list emptied.
    #[test]
    fn an_abandoned_layer_verifies_and_is_discarded_with_its_references() {
        for reopen in [false, true] {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("pool");
            let config = steps_of_7();
            let mut pool = Pool::create(&path, config.clone()).expect("create");
            let v = pool.create_volume("v", BLOCKS * 4096).expect("volume");
            write_noise(&v, 0..BLOCKS, 1);
            pool.sync().expect("sync");
            let chunks = pool.stats().unique_chunks;
            assert_eq!(chunks, BLOCKS, "one chunk per block");
            let inner = pool.inner.clone();
            let top = v.state().map.lock().stack[0].layer;
            let entries: Vec<(u64, u64)> =
                map_table::layer_entries(&inner.db.read().expect("read"), top).expect("entries");
            assert_eq!(entries.len() as u64, BLOCKS);
            let mut build = LayerBuild::default();
            for part in entries[..20].chunks(10) {
                let mut cs = inner.commit.lock();
                let mut txn = inner.db.write().expect("write txn");
                let mut deltas = Deltas::new();
                inner
                    .write_build_step(&cs, &mut txn, &mut build, part, &mut deltas)
                    .expect("step");
                inner
                    .commit_build_step(&mut cs, txn, &mut build, &deltas)
                    .expect("commit step");
            }
            let layer = build.layer.expect("allocated");
            assert_eq!(listed_now(&inner), vec![layer]);
            assert_eq!(inner.commit.lock().building.iter().next(), Some(&layer));
            pool.verify().expect("verify with a layer being built");
            // Owned by a running build: the background leaves it alone.
            assert_eq!(inner.discard_now().expect("discard"), 0);
            if reopen {
                drop((v, inner));
                pool.close().expect("close");
                pool = Pool::open(&path, config.clone()).expect("reopen");
            } else {
                inner.abandon_build(&mut inner.commit.lock(), &mut build);
                drop((v, inner));
            }
            let inner = pool.inner.clone();
            assert_eq!(listed_now(&inner), vec![layer]);
            assert!(inner.commit.lock().building.is_empty());
            pool.verify().expect("verify an abandoned layer");
            pool.delete_volume("v").expect("delete");
            // The volume's own layer is dropped (listed, deleted in steps too); not `sync`,
            // which would discard the abandoned layer as well.
            assert_eq!(listed_now(&inner), vec![top, layer]);
            let never = AtomicBool::new(false);
            let dropped = inner
                .discard_if_abandoned(&[top], &never, false)
                .expect("discard the volume's layer");
            assert_eq!(dropped, BLOCKS);
            pool.verify().expect("verify with only the abandoned layer");
            assert_eq!(
                pool.stats().unique_chunks,
                20,
                "the abandoned layer's chunks stay alive (reopen: {reopen})"
            );
            let deleted = inner.discard_now().expect("discard");
            assert_eq!(deleted, 20);
            assert!(listed_now(&inner).is_empty());
            pool.sync().expect("sync");
            assert_eq!(pool.stats().unique_chunks, 0, "reopen: {reopen}");
            pool.verify().expect("verify after the discard");
            drop(inner);
            pool.close().expect("close");
        }
    }

    /// A full clone made in steps of three entries (a snapshot under overwrites and zeroed
    /// ranges as its source, so the new layer takes data and tombstones) reads like its source,
    /// verifies, lists no layer as being built, and outlives the source's deletion.
    #[test]
    fn a_full_clone_built_in_steps_reads_like_its_source() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = PoolConfig {
            capacity_bytes: Some(1 << 30),
            capacity_force: true,
            background: false,
            flatten_step_entries: 3,
            // Range copies by frames (not by block references) from one block up.
            frame_copy_blocks_min: 1,
            ..PoolConfig::default()
        };
        let pool = Pool::create(dir.path().join("pool"), config).expect("create");
        let v = pool.create_volume("v", BLOCKS * 4096).expect("volume");
        write_noise(&v, 0..BLOCKS, 1);
        pool.create_snapshot("v", "s").expect("snapshot");
        for b in (0..BLOCKS).step_by(3) {
            v.write(b * 4096, &noise_block(1000 + b), false)
                .expect("overwrite");
        }
        v.write_zeroes(10 * 4096, 9 * 4096, false).expect("zero");
        pool.sync().expect("sync");
        let read_all = |name: &str| -> Vec<u8> {
            let vol = pool.volume(name).expect("volume");
            let mut out = vec![0u8; (BLOCKS * 4096) as usize];
            vol.read(0, &mut out).expect("read");
            out
        };
        let want = read_all("v");
        let clone = pool.full_clone("v", "c").expect("full clone");
        assert_eq!(read_all("c"), want, "the clone reads like its source");
        let stack = clone.state().map.lock().stack.clone();
        assert!(stack.iter().all(format::Frame::is_plain));
        assert_eq!(
            stack.len(),
            2,
            "the built layer under the clone's top: {stack:?}"
        );
        let built_entries = entries_of(&pool.inner, stack[0].layer);
        assert!(
            built_entries > 9,
            "{built_entries} entries: several steps of 3"
        );
        // A discard that read the list while the build ran must leave the finished layer alone
        // (the simulator found the background deleting it).
        let built = stack[0].layer;
        let none = pool
            .inner
            .discard_if_abandoned(&[built], &AtomicBool::new(false), false)
            .expect("discard");
        assert_eq!(none, 0, "a finished layer was discarded");
        assert_eq!(read_all("c"), want, "the clone after a stale discard");
        assert!(listed_now(&pool.inner).is_empty());
        assert!(pool.inner.commit.lock().building.is_empty());
        pool.verify().expect("verify after the clone");
        drop(clone);
        pool.delete_snapshot("v", "s").expect("delete snapshot");
        pool.delete_volume("v").expect("delete source");
        pool.gc_now().expect("gc");
        assert_eq!(read_all("c"), want, "the clone outlives its source");
        pool.verify().expect("verify after the source's deletion");
    }

    /// Deleting a volume lists its private layer instead of deleting its entries in the
    /// commit: the layer keeps its chunks alive (verify counts its entries' references), is
    /// still listed after a reopen, and is discarded in steps — one step per call once a commit
    /// has been asked for — after which every chunk but the clone's is freed. The layer of
    /// the deleted volume's snapshot that a clone still shows is not dropped.
    #[test]
    fn a_deleted_volume_s_layer_is_discarded_in_steps() {
        for reopen in [false, true] {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("pool");
            let config = steps_of_7();
            let mut pool = Pool::create(&path, config.clone()).expect("create");
            let v = pool.create_volume("v", BLOCKS * 4096).expect("volume");
            write_noise(&v, 0..4, 1);
            pool.create_snapshot("v", "s").expect("snapshot");
            drop(pool.clone_volume("v@s", "c").expect("clone"));
            write_noise(&v, 0..BLOCKS, 100);
            pool.sync().expect("sync");
            assert_eq!(pool.stats().unique_chunks, BLOCKS + 4);
            let stack = v.state().map.lock().stack.clone();
            let (snapshot_layer, top) = (stack[0].layer, stack[1].layer);
            drop(v);
            pool.delete_volume("v")
                .expect("delete the volume and its snapshot");
            pool.verify().expect("verify with the dropped layer listed");
            assert_eq!(listed_now(&pool.inner), vec![top], "only the private layer");
            assert_eq!(
                pool.stats().unique_chunks,
                BLOCKS + 4,
                "the dropped layer's entries keep their chunks"
            );
            if reopen {
                pool.close().expect("close");
                pool = Pool::open(&path, config.clone()).expect("reopen");
                assert_eq!(listed_now(&pool.inner), vec![top], "listed after a reopen");
                pool.verify().expect("verify after the reopen");
            }
            let inner = pool.inner.clone();
            let never = AtomicBool::new(false);
            // A commit asked for: one step, then the background thread commits.
            inner.wake_background();
            let step = inner
                .discard_abandoned_layers(&never, true)
                .expect("discard yielding");
            assert_eq!(step, 7, "one step of 7 entries");
            assert_eq!(listed_now(&inner), vec![top]);
            pool.verify().expect("verify part way");
            let rest = inner.discard_now().expect("discard the rest");
            assert_eq!(step + rest, BLOCKS, "every entry of the layer deleted once");
            assert!(listed_now(&inner).is_empty());
            pool.sync().expect("sync");
            assert_eq!(pool.stats().unique_chunks, 4, "only the clone's chunks");
            let refs = inner
                .db
                .read()
                .expect("read")
                .get(meta::LAYERS, &snapshot_layer);
            assert_eq!(refs.expect("layers"), Some(1), "the clone's reference");
            let snap = pool.volume("c").expect("the clone");
            let mut block = vec![0u8; 4096];
            snap.read(3 * 4096, &mut block).expect("read");
            assert_eq!(block, noise_block(4), "reopen: {reopen}");
            pool.verify().expect("verify after the discard");
            drop((snap, inner));
            pool.close().expect("close");
        }
    }

    /// The entries of `layer` in the last committed state.
    fn entries_of(inner: &Inner, layer: u64) -> usize {
        map_table::layer_entries(&inner.db.read().expect("read"), layer)
            .expect("entries")
            .len()
    }

    /// A volume deleted with a zeroed range over its committed data still pending: the
    /// deletion's commit does not settle the range (which costs its entries) but leaves them
    /// to the discard — only a block written inside the range after the zero (its committed
    /// entry's reference dropped there, the new entry written) and a block written before the
    /// zero (its committed entry's reference already dropped by that write: removed without
    /// dropping it again) are settled — and every chunk reference is dropped exactly once.
    #[test]
    fn a_volume_deleted_under_a_pending_zero_leaves_its_entries_to_the_discard() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = steps_of_7();
        let pool = Pool::create(dir.path().join("pool"), config).expect("create");
        let v = pool.create_volume("v", BLOCKS * 4096).expect("volume");
        write_noise(&v, 0..BLOCKS, 1);
        pool.sync().expect("sync");
        let top = v.state().map.lock().stack[0].layer;
        assert_eq!(entries_of(&pool.inner, top), BLOCKS as usize);
        v.write(5 * 4096, &noise_block(500), false)
            .expect("write before the zero");
        v.write_zeroes(0, BLOCKS * 4096, false).expect("zero");
        v.write(7 * 4096, &noise_block(700), false)
            .expect("write inside the range");
        drop(v);
        pool.delete_volume("v").expect("delete");
        assert_eq!(listed_now(&pool.inner), vec![top]);
        assert_eq!(
            entries_of(&pool.inner, top),
            BLOCKS as usize - 1,
            "only block 5's entry went in the deletion's commit"
        );
        pool.verify()
            .expect("verify with the range left to the discard");
        pool.sync().expect("sync: discard and fold");
        assert!(listed_now(&pool.inner).is_empty());
        assert_eq!(pool.stats().unique_chunks, 0, "every chunk freed once");
        pool.verify().expect("verify after the discard");
    }
}
