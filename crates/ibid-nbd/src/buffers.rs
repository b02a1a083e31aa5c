//! Payload buffers (write data and read replies), kept for reuse by a connection.
//!
//! A fresh 1 MiB allocation per write is new memory for the allocator more often than not (the
//! buffer is filled on the connection's I/O thread and freed on a worker thread), so the kernel
//! faults it in and zeroes it page by page while the payload is read from the socket: an
//! eighth of the server's CPU in a profile of 1 MiB writes. A read's reply buffer was a zeroed
//! allocation the backend then overwrote: 2–3 % of the server's CPU in a database mix of 32 KiB
//! reads and writes. Buffers given back here are reused while warm, and keep their bytes: a
//! reply buffer taken with [`Buffers::take_filled`] is zeroed only past what its earlier use
//! had written.

use std::sync::Mutex;

/// Buffers larger than this are not kept (rare: most clients write at most 1–4 MiB at once).
const KEPT_CAPACITY_MAX: usize = 4 << 20;
/// Bytes of spare buffers a connection keeps at most (room for 16 writes of 1 MiB in flight,
/// or 4 of 4 MiB): what an idle connection holds on to, outside its in-flight budget.
const KEPT_BYTES_MAX: usize = 16 << 20;

/// A connection's spare payload buffers. A kept buffer's length is how many of its bytes
/// are initialized (what its last use wrote), so a filled one can be handed out without
/// zeroing them again.
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
        let mut buf = self.kept(len).unwrap_or_else(|| Vec::with_capacity(len));
        buf.clear();
        buf
    }

    /// A buffer of exactly `len` bytes whose contents are unspecified (an earlier payload's,
    /// or zeros): for a reply the backend overwrites whole. A kept one is zeroed only past
    /// the bytes it held; a new one is a zeroed allocation.
    pub(crate) fn take_filled(&self, len: usize) -> Vec<u8> {
        if len == 0 {
            return Vec::new();
        }
        match self.kept(len) {
            Some(mut buf) => {
                buf.resize(len, 0);
                buf
            }
            None => vec![0; len],
        }
    }

    /// A kept buffer with room for `len` bytes, taken out of the free list.
    fn kept(&self, len: usize) -> Option<Vec<u8>> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let at = free.iter().position(|b| b.capacity() >= len);
        at.map(|i| free.swap_remove(i))
    }

    /// Gives `buf` back, with its bytes, for a later [`Buffers::take`] or
    /// [`Buffers::take_filled`] (dropped if it is too large to keep or enough are kept).
    pub(crate) fn give(&self, buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > KEPT_CAPACITY_MAX {
            return;
        }
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
        assert!(b.take_filled(0).is_empty());
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

    #[test]
    fn a_filled_buffer_keeps_its_bytes_and_zeroes_only_past_them() {
        let b = Buffers::default();
        let fresh = b.take_filled(8192);
        assert_eq!(fresh.len(), 8192);
        assert!(fresh.iter().all(|&x| x == 0), "a new buffer is zeroed");
        let mut used = fresh;
        used[..4096].fill(0xab);
        used.truncate(4096);
        used.reserve_exact(16384 - used.len());
        let ptr = used.as_ptr();
        b.give(used);
        let again = b.take_filled(12288);
        assert_eq!(again.as_ptr(), ptr, "the kept buffer is reused");
        assert_eq!(again.len(), 12288);
        assert!(again[..4096].iter().all(|&x| x == 0xab), "its bytes stay");
        assert!(again[4096..].iter().all(|&x| x == 0), "past them: zeros");
        b.give(again);
        let shorter = b.take_filled(100);
        assert_eq!((shorter.as_ptr(), shorter.len()), (ptr, 100));
        b.give(shorter);
        assert!(b.take(10).is_empty(), "a payload buffer comes back empty");
    }
}
