//! Crash-safe replacement of the small files the server keeps in the pool directory
//! (`qos.json`, `luns.json`): a crash leaves the old content or the new one, never a mix.

use std::io::Write;
use std::path::Path;

/// Replaces `path` with `content`: written to `PATH.tmp`, synced, renamed over `path`, and the
/// directory synced, so the rename itself is durable when this returns.
pub fn write_file(path: &Path, content: &[u8]) -> std::io::Result<()> {
    write_with_mode(path, content, 0o666)
}

/// [`write_file`] for a file that holds secrets: created readable and writable by the owner
/// only (mode 0600, from the first byte: the temporary file too).
pub fn write_private_file(path: &Path, content: &[u8]) -> std::io::Result<()> {
    write_with_mode(path, content, 0o600)
}

fn write_with_mode(path: &Path, content: &[u8], mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    // A leftover temporary file keeps its old mode when opened: remove it first.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)?;
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

    /// A private file is created mode 0600, also when a stale temporary file was there.
    #[test]
    fn private_files_are_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("secret.json");
        std::fs::write(dir.path().join("secret.json.tmp"), b"stale").expect("stale tmp");
        super::write_private_file(&path, b"key").expect("write");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(std::fs::read(&path).expect("read"), b"key");
    }
}
