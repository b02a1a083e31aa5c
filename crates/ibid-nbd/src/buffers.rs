//! Write payload buffers, kept for reuse by a connection.
//!
//! A fresh 1 MiB allocation per write is new memory for the allocator more often than not (the
//! buffer is filled on the connection's I/O thread and freed on a worker thread), so the kernel
//! faults it in and zeroes it page by page while the payload is read from the socket: an
//! eighth of the server's CPU in a profile of 1 MiB writes. Buffers given back here are
//! reused while warm.

use std::sync::Mutex;

/// Buffers larger than this are not kept (rare: most clients write at most 1–4 MiB at once).
const KEPT_CAPACITY_MAX: usize = 4 << 20;
/// Bytes of spare buffers a connection keeps at most (room for 16 writes of 1 MiB in flight,
/// or 4 of 4 MiB): what an idle connection holds on to, outside its in-flight budget.
const KEPT_BYTES_MAX: usize = 16 << 20;

/// A connection's spare payload buffers.
#[derive(Default)]
pub(crate) struct Buffers {
    free: Mutex<Vec<Vec<u8>>>,
}

impl Buffers {
    /// An empty buffer with room for `len` bytes: a kept one if one is large enough.
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
        if len == 0 {
            return Vec::new();
        }
        let kept = {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            let at = free.iter().position(|b| b.capacity() >= len);
            at.map(|i| free.swap_remove(i))
        };
        kept.unwrap_or_else(|| Vec::with_capacity(len))
    }

    /// Gives `buf` back for a later [`Buffers::take`] (dropped if it is too large to keep or
    /// enough are kept).
    pub(crate) fn give(&self, mut buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > KEPT_CAPACITY_MAX {
            return;
        }
        buf.clear();
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let kept: usize = free.iter().map(Vec::capacity).sum();
        if kept + buf.capacity() <= KEPT_BYTES_MAX {
            free.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_empty_and_large_ones_are_not_kept() {
        let b = Buffers::default();
        let mut one = b.take(1 << 20);
        one.extend_from_slice(&[7u8; 1000]);
        let ptr = one.as_ptr();
        b.give(one);
        let again = b.take(4096);
        assert_eq!(again.as_ptr(), ptr, "the kept buffer is reused");
        assert!(again.is_empty() && again.capacity() >= 1 << 20);
        // Too small for the next request: a new one.
        b.give(again);
        assert!(b.take(2 << 20).capacity() >= 2 << 20);
        assert_eq!(b.free.lock().expect("lock").len(), 1);
        assert_eq!(b.take(0).capacity(), 0, "no payload, no buffer");
        b.give(Vec::with_capacity(KEPT_CAPACITY_MAX + 1));
        assert_eq!(
            b.free.lock().expect("lock").len(),
            1,
            "a buffer over the limit is dropped"
        );
        for _ in 0..2 * KEPT_BYTES_MAX / KEPT_CAPACITY_MAX {
            b.give(Vec::with_capacity(KEPT_CAPACITY_MAX));
        }
        let kept: usize = b.free.lock().expect("lock").iter().map(Vec::capacity).sum();
        assert!(
            kept <= KEPT_BYTES_MAX && kept + KEPT_CAPACITY_MAX > KEPT_BYTES_MAX,
            "kept {kept} bytes"
        );
    }
}
