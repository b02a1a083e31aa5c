//! The small files the server keeps in the pool directory (`qos.json`, `luns.json`,
//! `remotes.json`, `schedules.json`, `jobs.json`, `instant-restores.json`): each a JSON object
//! with a format `version`, replaced crash-safely (a crash leaves the old content or the new
//! one, never a mix) and read back with its version checked.

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

/// Reads the table in `path`, a JSON object whose `version` must be `version`; `None` if the
/// file does not exist. Errors name the file and `what` it holds (e.g. "QoS limits").
pub fn read_table<T: serde::de::DeserializeOwned>(
    path: &Path,
    what: &str,
    version: u64,
) -> anyhow::Result<Option<T>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => anyhow::bail!("read {} ({what}): {e}", path.display()),
    };
    let unreadable =
        |e: serde_json::Error| anyhow::anyhow!("{} ({what}) is unreadable: {e}", path.display());
    /// The version alone, checked before the rest is parsed (a newer format may not parse).
    #[derive(serde::Deserialize)]
    struct Versioned {
        version: u64,
    }
    let found: Versioned = serde_json::from_slice(&bytes).map_err(unreadable)?;
    if found.version != version {
        anyhow::bail!(
            "{} ({what}) is in format version {}; this ibid reads version {version}",
            path.display(),
            found.version
        );
    }
    serde_json::from_slice(&bytes).map(Some).map_err(unreadable)
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

    /// A table reads back; a missing file is `None`; another version or bad JSON is an error
    /// naming the file, what it holds and (for a version) both versions.
    #[test]
    fn tables_read_back_with_their_version_checked() {
        #[derive(serde::Deserialize, Debug, PartialEq)]
        struct T {
            version: u64,
            rows: Vec<u64>,
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.json");
        let read = || super::read_table::<T>(&path, "test rows", 1);
        assert!(read().expect("missing").is_none());
        super::write_file(&path, br#"{"version": 1, "rows": [3, 4]}"#).expect("write");
        assert_eq!(
            read().expect("read"),
            Some(T {
                version: 1,
                rows: vec![3, 4]
            })
        );
        super::write_file(&path, br#"{"version": 2, "rows": "new shape"}"#).expect("write");
        let e = read().expect_err("version 2").to_string();
        assert!(
            e.contains("t.json (test rows) is in format version 2; this ibid reads version 1"),
            "{e}"
        );
        super::write_file(&path, b"{\"version\": 1, \"rows\": [").expect("write");
        let e = read().expect_err("torn").to_string();
        assert!(e.contains("t.json (test rows) is unreadable"), "{e}");
    }
}
