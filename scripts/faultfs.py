#!/usr/bin/env python3
"""faultfs: a pass-through FUSE filesystem that fails chosen operations with a chosen errno.

For tests that need a real filesystem under `ibid serve` to return I/O errors (this machine's
kernel has no device mapper, so no dm-error or dm-flakey).

    faultfs.py BACKING MOUNTPOINT CONTROL

Mounts BACKING at MOUNTPOINT (in the foreground; unmount with `fusermount -u MOUNTPOINT`).
CONTROL is a file read before every operation; each of its lines `OP SUBSTRING ERRNO` makes
every OP (`read`, `write` or `fsync`) on a path containing SUBSTRING fail with ERRNO (e.g. 5,
EIO). An empty or missing file fails nothing. Data goes straight through (`direct_io`): the
kernel keeps no page cache of the files, so every read reaches the backing file.

Needs fusepy (Debian: python3-fusepy).
"""
import errno
import os
import sys

try:
    from fusepy import FUSE, FuseOSError, Operations  # Debian's python3-fusepy
except ImportError:
    from fuse import FUSE, FuseOSError, Operations  # fusepy from PyPI


class FaultFS(Operations):
    def __init__(self, root, control):
        self.root = os.path.realpath(root)
        self.control = control

    def _path(self, path):
        return os.path.join(self.root, path.lstrip("/"))

    def _fault(self, op, path):
        try:
            with open(self.control) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return
        for line in lines:
            parts = line.split()
            if len(parts) == 3 and parts[0] == op and parts[1] in path:
                raise FuseOSError(int(parts[2]))

    # Metadata.
    def access(self, path, mode):
        if not os.access(self._path(path), mode):
            raise FuseOSError(errno.EACCES)

    def getattr(self, path, fh=None):
        st = os.lstat(self._path(path))
        keys = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink",
                "st_size", "st_uid", "st_blocks")
        return {k: getattr(st, k) for k in keys}

    def readdir(self, path, fh):
        return [".", ".."] + os.listdir(self._path(path))

    def mkdir(self, path, mode):
        os.mkdir(self._path(path), mode)

    def rmdir(self, path):
        os.rmdir(self._path(path))

    def unlink(self, path):
        os.unlink(self._path(path))

    def rename(self, old, new):
        os.rename(self._path(old), self._path(new))

    def chmod(self, path, mode):
        os.chmod(self._path(path), mode)

    def chown(self, path, uid, gid):
        os.chown(self._path(path), uid, gid)

    def utimens(self, path, times=None):
        os.utime(self._path(path), times)

    def statfs(self, path):
        st = os.statvfs(self._path(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                "f_files", "f_flag", "f_frsize", "f_namemax")
        return {k: getattr(st, k) for k in keys}

    # Files. The engine may ask for O_DIRECT; the backing file is written from Python's
    # unaligned buffers, so the flag is dropped there (the kernel already bypasses its cache).
    def open(self, path, flags):
        return os.open(self._path(path), flags & ~os.O_DIRECT)

    def create(self, path, mode, fi=None):
        return os.open(self._path(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path, length, offset, fh):
        self._fault("read", path)
        return os.pread(fh, length, offset)

    def write(self, path, buf, offset, fh):
        self._fault("write", path)
        return os.pwrite(fh, buf, offset)

    def truncate(self, path, length, fh=None):
        with open(self._path(path), "r+b") as f:
            f.truncate(length)

    def flush(self, path, fh):
        return 0

    def release(self, path, fh):
        os.close(fh)

    def fsync(self, path, datasync, fh):
        self._fault("fsync", path)
        if datasync:
            os.fdatasync(fh)
        else:
            os.fsync(fh)

    def fsyncdir(self, path, datasync, fh):
        self._fault("fsync", path)


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    backing, mountpoint, control = sys.argv[1:]
    FUSE(FaultFS(backing, control), mountpoint, foreground=True, direct_io=True,
         nothreads=False)


if __name__ == "__main__":
    main()
