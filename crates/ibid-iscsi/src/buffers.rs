//! Read buffers reused from command to command.
//!
//! A READ's data goes from the backend into a buffer and from the buffer to the socket. A
//! fresh buffer for every command costs zeroing it (and, for large ones, page faults) before
//! the backend overwrites every byte anyway: about 5 % of the target's time in sequential
//! 1 MiB reads. Buffers come back here once their Data-In is sent, and a later READ of at most
//! their length reuses one; its old content is never sent, because the backend fills the part
//! that is ([`crate::Lun::read`] writes all of `buf` or fails, and a failed read sends no data).

use parking_lot::Mutex;

/// Buffers kept at most.
const KEPT_MAX: usize = 64;
/// Smallest buffer worth keeping: below it, zeroing costs less than the pool's lock.
const KEEP_MIN: usize = 64 << 10;
/// Largest buffer kept (a READ's largest transfer is bigger, and rare).
const KEEP_MAX: usize = 4 << 20;

/// The pool.
#[derive(Default)]
pub struct Buffers {
    free: Mutex<Vec<Vec<u8>>>,
}

impl Buffers {
    /// A buffer of exactly `len` bytes, contents unspecified (the caller overwrites them all).
    pub fn take(&self, len: usize) -> Vec<u8> {
        if len >= KEEP_MIN {
            let mut free = self.free.lock();
            if let Some(i) = free.iter().position(|b| b.len() >= len) {
                let mut buf = free.swap_remove(i);
                drop(free);
                buf.truncate(len);
                return buf;
            }
        }
        vec![0u8; len]
    }

    /// Returns a buffer for later reads.
    pub fn give(&self, buf: Vec<u8>) {
        if (KEEP_MIN..=KEEP_MAX).contains(&buf.len()) {
            let mut free = self.free.lock();
            if free.len() < KEPT_MAX {
                free.push(buf);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A returned buffer serves a later request of at most its length, with exactly the length
    /// asked; small and oversized buffers are not kept.
    #[test]
    fn reuse() {
        let b = Buffers::default();
        let mut one = b.take(1 << 20);
        one[0] = 7;
        let ptr = one.as_ptr();
        b.give(one);
        let again = b.take(512 << 10);
        assert_eq!(again.len(), 512 << 10);
        assert_eq!(again.as_ptr(), ptr, "reused");
        b.give(vec![0; 4096]);
        b.give(vec![0; 8 << 20]);
        assert!(b.free.lock().is_empty());
    }
}
