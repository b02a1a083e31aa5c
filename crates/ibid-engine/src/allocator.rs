//! The global allocator of the ibid binaries (feature `mimalloc`): mimalloc, kept from handing
//! freed memory back to the kernel for 10 s, on ordinary (4 KiB) pages.
//!
//! Why the delay: a commit allocates and frees tens of MiB in page-sized buffers (redb's dirty
//! pages, the batch's keys and values), about once a second under a write load. glibc's
//! allocator and mimalloc's defaults both return that memory to the kernel between commits and
//! fault it back in, zeroed, on the next one; that zeroing cost a fifth of the commit thread's
//! CPU (measurements: docs/BENCHMARKS.md).
//!
//! Why no transparent huge pages: mimalloc asks for them (`MADV_HUGEPAGE`) on its arenas, so
//! the first touch of any 64 KiB allocator page faults in, and clears, a whole 2 MiB huge page,
//! and a purge of part of it splits it again. Under 1 MiB unique writes that clearing was
//! a large share of the server's CPU (`clear_page_erms` under `do_huge_pmd_anonymous_page`,
//! from hash tables growing and redb's pages); without huge pages the same writes run faster
//! with less CPU per MB (measurements: docs/benchmarks/nbd-fio.md).
//!
//! A binary installs it with
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

/// What [`tune`] changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuned {
    /// The purge delay is [`PURGE_DELAY_MS`] (false if the option was not at its default).
    pub purge_delay: bool,
    /// Transparent huge pages are off for the process.
    pub no_huge_pages: bool,
}

/// Delays mimalloc's return of freed memory to the kernel to [`PURGE_DELAY_MS`] and turns
/// transparent huge pages off for the process (`PR_SET_THP_DISABLE`: it overrides
/// `MADV_HUGEPAGE`, so it also covers what mimalloc mapped before `main`; anonymous memory
/// only, the page cache is not affected).
pub fn tune() -> Tuned {
    // SAFETY: mimalloc's option calls take plain integers and may be called at any time;
    // `prctl(PR_SET_THP_DISABLE)` takes integers and changes only this process's flag.
    unsafe {
        let purge_delay =
            libmimalloc_sys::mi_option_get(PURGE_DELAY_OPTION) == PURGE_DELAY_DEFAULT_MS && {
                libmimalloc_sys::mi_option_set(PURGE_DELAY_OPTION, PURGE_DELAY_MS);
                libmimalloc_sys::mi_option_get(PURGE_DELAY_OPTION) == PURGE_DELAY_MS
            };
        let no_huge_pages = libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0
            && libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) == 1;
        Tuned {
            purge_delay,
            no_huge_pages,
        }
    }
}

#[cfg(test)]
mod tests {
    /// The option number still names the purge delay (its default is where the number says):
    /// a mimalloc upgrade that renumbers it fails here instead of silently tuning nothing; and
    /// the process runs without transparent huge pages afterwards.
    #[test]
    fn tune_sets_the_purge_delay_and_turns_huge_pages_off() {
        let tuned = super::tune();
        assert_eq!(
            tuned,
            super::Tuned {
                purge_delay: true,
                no_huge_pages: true
            }
        );
        // SAFETY: reads this process's flag.
        assert_eq!(
            unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) },
            1
        );
    }
}
