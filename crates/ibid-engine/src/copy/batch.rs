//! Range copies in flight: the order between them, and the queue in which copies by frames
//! wait to be applied together (see `mod.rs`).

use crate::error::Result;
use crate::volume_state::VolumeState;
use parking_lot::{Condvar, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// Most copies applied together in one catalog transaction.
const BATCH_COPIES_MAX: usize = 64;

/// What makes concurrent range copies behave as if applied one after the other.
///
/// Copies by frames alone hold [`Copies::framing`] (shared) and queue here; one at a time
/// leads: it takes the commit lock and applies its own copy and the waiting ones that do not
/// conflict with it together (see [`crate::inner::Inner::copy_by_frames`]), and the others
/// wait for it. Every other copy (bytes copied as data at unaligned edges, block references
/// shared) reads its source and writes its destination in several steps, so it holds
/// [`Copies::exclusive`] for the whole copy.
#[derive(Default)]
pub(crate) struct Copies {
    queue: Mutex<Queued>,
    /// Signalled when a batch is applied.
    finished: Condvar,
    /// Shared by copies by frames, exclusive for every other copy.
    order: RwLock<()>,
}

#[derive(Default)]
struct Queued {
    next_id: u64,
    waiting: Vec<CopyRequest>,
    done: FxHashMap<u64, Result<bool>>,
    /// A copy is applying a batch: the others wait for [`Copies::finished`].
    leading: bool,
}

/// One range copy by frames: blocks `[sb, sb + n)` of `src` to `[db, db + n)` of `dst`.
pub(super) struct CopyRequest {
    pub id: u64,
    pub src: Arc<VolumeState>,
    pub sb: u64,
    pub dst: Arc<VolumeState>,
    pub db: u64,
    pub n: u64,
}

impl CopyRequest {
    /// Whether applying `self` and `other` together could differ from applying them one
    /// after the other: one's destination window meets the other's source or destination.
    /// Copies that do not conflict commute, and each sees its source as before both.
    pub(super) fn conflicts(&self, other: &CopyRequest) -> bool {
        let meets =
            |a: &Arc<VolumeState>, a0: u64, b: &Arc<VolumeState>, b0: u64, n: u64, m: u64| {
                Arc::ptr_eq(a, b) && a0 < b0 + m && b0 < a0 + n
            };
        meets(&self.dst, self.db, &other.dst, other.db, self.n, other.n)
            || meets(&self.dst, self.db, &other.src, other.sb, self.n, other.n)
            || meets(&self.src, self.sb, &other.dst, other.db, self.n, other.n)
    }

    /// Whether the copy reads or writes the volume or snapshot called `name`.
    pub(super) fn involves(&self, name: &str) -> bool {
        self.src.name == name || self.dst.name == name
    }
}

impl Copies {
    /// Held by a copy made by frames alone, for the whole copy.
    pub(crate) fn framing(&self) -> RwLockReadGuard<'_, ()> {
        self.order.read()
    }

    /// Held by any other copy, for the whole copy: no other copy runs meanwhile.
    pub(crate) fn exclusive(&self) -> RwLockWriteGuard<'_, ()> {
        self.order.write()
    }

    /// Queues a copy; returns its id.
    pub(super) fn enqueue(
        &self,
        src: &Arc<VolumeState>,
        sb: u64,
        dst: &Arc<VolumeState>,
        db: u64,
        n: u64,
    ) -> u64 {
        let mut q = self.queue.lock();
        let id = q.next_id;
        q.next_id += 1;
        q.waiting.push(CopyRequest {
            id,
            src: src.clone(),
            sb,
            dst: dst.clone(),
            db,
            n,
        });
        id
    }

    /// Waits until copy `id` has been applied in another copy's batch, or until no batch is
    /// being applied: then the caller leads.
    pub(super) fn await_turn(&self, id: u64) -> Turn<'_> {
        let mut q = self.queue.lock();
        loop {
            if let Some(done) = q.done.remove(&id) {
                return Turn::Done(done);
            }
            if !q.leading {
                q.leading = true;
                return Turn::Lead(Leading(self));
            }
            self.finished.wait(&mut q);
        }
    }

    /// Takes copy `id` and, in arrival order, each waiting copy that conflicts with none taken
    /// before it, up to [`BATCH_COPIES_MAX`]; `id` first. Call leading, with the commit lock
    /// held (copies queued while it was awaited join).
    pub(super) fn take_batch(&self, id: u64) -> Vec<CopyRequest> {
        let mut q = self.queue.lock();
        let at = q
            .waiting
            .iter()
            .position(|c| c.id == id)
            .expect("a copy not done is waiting");
        let mut batch = vec![q.waiting.remove(at)];
        let mut i = 0;
        while i < q.waiting.len() && batch.len() < BATCH_COPIES_MAX {
            if batch.iter().any(|c| c.conflicts(&q.waiting[i])) {
                i += 1;
            } else {
                batch.push(q.waiting.remove(i));
            }
        }
        batch
    }

    /// Records outcomes for the copies that wait for them.
    pub(super) fn finish(&self, outcomes: Vec<(u64, Result<bool>)>) {
        self.queue.lock().done.extend(outcomes);
    }
}

/// What a queued copy does next.
pub(super) enum Turn<'a> {
    /// Another copy's batch applied it: its outcome.
    Done(Result<bool>),
    /// Apply a batch.
    Lead(Leading<'a>),
}

/// The right to apply a batch; given up (and the waiting copies woken) when dropped, even by
/// a panic.
pub(super) struct Leading<'a>(&'a Copies);

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        self.0.queue.lock().leading = false;
        self.0.finished.notify_all();
    }
}
