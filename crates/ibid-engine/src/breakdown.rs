//! Where the pool's physical data bytes went, by sharing (issue 34's capacity bar): a walk
//! of every live volume's map and one scan of the chunk table, in one read transaction.
//!
//! The engine keeps no running count of this: a chunk's reference count says how many map
//! entries name it, not whether those entries are seen by a volume or only by snapshots,
//! nor whether a layer is shared by fast clones. So the figures are computed on demand
//! ([`Pool::space_breakdown`]) and callers cache them (the server refreshes them in the
//! background and shows their age). Cost: O(live volumes' mapped blocks) map entries read
//! plus one pass over the chunk table, and about 40 bytes of memory per distinct chunk a
//! volume shows, freed at the end — in passes over classes of chunk ids when the pool holds
//! more than [`PASS_CHUNKS_MAX`] chunks (each pass walks the maps again: time grows with
//! the passes, memory does not).
//!
//! Every live chunk falls in exactly one class, so the three sums add up to
//! [`PoolStats::physical_bytes`](crate::PoolStats) on a quiet pool:
//! - **unique**: shown by one live volume only, and every reference to it is a block of that
//!   volume in a layer no other stack (snapshot or clone) includes: deleting or overwriting
//!   the volume's blocks frees it. Per volume this is `Volume::space`'s *exclusive* figure.
//! - **shared**: shown by a live volume, and also referenced elsewhere: deduplicated blocks,
//!   range copies, full and fast clones, and data a snapshot still sees too.
//! - **snapshot-only**: shown by no live volume: kept by snapshots alone, or by map entries
//!   no stack shows — a deleted snapshot's layer that the volume overwrote, until the
//!   background flattening merges it (seconds), or entries the windows of range-copied frames
//!   hide, or a deleted volume's or snapshot's layer whose entries the background is still
//!   deleting (`copy/layer_build.rs`; [`Pool::sync`] finishes it);
//!   deleting snapshots (and that merging) is what frees it. Under load it also holds
//!   chunks overwrites left with no reference that a commit has not freed yet (their
//!   reference changes wait in the log, `ref_log.rs`; a quiet pool folds it within seconds).

use crate::error::Result;
use crate::format::{self, Frame, BLOCK_BYTES};
use crate::meta;
use crate::pool::Pool;
use crate::store::Reader;
use rustc_hash::FxHashMap;

/// Most chunks one pass keeps track of (~40 bytes each: ~160 MiB); a larger pool is
/// walked in several passes, each for a class of chunk ids.
#[cfg(not(test))]
const PASS_CHUNKS_MAX: u64 = 4 << 20;
/// Small in tests, so that they cover several passes.
#[cfg(test)]
const PASS_CHUNKS_MAX: u64 = 7;

/// The pool's physical data bytes split by sharing; see the module documentation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpaceBreakdown {
    /// Bytes (in segment files) of chunks only one volume holds.
    pub unique_physical_bytes: u64,
    /// Their number.
    pub unique_chunks: u64,
    /// Bytes of chunks a volume shows and something else references too.
    pub shared_physical_bytes: u64,
    /// Their number.
    pub shared_chunks: u64,
    /// Bytes of chunks no live volume shows: only snapshots keep them.
    pub snapshot_only_physical_bytes: u64,
    /// Their number.
    pub snapshot_only_chunks: u64,
    /// Per live volume, by name: its exclusive figures (as `Volume::space` counts them).
    pub volumes: Vec<VolumeShare>,
}

/// One volume's part of a [`SpaceBreakdown`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeShare {
    /// Volume name.
    pub name: String,
    /// Volume id (a name can be reused after a delete; an id is not).
    pub id: u64,
    /// Blocks mapped to data (as committed).
    pub mapped_blocks: u64,
    /// Blocks whose chunk only this volume holds (in layers only it includes).
    pub exclusive_blocks: u64,
    /// `mapped - exclusive`.
    pub shared_blocks: u64,
    /// Physical bytes of the chunks only this volume holds.
    pub exclusive_physical_bytes: u64,
}

