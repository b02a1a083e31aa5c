//! Direct I/O buffers: page-aligned, for the files the segment writers and the journal open
//! with `O_DIRECT` (through [`crate::disk::Disk::open_direct`]). A direct write goes from the
//! buffer to the device with no copy into the page cache and leaves no dirty pages for a later
//! fsync to write back; its buffer address, file offset and length must be multiples of
//! [`PAGE_BYTES`].

/// Unit of direct I/O: buffer addresses, file offsets and lengths are multiples of it.
pub(crate) const PAGE_BYTES: usize = 4096;

/// One page-aligned page of a write buffer.
#[repr(C, align(4096))]
#[derive(Clone, Copy)]
struct Page([u8; PAGE_BYTES]);

/// A write buffer that starts on a page boundary, as `O_DIRECT` needs. Its capacity is fixed
/// at creation.
pub(crate) struct AlignedBuf {
    pages: Vec<Page>,
    len: usize,
}

impl AlignedBuf {
    pub(crate) fn with_capacity(bytes: usize) -> AlignedBuf {
        AlignedBuf {
            pages: vec![Page([0; PAGE_BYTES]); bytes.div_ceil(PAGE_BYTES)],
            len: 0,
        }
    }

    /// The whole capacity as bytes.
    fn raw(&self) -> &[u8] {
        // SAFETY: `Page` is `repr(C)` around a byte array whose size equals its alignment, so
        // the pages are contiguous bytes with no padding.
        unsafe {
            std::slice::from_raw_parts(
                self.pages.as_ptr().cast::<u8>(),
                self.pages.len() * PAGE_BYTES,
            )
        }
    }

    fn raw_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `raw`; the borrow of `self` is exclusive.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.pages.as_mut_ptr().cast::<u8>(),
                self.pages.len() * PAGE_BYTES,
            )
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes it can hold.
    pub(crate) fn capacity(&self) -> usize {
        self.pages.len() * PAGE_BYTES
    }

    /// Keeps the first `len` bytes.
    pub(crate) fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffered bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.raw()[..self.len]
    }

    /// Appends `b`. Panics past the capacity (the writer sizes the buffer for its largest
    /// fill).
    pub(crate) fn push(&mut self, b: &[u8]) {
        let at = self.len;
        self.raw_mut()[at..at + b.len()].copy_from_slice(b);
        self.len += b.len();
    }

    /// The buffered bytes padded with zeros to whole pages.
    pub(crate) fn padded(&mut self) -> &[u8] {
        let (len, end) = (self.len, self.len.next_multiple_of(PAGE_BYTES));
        self.raw_mut()[len..end].fill(0);
        &self.raw()[..end]
    }

    /// Drops the first `n` bytes (a multiple of the page size), moving the rest to the start.
    pub(crate) fn consume(&mut self, n: usize) {
        let len = self.len;
        self.raw_mut().copy_within(n..len, 0);
        self.len -= n;
    }
}
