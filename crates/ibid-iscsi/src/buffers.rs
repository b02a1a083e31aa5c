//! Read buffers reused from command to command.
//!
//! A READ's data goes from the backend into a buffer and from the buffer to the socket. A
//! fresh buffer for every command costs zeroing it (and, for large ones, page faults) before
//! the backend overwrites every byte anyway: about 5 % of the target's time in sequential
//! 1 MiB reads, and a tenth of its CPU per byte in random 32 KiB reads from the read cache
//! (docs/BENCHMARKS.md, "Copies and zeroing cut from reads and flushes"). Buffers come back
//! here once their
//! Data-In is sent, and a later READ reuses one with room for it; its old content is never
//! sent, because the backend fills the part that is ([`crate::Lun::read`] writes all of `buf`
//! or fails, and a failed read sends no data). A kept buffer keeps its bytes (its length is
//! what its last use wrote), so a reused one is zeroed only past them.

use parking_lot::Mutex;

/// Buffers kept at most, of each size class.
const KEPT_MAX: usize = 64;
/// Smallest buffer kept (one block).
const KEEP_MIN: usize = 4 << 10;
/// Buffers smaller than this are kept apart from larger ones, so that a burst of small reads
/// does not fill the pool and leave large reads to fresh allocations.
const SMALL_BELOW: usize = 64 << 10;
/// Largest buffer kept (a READ's largest transfer is bigger, and rare).
const KEEP_MAX: usize = 4 << 20;

/// The pool.
#[derive(Default)]
pub struct Buffers {
    /// Kept buffers of less than [`SMALL_BELOW`] bytes of room.
    small: Mutex<Vec<Vec<u8>>>,
    /// Kept buffers of [`SMALL_BELOW`] bytes of room or more.
    large: Mutex<Vec<Vec<u8>>>,
}

impl Buffers {
    /// The kept buffers of the size class of `size` bytes.
    fn class(&self, size: usize) -> &Mutex<Vec<Vec<u8>>> {
        if size < SMALL_BELOW {
            &self.small
        } else {
            &self.large
        }
    }

    /// A buffer of exactly `len` bytes, contents unspecified (the caller overwrites them all).
    pub fn take(&self, len: usize) -> Vec<u8> {
        if (KEEP_MIN..=KEEP_MAX).contains(&len) {
            let mut free = self.class(len).lock();
            if let Some(i) = free.iter().position(|b| b.capacity() >= len) {
                let mut buf = free.swap_remove(i);
                drop(free);
                buf.resize(len, 0);
                return buf;
            }
        }
        vec![0u8; len]
    }

    /// Returns a buffer, with its bytes, for later reads.
    pub fn give(&self, buf: Vec<u8>) {
        if (KEEP_MIN..=KEEP_MAX).contains(&buf.capacity()) {
            let mut free = self.class(buf.capacity()).lock();
            if free.len() < KEPT_MAX {
                free.push(buf);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A returned buffer serves a later request it has room for, with exactly the length asked
    /// and its bytes kept (zeros only past them); tiny and oversized buffers are not kept.
    #[test]
    fn reuse() {
        let b = Buffers::default();
        let mut one = b.take(1 << 20);
        one[0] = 7;
        let ptr = one.as_ptr();
        b.give(one);
        let mut again = b.take(512 << 10);
        assert_eq!(again.len(), 512 << 10);
        assert_eq!(again.as_ptr(), ptr, "reused");
        assert_eq!(again[0], 7, "its bytes are kept");
        b.give(again);
        again = b.take(1 << 20);
        assert_eq!((again.as_ptr(), again.len()), (ptr, 1 << 20));
        assert!(
            again[512 << 10..].iter().all(|&x| x == 0),
            "zeros past them"
        );
        b.give(vec![0; 512]);
        b.give(vec![0; 8 << 20]);
        assert!(b.small.lock().is_empty() && b.large.lock().is_empty());
    }

    /// Small buffers are kept apart: a burst of them leaves room for large ones, and a small
    /// read reuses a small buffer.
    #[test]
    fn small_buffers_do_not_crowd_out_large_ones() {
        let b = Buffers::default();
        for _ in 0..2 * KEPT_MAX {
            b.give(vec![1u8; 32 << 10]);
        }
        assert_eq!(b.small.lock().len(), KEPT_MAX);
        let large = b.take(1 << 20);
        let ptr = large.as_ptr();
        b.give(large);
        let again = b.take(1 << 20);
        assert_eq!(again.as_ptr(), ptr, "the large buffer was kept");
        let small = b.take(16 << 10);
        assert_eq!(small.len(), 16 << 10);
        assert!(
            small.iter().all(|&x| x == 1),
            "a kept small buffer, its bytes kept"
        );
        assert_eq!(b.small.lock().len(), KEPT_MAX - 1);
    }
}
