//! Crash-safe replacement of the small files the server keeps in the pool directory
//! (`qos.json`, `luns.json`): a crash leaves the old content or the new one, never a mix.

use std::io::Write;
use std::path::Path;

/// Replaces `path` with `content`: written to `PATH.tmp`, synced, renamed over `path`, and the
/// directory synced, so the rename itself is durable when this returns.
pub fn write_file(path: &Path, content: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(content)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The file holds the new content and no temporary file stays behind.
    #[test]
    fn replaces_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.json");
        super::write_file(&path, b"old").expect("write");
        super::write_file(&path, b"new").expect("rewrite");
        assert_eq!(std::fs::read(&path).expect("read"), b"new");
        assert_eq!(std::fs::read_dir(dir.path()).expect("list").count(), 1);
    }
}
