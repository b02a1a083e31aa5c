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

impl DiskFile for FsFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.0.read_exact_at(buf, offset)
    }

    fn read_exact_at_nowait(&self, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
        while !buf.is_empty() {
            let iov = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: buf.len(),
            };
            // SAFETY: a valid open file descriptor and one iovec over `buf`, which outlives
            // the call.
            let n = unsafe {
                libc::preadv2(
                    self.0.as_raw_fd(),
                    &iov,
                    1,
                    offset as libc::off_t,
                    libc::RWF_NOWAIT,
                )
            };
            match n {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                n if n > 0 => {
                    buf = &mut buf[n as usize..];
                    offset += n as u64;
                }
                _ => {
                    let e = io::Error::last_os_error();
                    match e.raw_os_error() {
                        Some(libc::EINTR) => continue,
                        // Not cached, or a filesystem that does not do RWF_NOWAIT.
                        Some(libc::EAGAIN | libc::EOPNOTSUPP) => {
                            return Err(io::ErrorKind::WouldBlock.into())
                        }
                        _ => return Err(e),
                    }
                }
            }
        }
        Ok(())
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

    /// A read from memory only declines (`WouldBlock`) what the page cache lacks — data just
    /// written with `O_DIRECT`, where the filesystem allows it — and reads, exactly, what a
    /// plain read has brought into it.
    #[test]
    fn a_nowait_read_declines_what_the_page_cache_lacks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        let disk = FsDisk;
        let file = disk.open(&path, OpenMode::CreateNew).expect("create");
        let data: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
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
        let first = file.read_exact_at_nowait(&mut got, 256 << 10);
        if direct.is_some() {
            let e = first.expect_err("data written past the page cache was read from memory");
            assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        }
        file.read_exact_at(&mut got, 256 << 10).expect("read");
        got.fill(0);
        file.read_exact_at_nowait(&mut got, 256 << 10)
            .expect("a cached range reads from memory");
        assert_eq!(got, data[256 << 10..320 << 10]);
        let e = file
            .read_exact_at_nowait(&mut got, (1 << 20) - 4096)
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
