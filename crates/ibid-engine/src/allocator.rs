//! The global allocator of the ibid binaries (feature `mimalloc`): mimalloc, kept from handing
//! freed memory back to the kernel for 10 s.
//!
//! Why: a commit allocates and frees tens of MiB in page-sized buffers (redb's dirty pages, the
//! batch's keys and values), about once a second under a write load. glibc's allocator and
//! mimalloc's defaults both return that memory to the kernel between commits and fault it back
//! in, zeroed, on the next one; that zeroing cost a fifth of the commit thread's CPU
//! (docs/BENCHMARKS.md, session 7). A binary installs it with
//! `#[global_allocator] static A: ibid_engine::allocator::Allocator = ibid_engine::allocator::Allocator;`
//! and calls [`tune`] first thing in `main`.

/// The allocator type to install as `#[global_allocator]`.
pub use mimalloc::MiMalloc as Allocator;

/// `mi_option_purge_delay` in the mimalloc (v3) that `libmimalloc-sys` builds; its Rust
/// bindings have no constant for it.
const PURGE_DELAY_OPTION: libmimalloc_sys::mi_option_t = 15;
/// The option's documented default, checked before changing it so a renumbered option is
/// left alone rather than misset.
const PURGE_DELAY_DEFAULT_MS: std::ffi::c_long = 1000;
/// Freed memory reused within this long stays mapped.
const PURGE_DELAY_MS: std::ffi::c_long = 10_000;

/// Delays mimalloc's return of freed memory to the kernel to [`PURGE_DELAY_MS`]. Returns
/// whether the option was set (false if it was not found at its default).
pub fn tune() -> bool {
    // SAFETY: mimalloc's option calls take plain integers and may be called at any time.
    unsafe {
        if libmimalloc_sys::mi_option_get(PURGE_DELAY_OPTION) != PURGE_DELAY_DEFAULT_MS {
            return false;
        }
        libmimalloc_sys::mi_option_set(PURGE_DELAY_OPTION, PURGE_DELAY_MS);
        libmimalloc_sys::mi_option_get(PURGE_DELAY_OPTION) == PURGE_DELAY_MS
    }
}

#[cfg(test)]
mod tests {
    /// The option number still names the purge delay (its default is where the number says):
    /// a mimalloc upgrade that renumbers it fails here instead of silently tuning nothing.
    #[test]
    fn tune_sets_the_purge_delay() {
        assert!(super::tune());
    }
}
