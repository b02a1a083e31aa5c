//! [`FsDisk`]: the pool directory on the real filesystem.

use super::{Disk, DiskFile, OpenMode};
use std::any::Any;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::Arc;

/// The real filesystem (see [`super::Disk`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct FsDisk;

/// A file of the real filesystem.
#[derive(Debug)]
struct FsFile(File);

/// Most iovecs one `preadv2` takes (Linux's `IOV_MAX`).
const IOVECS_MAX: usize = 1024;

/// Fills `bufs` in order from `file` at `offset` with `preadv2` (`flags`: 0, or
/// `RWF_NOWAIT` to read only what is in memory — `WouldBlock` otherwise, with the buffers
/// partly filled), as many calls as short reads and [`IOVECS_MAX`] need.
fn preadv_all(file: &File, bufs: &mut [&mut [u8]], mut offset: u64, flags: i32) -> io::Result<()> {
    // The first buffer not yet full, and how much of it is.
    let (mut first, mut done) = (0, 0);
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(bufs.len().min(IOVECS_MAX));
    loop {
        while first < bufs.len() && done == bufs[first].len() {
            (first, done) = (first + 1, 0);
        }
        if first == bufs.len() {
            return Ok(());
        }
        iov.clear();
        for (k, b) in bufs[first..].iter_mut().take(IOVECS_MAX).enumerate() {
            let skip = if k == 0 { done } else { 0 };
            iov.push(libc::iovec {
                iov_base: b[skip..].as_mut_ptr().cast(),
                iov_len: b.len() - skip,
            });
        }
        // SAFETY: a valid open file descriptor; every iovec points into a buffer of `bufs`,
        // borrowed mutably for the whole call, within its bounds.
        let n = unsafe {
            libc::preadv2(
                file.as_raw_fd(),
                iov.as_ptr(),
                iov.len() as libc::c_int,
                offset as libc::off_t,
                flags,
            )
        };
        match n {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n if n > 0 => {
                offset += n as u64;
                let mut n = n as usize;
                while n > 0 {
                    let take = n.min(bufs[first].len() - done);
                    (done, n) = (done + take, n - take);
                    if done == bufs[first].len() && n > 0 {
                        (first, done) = (first + 1, 0);
                    }
                }
            }
            _ => {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    // Not cached, or a filesystem that does not do RWF_NOWAIT.
                    Some(libc::EAGAIN | libc::EOPNOTSUPP) if flags & libc::RWF_NOWAIT != 0 => {
                        return Err(io::ErrorKind::WouldBlock.into())
                    }
                    _ => return Err(e),
                }
            }
        }
    }
}

impl DiskFile for FsFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.0.read_exact_at(buf, offset)
    }

    fn read_exact_at_nowait(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        preadv_all(&self.0, &mut [buf], offset, libc::RWF_NOWAIT)
    }

    fn read_scattered_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> io::Result<()> {
        preadv_all(&self.0, bufs, offset, 0)
    }

    fn read_scattered_at_nowait(&self, bufs: &mut [&mut [u8]], offset: u64) -> io::Result<()> {
        preadv_all(&self.0, bufs, offset, libc::RWF_NOWAIT)
    }

    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.0.write_all_at(buf, offset)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }

    fn len(&self) -> io::Result<u64> {
        self.0.metadata().map(|m| m.len())
    }

    fn allocated(&self) -> io::Result<u64> {
        use std::os::unix::fs::MetadataExt;
        // st_blocks counts 512-byte units, and may run past the size where the filesystem
        // preallocates ahead of appends (XFS): the size bounds it.
        let m = self.0.metadata()?;
        Ok((m.blocks() * 512).min(m.len()))
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }

    fn allocate(&self, len: u64) -> io::Result<()> {
        // SAFETY: a valid open file descriptor; offsets are in range.
        let rc = unsafe { libc::posix_fallocate(self.0.as_raw_fd(), 0, len as libc::off_t) };
        match rc {
            0 => Ok(()),
            // Not supported here: zeros written do the same.
            libc::EOPNOTSUPP | libc::EINVAL => {
                let zeros = vec![0u8; 1 << 20];
                let mut at = 0;
                while at < len {
                    let n = (len - at).min(zeros.len() as u64) as usize;
                    self.0.write_all_at(&zeros[..n], at)?;
                    at += n as u64;
                }
                Ok(())
            }
            e => Err(io::Error::from_raw_os_error(e)),
        }
    }
}

