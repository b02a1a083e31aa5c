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

use crate::format::BLOCK_BYTES;

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

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let block: Vec<u8> = (0..BLOCK_BYTES)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        assert!(with_compressed(&block, |c| c.is_none()));
    }
}
