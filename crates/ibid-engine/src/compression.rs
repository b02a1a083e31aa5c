//! LZ4 compression of one block into a per-thread scratch buffer.
//!
//! The buffer is larger than one block's worst case by a page, and each call places its output
//! window half a page away from the block's own address modulo 4 KiB. An incompressible block
//! ends with one copy of its whole contents to the output, 18 bytes past the window's start
//! (the token and the length bytes); when that destination sits just ahead of the source modulo
//! 4 KiB, each load waits on the store before it (4K aliasing): on the AMD EPYC hosts this
//! project measures on, a 4 KiB `memcpy` just ahead takes ~3× as long (242–345 vs ~100 ns,
//! `bench/nbd-fio/probes/memcpy-alias.c`),
//! and that copy was 14 % of the server's samples under unique 1 MiB writes.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::format::BLOCK_BYTES;

/// Incompressible new blocks in a row after which a write tries only a sample of the rest.
pub(crate) const STREAK_MIN: u32 = 16;
/// Past the streak, one new block in this many is tried; the others are stored as they are.
pub(crate) const SAMPLE_EVERY: u32 = 8;

/// The page size the skew is computed against (the low address bits loads and stores are
/// matched on).
const PAGE: usize = 4096;

/// Distance of the output window ahead of the source, modulo [`PAGE`].
const SKEW: usize = PAGE / 2;

/// One block's worst-case LZ4 output.
fn max_output() -> usize {
    lz4_flex::block::get_maximum_output_size(BLOCK_BYTES)
}

thread_local! {
    /// Each writing thread's output buffer for LZ4 attempts, so that compressing a block
    /// allocates nothing.
    static SCRATCH: RefCell<Vec<u8>> = RefCell::new(vec![0; max_output() + PAGE]);
}

/// The offset into a scratch buffer at `base` where the output window for a block at `source`
/// starts: [`SKEW`] bytes ahead of the source modulo [`PAGE`].
fn window_start(base: usize, source: usize) -> usize {
    (source + SKEW + PAGE - base % PAGE) % PAGE
}

/// Compresses `block` (one block) with LZ4 and calls `f` with the compressed bytes when they
/// are fewer than the block's, or with `None` when it does not compress.
pub(crate) fn with_compressed<R>(block: &[u8], f: impl FnOnce(Option<&[u8]>) -> R) -> R {
    debug_assert_eq!(block.len(), BLOCK_BYTES);
    SCRATCH.with_borrow_mut(|scratch| {
        let start = window_start(scratch.as_ptr() as usize, block.as_ptr() as usize);
        let window = &mut scratch[start..start + max_output()];
        match lz4_flex::block::compress_into(block, window) {
            Ok(n) if n < block.len() => f(Some(&window[..n])),
            _ => f(None),
        }
    })
}

/// How one write's new blocks compressed so far, shared by the threads preparing its blocks:
/// after [`STREAK_MIN`] incompressible blocks in a row, only every [`SAMPLE_EVERY`]th is
/// tried until one compresses, and then every block again.
///
/// An LZ4 attempt on an incompressible block costs about as much as its fingerprint (~1.2 µs
/// per 4 KiB here) and saves nothing: most of a stream of encrypted or already compressed data
/// skips it. The price is bounded: where such a stream turns compressible within one write,
/// at most `SAMPLE_EVERY - 1` blocks are stored uncompressed before the write notices (more
/// only if threads preparing other parts of the write keep failing meanwhile; the count is
/// shared without a lock, as a hint). Each write starts trying every block again, like btrfs'
/// heuristic per file, but without its permanent `nocompress` mark.
#[derive(Debug, Default)]
pub(crate) struct Attempts {
    /// Blocks since the last one that compressed (tried or not).
    misses: AtomicU32,
}

impl Attempts {
    /// [`with_compressed`], or `f(None)` without trying when the streak says to skip `block`.
    pub(crate) fn with_compressed<R>(&self, block: &[u8], f: impl FnOnce(Option<&[u8]>) -> R) -> R {
        let misses = self.misses.load(Ordering::Relaxed);
        let tried = misses < STREAK_MIN || (misses - STREAK_MIN) % SAMPLE_EVERY == SAMPLE_EVERY - 1;
        if !tried {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return f(None);
        }
        with_compressed(block, |c| {
            if c.is_some() {
                self.misses.store(0, Ordering::Relaxed);
            } else {
                self.misses.fetch_add(1, Ordering::Relaxed);
            }
            f(c)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_data::noise_block as noise;

    /// A run of incompressible blocks stops the attempts but for a sample; where the data
    /// turns compressible, the next sampled block finds it and every block is tried again.
    #[test]
    fn a_streak_of_noise_samples_and_compressible_data_resumes_the_attempts() {
        let attempts = Attempts::default();
        let text = b"all work and no play ".repeat(BLOCK_BYTES / 21 + 1);
        let text = &text[..BLOCK_BYTES];
        let compressed = |block: &[u8]| attempts.with_compressed(block, |c| c.is_some());
        for i in 0..STREAK_MIN as u64 {
            assert!(!compressed(&noise(i)));
        }
        // Past the streak: compressible blocks are stored as they are until a sampled one.
        let skipped = (0..).take_while(|_| !compressed(text)).count();
        assert_eq!(skipped as u32, SAMPLE_EVERY - 1);
        for _ in 0..3 * SAMPLE_EVERY {
            assert!(compressed(text), "every block is tried again");
        }
        // Noise again: STREAK_MIN tried, then one in SAMPLE_EVERY.
        for i in 0..(STREAK_MIN + 4 * SAMPLE_EVERY) as u64 {
            assert!(!compressed(&noise(100 + i)));
        }
        assert_eq!(
            attempts.misses.load(Ordering::Relaxed),
            STREAK_MIN + 4 * SAMPLE_EVERY
        );
    }

    #[test]
    fn the_window_is_half_a_page_ahead_of_the_source_and_inside_the_buffer() {
        for base in [0usize, 1, 18, 4095, 4096, 8192 + 77] {
            for source in [0usize, 1, 2048, 4078, 4096, 1 << 20, (1 << 20) + 4077] {
                let start = window_start(base, source);
                assert!(start < PAGE, "base {base} source {source}: start {start}");
                assert_eq!((base + start) % PAGE, (source + SKEW) % PAGE);
            }
        }
    }

    #[test]
    fn blocks_at_any_alignment_compress_to_what_decompresses_back() {
        let mut buf = vec![0u8; BLOCK_BYTES + PAGE];
        for (i, b) in buf.iter_mut().enumerate() {
            // The first half repeats a short pattern, the second is noise.
            *b = if i % BLOCK_BYTES < BLOCK_BYTES / 2 {
                (i % 7) as u8
            } else {
                (i.wrapping_mul(2_654_435_761) >> 13) as u8
            };
        }
        for offset in [0, 1, 17, 18, 64, 2048, 4095] {
            let block = &buf[offset..offset + BLOCK_BYTES];
            let out = with_compressed(block, |c| c.map(<[u8]>::to_vec));
            let compressed = out.expect("half of the block repeats a pattern");
            assert!(compressed.len() < BLOCK_BYTES);
            let mut back = vec![0u8; BLOCK_BYTES];
            let n = lz4_flex::block::decompress_into(&compressed, &mut back).expect("decodes");
            assert_eq!((n, &back[..]), (BLOCK_BYTES, block));
        }
    }

    #[test]
    fn noise_does_not_compress() {
        assert!(with_compressed(&noise(1), |c| c.is_none()));
    }
}