impl Disk for FsDisk {
    fn is_real_filesystem(&self) -> bool {
        true
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)
    }

    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn DiskFile>> {
        let mut o = OpenOptions::new();
        o.read(true).write(true);
        match mode {
            OpenMode::Existing => {}
            OpenMode::Create => {
                o.create(true).truncate(false);
            }
            OpenMode::CreateNew => {
                o.create_new(true);
            }
        }
        Ok(Arc::new(FsFile(o.open(path)?)))
    }

    fn open_direct(&self, path: &Path) -> io::Result<Option<Arc<dyn DiskFile>>> {
        match OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(f) => Ok(Some(Arc::new(FsFile(f)))),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            if let Some(name) = entry?.file_name().to_str() {
                names.push(name.to_string());
            }
        }
        names.sort();
        Ok(names)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn fs_space(&self, dir: &Path) -> io::Result<(u64, u64)> {
        let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL"))?;
        // SAFETY: `statvfs` is plain old data; an all-zero value is valid.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is a valid NUL-terminated path and `st` a valid out-pointer.
        if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let frsize = st.f_frsize as u64;
        Ok((st.f_blocks as u64 * frsize, st.f_bavail as u64 * frsize))
    }

    fn lock_dir(&self, dir: &Path) -> io::Result<Option<Box<dyn Any + Send + Sync>>> {
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("LOCK"))?;
        // SAFETY: flock on a file descriptor we own.
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        Ok((rc == 0).then(|| Box::new(f) as Box<dyn Any + Send + Sync>))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::direct_io::AlignedBuf;

    /// A file extended by `set_len` takes only the blocks written (the store's growth is
    /// counted by them), never more than its size; `allocate` makes it take them all.
    #[test]
    fn allocated_counts_written_blocks_not_length() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = FsDisk
            .open(&dir.path().join("f"), OpenMode::CreateNew)
            .expect("create");
        file.set_len(64 << 20).expect("extend");
        // Incompressible and synced, so that a compressing or delayed-allocation filesystem
        // also shows the blocks.
        let data: Vec<u8> = (0u64..1 << 17)
            .flat_map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes())
            .collect();
        file.write_all_at(&data, 8 << 20).expect("write");
        file.sync_data().expect("sync");
        let (len, taken) = (
            file.len().expect("len"),
            file.allocated().expect("allocated"),
        );
        assert_eq!(len, 64 << 20);
        assert!(
            taken > 0 && taken <= 4 << 20,
            "{taken} bytes allocated for 1 MiB written into a sparse 64 MiB file"
        );
        file.allocate(64 << 20).expect("allocate");
        assert_eq!(file.allocated().expect("allocated"), 64 << 20);
    }

    /// A scattered read fills its pieces, in order, exactly as one plain read of the same
    /// bytes would: empty pieces, pieces past `IOVECS_MAX` in number, and through the
    /// default (read whole, then copy) path alike; past the end of the file it fails.
    #[test]
    fn scattered_reads_fill_their_pieces_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk = FsDisk;
        let file = disk
            .open(&dir.path().join("f"), OpenMode::CreateNew)
            .expect("create");
        let data: Vec<u8> = (0..3 << 20).map(|i| (i * 7 % 253) as u8).collect();
        file.write_all_at(&data, 0).expect("write");
        // 3,000 pieces of 0..1,024 bytes (every 7th empty), more than one preadv2 takes.
        let lens: Vec<usize> = (0..3000)
            .map(|i| (i * 389) % 1024 * usize::from(i % 7 != 0))
            .collect();
        let total: usize = lens.iter().sum();
        let read_pieces = |f: &dyn DiskFile, offset: u64| {
            let mut store = vec![0u8; total];
            let mut pieces: Vec<&mut [u8]> = Vec::new();
            let mut rest = &mut store[..];
            for &n in &lens {
                let (piece, tail) = rest.split_at_mut(n);
                pieces.push(piece);
                rest = tail;
            }
            f.read_scattered_at(&mut pieces, offset)
                .expect("scattered read");
            store
        };
        for offset in [0u64, 12_345] {
            let want = &data[offset as usize..offset as usize + total];
            assert!(read_pieces(&*file, offset) == want, "preadv2 at {offset}");
            assert!(
                read_pieces(&SimpleFile(&*file), offset) == want,
                "default at {offset}"
            );
        }
        let mut tail = vec![0u8; 8192];
        let e = file
            .read_scattered_at(&mut [&mut tail[..]], (3 << 20) - 4096)
            .expect_err("past the end");
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    /// A file with only the required reads: the trait's default scattered read.
    #[derive(Debug)]
    struct SimpleFile<'a>(&'a dyn DiskFile);

    impl DiskFile for SimpleFile<'_> {
        fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.0.read_exact_at(buf, offset)
        }
        fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
            self.0.write_all_at(buf, offset)
        }
        fn sync_data(&self) -> io::Result<()> {
            self.0.sync_data()
        }
        fn len(&self) -> io::Result<u64> {
            self.0.len()
        }
        fn set_len(&self, len: u64) -> io::Result<()> {
            self.0.set_len(len)
        }
        fn allocate(&self, len: u64) -> io::Result<()> {
            self.0.allocate(len)
        }
    }

    /// A read from memory only declines (`WouldBlock`) what the page cache lacks — data just
    /// written with `O_DIRECT`, where the filesystem allows it — never returns other bytes than
    /// the file's, and reads, exactly, what a plain read has brought into it. (`RWF_NOWAIT`
    /// is best effort: the kernel starts readahead for a range it lacks and, when the device
    /// answers at once, may return it instead of declining; seen on this VM under load for
    /// one range in two, and for eight 64 KiB ranges of eight under the test suite's load.
    /// So 4 KiB blocks 64 KiB apart are probed, up to 120, until one declines.)
    #[test]
    fn a_nowait_read_declines_what_the_page_cache_lacks() {
        const MIB: usize = 1 << 20;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        let disk = FsDisk;
        let file = disk.open(&path, OpenMode::CreateNew).expect("create");
        let data: Vec<u8> = (0..8 * MIB).map(|i| (i % 251) as u8).collect();
        let direct = disk.open_direct(&path).expect("open direct");
        match &direct {
            Some(d) => {
                let mut buf = AlignedBuf::with_capacity(data.len());
                buf.push(&data);
                d.write_all_at(buf.bytes(), 0).expect("direct write");
            }
            None => file.write_all_at(&data, 0).expect("write"),
        }
        let mut got = vec![0u8; 64 << 10];
        let range = |at: usize| &data[at..at + (64 << 10)];
        let mut declined = 0;
        let mut one = vec![0u8; 4096];
        for r in 8..128 {
            let at = r * (64 << 10) + 4096;
            one.fill(0);
            match file.read_exact_at_nowait(&mut one, at as u64) {
                Ok(()) => assert!(
                    one == data[at..at + 4096],
                    "block at {at}: other bytes than the file's"
                ),
                Err(e) => {
                    assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "block at {at}: {e}");
                    declined += 1;
                    break;
                }
            }
        }
        if direct.is_some() {
            assert!(
                declined > 0,
                "data written past the page cache was read from memory"
            );
        }
        let at = 256 << 10;
        file.read_exact_at(&mut got, at as u64).expect("read");
        got.fill(0);
        file.read_exact_at_nowait(&mut got, at as u64)
            .expect("a cached range reads from memory");
        assert!(got == range(at));
        let e = file
            .read_exact_at_nowait(&mut got, (8 * MIB - 4096) as u64)
            .expect_err("past the end");
        assert!(
            matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof | io::ErrorKind::WouldBlock
            ),
            "{e}"
        );
    }
}