/// What the walk learned of one chunk a live volume shows.
#[derive(Clone, Copy)]
struct Seen {
    /// Index of the one volume showing it, or [`MANY`].
    owner: u32,
    /// Blocks of that volume showing it.
    blocks: u64,
    /// Some block shows it through a layer another frame or stack also includes.
    via_shared_layer: bool,
}

const MANY: u32 = u32::MAX;

impl Pool {
    /// Splits the physical data bytes into unique, shared and snapshot-only (module
    /// documentation), as of the last commit. Costs a walk of every live volume's map: call
    /// it in the background, not per request.
    pub fn space_breakdown(&self) -> Result<SpaceBreakdown> {
        let inner = &*self.inner;
        // Stacks change only with the commit lock held: stacks and store read under it agree.
        let (stacks, txn) = {
            let _commit = inner.commit.lock();
            let stacks: Vec<(String, u64, Vec<Frame>, u64)> = inner
                .catalog
                .volumes()
                .iter()
                .map(|v| {
                    let m = v.map.lock();
                    (v.name.clone(), v.id, m.stack.clone(), m.size)
                })
                .collect();
            (stacks, inner.db.read()?)
        };
        let mut out = SpaceBreakdown {
            volumes: stacks
                .iter()
                .map(|(name, id, _, _)| VolumeShare {
                    name: name.clone(),
                    id: *id,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        // Memory is bounded by splitting the chunks into `passes` classes by id, each pass
        // walking every map again for its own class.
        let passes = inner.stats().unique_chunks.div_ceil(PASS_CHUNKS_MAX).max(1);
        let logged = crate::ref_log::pending(&txn)?;
        for pass in 0..passes {
            self.breakdown_pass(&txn, &stacks, &logged, (pass, passes), &mut out)?;
        }
        for v in &mut out.volumes {
            v.shared_blocks = v.mapped_blocks - v.exclusive_blocks;
        }
        Ok(out)
    }

    /// One pass of [`Pool::space_breakdown`]: the chunks whose id is `pass.0` modulo `pass.1`
    /// (map entries counted in pass 0).
    fn breakdown_pass(
        &self,
        txn: &crate::store::ReadTxn,
        stacks: &[(String, u64, Vec<Frame>, u64)],
        logged: &FxHashMap<u64, i64>,
        pass: (u64, u64),
        out: &mut SpaceBreakdown,
    ) -> Result<()> {
        let inner = &*self.inner;
        let ours = |id: u64| id % pass.1 == pass.0;
        let mut seen: FxHashMap<u64, Seen> = FxHashMap::default();
        for (i, (_, _, stack, size)) in stacks.iter().enumerate() {
            // A frame's layer is shared when another stack, or another frame of this one,
            // includes it (the layer's reference count counts frames of every stack).
            let mut shared_frame = Vec::with_capacity(stack.len());
            for f in stack {
                let here = stack.iter().filter(|g| g.layer == f.layer).count() as u64;
                let refs = txn.get(meta::LAYERS, &f.layer)?.unwrap_or(0);
                shared_frame.push(refs > 1 || here > 1);
            }
            let mut mapped = 0u64;
            let blocks = size.div_ceil(BLOCK_BYTES as u64);
            let visit = |_b, id, frame: usize| {
                if id == format::ZERO_TOMBSTONE {
                    return;
                }
                mapped += 1;
                if !ours(id) {
                    return;
                }
                let s = seen.entry(id).or_insert(Seen {
                    owner: i as u32,
                    blocks: 0,
                    via_shared_layer: false,
                });
                if s.owner != i as u32 {
                    s.owner = MANY;
                }
                s.blocks += 1;
                s.via_shared_layer |= shared_frame[frame];
            };
            let filters = &inner.layer_filters;
            crate::volume::resolve_stored_each(txn, filters, stack, 0, blocks, visit)?;
            if pass.0 == 0 {
                out.volumes[i].mapped_blocks = mapped;
            }
        }
        crate::chunk_table::for_each(txn, |id, rec| {
            if !ours(id) {
                return Ok(());
            }
            let bytes = rec.physical_bytes();
            let refs = (rec.refs as i64 + logged.get(&id).copied().unwrap_or(0)) as u64;
            match seen.get(&id) {
                None => {
                    out.snapshot_only_physical_bytes += bytes;
                    out.snapshot_only_chunks += 1;
                }
                Some(s) if s.owner != MANY && !s.via_shared_layer && refs == s.blocks => {
                    out.unique_physical_bytes += bytes;
                    out.unique_chunks += 1;
                    let v = &mut out.volumes[s.owner as usize];
                    v.exclusive_blocks += s.blocks;
                    v.exclusive_physical_bytes += bytes;
                }
                Some(_) => {
                    out.shared_physical_bytes += bytes;
                    out.shared_chunks += 1;
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::SpaceBreakdown;
    use crate::{Pool, PoolConfig};
    use std::collections::{BTreeMap, BTreeSet};

    const B: usize = 4096;

    /// A block no other call returns (so never deduplicated), or `shared(n)`'s content.
    fn block(tag: u64) -> Vec<u8> {
        let mut b = vec![0u8; B];
        for (i, w) in b.chunks_mut(8).enumerate() {
            w.copy_from_slice(&(tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64).to_le_bytes());
        }
        b
    }

    /// The model: which contents each live volume and each snapshot shows, block by block.
    /// A content shown by no live volume is snapshot-only; by one volume only (at one block
    /// or several: deduplicated within the volume), at blocks of its own top layers (no
    /// snapshot or clone sees that data), unique; else shared.
    #[derive(Default)]
    struct Model {
        live: BTreeMap<String, BTreeMap<u64, u64>>,
        snaps: BTreeMap<String, BTreeMap<u64, u64>>,
        /// Volumes whose current data a snapshot or clone also includes by layer (until
        /// overwritten): block -> content at the time.
        frozen: BTreeMap<String, BTreeMap<u64, u64>>,
    }

    impl Model {
        fn expect(&self) -> (u64, u64, u64) {
            let mut by_content: BTreeMap<u64, BTreeSet<&str>> = BTreeMap::new();
            let mut all = BTreeSet::new();
            for (v, m) in &self.live {
                for &c in m.values() {
                    by_content.entry(c).or_default().insert(v);
                    all.insert(c);
                }
            }
            for m in self.snaps.values() {
                all.extend(m.values().copied());
            }
            let (mut u, mut s, mut o) = (0, 0, 0);
            for c in all {
                match by_content.get(&c) {
                    None => o += 1,
                    Some(owners) if owners.len() == 1 => {
                        let in_frozen = self.frozen.values().any(|m| m.values().any(|&x| x == c))
                            || self.snaps.values().any(|m| m.values().any(|&x| x == c));
                        if in_frozen {
                            s += 1
                        } else {
                            u += 1
                        }
                    }
                    Some(_) => s += 1,
                }
            }
            (u, s, o)
        }
    }

    fn check(pool: &Pool, model: &Model) -> SpaceBreakdown {
        pool.sync().expect("sync");
        let got = pool.space_breakdown().expect("breakdown");
        let (u, s, o) = model.expect();
        assert_eq!(
            (
                got.unique_chunks,
                got.shared_chunks,
                got.snapshot_only_chunks
            ),
            (u, s, o),
            "{got:?}"
        );
        let stats = pool.stats();
        assert_eq!(
            got.unique_physical_bytes
                + got.shared_physical_bytes
                + got.snapshot_only_physical_bytes,
            stats.physical_bytes
        );
        assert_eq!(
            got.unique_chunks + got.shared_chunks + got.snapshot_only_chunks,
            stats.unique_chunks
        );
        // Per volume, the same exclusive figures as `Volume::space`'s walk.
        for v in &got.volumes {
            let space = pool
                .volume(&v.name)
                .expect("volume")
                .space()
                .expect("space");
            assert_eq!(v.mapped_blocks, space.mapped_blocks, "{}", v.name);
            assert_eq!(v.exclusive_blocks, space.exclusive_blocks, "{}", v.name);
            assert_eq!(v.shared_blocks, space.shared_blocks, "{}", v.name);
            assert_eq!(
                v.exclusive_physical_bytes, space.exclusive_physical_bytes,
                "{}",
                v.name
            );
        }
        got
    }

    #[test]
    fn breakdown_matches_a_model_of_who_shows_what() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = Pool::create(dir.path().join("p"), PoolConfig::default()).expect("create");
        let mut m = Model::default();
        let write = |m: &mut Model, vol: &str, at: u64, content: u64| {
            let v = pool.volume(vol).expect("volume");
            v.write(at * B as u64, &block(content), false)
                .expect("write");
            m.live.get_mut(vol).expect("live").insert(at, content);
            if let Some(f) = m.frozen.get_mut(vol) {
                f.remove(&at);
            }
        };
        for name in ["a", "b"] {
            pool.create_volume(name, 1 << 20).expect("create");
            m.live.insert(name.into(), BTreeMap::new());
        }
        check(&pool, &m);
        // Unique data in both; a content written twice in `a` and once in `b` (deduplicated).
        for i in 0..8 {
            write(&mut m, "a", i, 100 + i);
            write(&mut m, "b", i, 200 + i);
        }
        write(&mut m, "a", 10, 7);
        write(&mut m, "a", 11, 7);
        write(&mut m, "b", 12, 8);
        write(&mut m, "b", 13, 8);
        write(&mut m, "a", 14, 9);
        write(&mut m, "b", 14, 9);
        let got = check(&pool, &m);
        // 16 contents written once, and one written twice in `a` (still `a`'s alone) and one
        // twice in `b`; the one both volumes hold is shared.
        assert_eq!((got.unique_chunks, got.shared_chunks), (18, 1), "{got:?}");
        assert_eq!(got.snapshot_only_chunks, 0);

        // A snapshot of `a`: its data is now shared with the snapshot; overwriting two blocks
        // leaves their old contents to the snapshot alone, the new ones unique.
        pool.create_snapshot("a", "s1").expect("snapshot");
        m.snaps.insert("a@s1".into(), m.live["a"].clone());
        m.frozen.insert("a".into(), m.live["a"].clone());
        write(&mut m, "a", 0, 300);
        write(&mut m, "a", 1, 301);
        let got = check(&pool, &m);
        assert_eq!(got.snapshot_only_chunks, 2, "{got:?}");

        // Deleting the snapshot (and flattening) gives the volume its data back.
        pool.delete_snapshot("a", "s1").expect("delete snapshot");
        m.snaps.clear();
        m.frozen.clear();
        pool.gc_now().expect("gc");
        let got = check(&pool, &m);
        assert_eq!(got.snapshot_only_chunks, 0, "{got:?}");

        // A fast clone of `b` shares everything `b` had; writes to either are theirs alone.
        pool.clone_volume("b", "c").expect("clone");
        m.live.insert("c".into(), m.live["b"].clone());
        m.frozen.insert("b".into(), m.live["b"].clone());
        m.frozen.insert("c".into(), m.live["b"].clone());
        write(&mut m, "c", 20, 400);
        write(&mut m, "b", 21, 401);
        check(&pool, &m);

        // A snapshot of a new volume, then one block overwritten: its old content is the
        // snapshot's alone.
        pool.create_volume("d", 1 << 20).expect("create d");
        m.live.insert("d".into(), BTreeMap::new());
        for i in 0..4 {
            write(&mut m, "d", i, 500 + i);
        }
        pool.create_snapshot("d", "keep").expect("snapshot d");
        m.snaps.insert("d@keep".into(), m.live["d"].clone());
        m.frozen.insert("d".into(), m.live["d"].clone());
        write(&mut m, "d", 0, 600);
        let got = check(&pool, &m);
        assert_eq!(got.snapshot_only_chunks, 1, "{got:?}");
    }
}
