//! Persistent reservations that survive a restart of the target (APTPL, SPC-4 5.14.5).
//!
//! When the last PERSISTENT RESERVE OUT REGISTER (or REGISTER AND IGNORE EXISTING KEY) of a LUN
//! set APTPL, every change of that LUN's registrations and reservation is written here before
//! the command completes; a REGISTER with APTPL clear removes the LUN's entry. At start the
//! target reads the file back and a LUN gets its saved state when it is first addressed.
//!
//! The file is `reservations.json` in [`crate::TargetConfig::state_dir`], keyed by the LUN's
//! identity ([`crate::Lun::id`], the 16 bytes its NAA designator comes from), not by its number:
//! a reservation follows its volume if the LUN is renumbered. It is rewritten whole to a
//! temporary file, synced, renamed over the old one and the directory synced, so a crash leaves
//! the old or the new content.

use super::pr::{PrState, Reservation};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Name of the file in the state directory.
pub const FILE_NAME: &str = "reservations.json";
/// Version of the file's format.
const FILE_VERSION: u64 = 1;

/// One registration as saved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedRegistration {
    /// Initiator port (`NAME,i,0xISID`).
    port: String,
    /// Its reservation key.
    key: u64,
}

/// One reservation as saved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedReservation {
    holder: String,
    #[serde(rename = "type")]
    ty: u8,
}

/// One LUN's persistent reservation state as saved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedLun {
    /// The LUN's identity, hex.
    id: String,
    generation: u32,
    registrations: Vec<SavedRegistration>,
    reservation: Option<SavedReservation>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    version: u64,
    luns: Vec<SavedLun>,
}

/// The saved states, and where they are kept.
pub struct PrStore {
    /// The file; `None` keeps nothing (APTPL is then refused).
    path: Option<PathBuf>,
    saved: Mutex<BTreeMap<String, SavedLun>>,
}

fn hex(id: &[u8; 16]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

impl PrStore {
    /// A store that keeps nothing: APTPL cannot be honoured.
    pub fn none() -> PrStore {
        PrStore {
            path: None,
            saved: Mutex::new(BTreeMap::new()),
        }
    }

    /// The store in `dir`, with what it holds read back.
    pub fn open(dir: &Path) -> std::io::Result<PrStore> {
        let path = dir.join(FILE_NAME);
        let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
        let saved = match std::fs::read_to_string(&path) {
            Ok(text) => {
                let file: File = serde_json::from_str(&text)
                    .map_err(|e| invalid(format!("{}: {e}", path.display())))?;
                if file.version != FILE_VERSION {
                    return Err(invalid(format!(
                        "{} is in format version {}; this ibid reads version {FILE_VERSION}",
                        path.display(),
                        file.version
                    )));
                }
                file.luns.into_iter().map(|l| (l.id.clone(), l)).collect()
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(e),
        };
        Ok(PrStore {
            path: Some(path),
            saved: Mutex::new(saved),
        })
    }

    /// Whether APTPL can be honoured (the store has a file).
    pub fn durable(&self) -> bool {
        self.path.is_some()
    }

    /// The saved state of the LUN with identity `id`, if any (with APTPL set).
    pub fn load(&self, id: &[u8; 16]) -> Option<PrState> {
        let saved = self.saved.lock();
        let l = saved.get(&hex(id))?;
        Some(PrState {
            generation: l.generation,
            registrations: l
                .registrations
                .iter()
                .map(|r| (r.port.clone(), r.key))
                .collect(),
            reservation: l.reservation.as_ref().map(|r| Reservation {
                holder: r.holder.clone(),
                ty: r.ty,
            }),
            aptpl: true,
        })
    }

    /// Saves `state` for the LUN with identity `id` if it has APTPL set, else forgets the
    /// LUN's saved state; durable when this returns. Nothing is written if nothing changed.
    pub fn save(&self, id: &[u8; 16], state: &PrState) -> std::io::Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let key = hex(id);
        let mut saved = self.saved.lock();
        let entry = state.aptpl.then(|| SavedLun {
            id: key.clone(),
            generation: state.generation,
            registrations: state
                .registrations
                .iter()
                .map(|(port, key)| SavedRegistration {
                    port: port.clone(),
                    key: *key,
                })
                .collect(),
            reservation: state.reservation.as_ref().map(|r| SavedReservation {
                holder: r.holder.clone(),
                ty: r.ty,
            }),
        });
        if saved.get(&key) == entry.as_ref() {
            return Ok(());
        }
        let mut next = saved.clone();
        match entry {
            Some(e) => next.insert(key, e),
            None => next.remove(&key),
        };
        write_file(path, &next)?;
        *saved = next;
        Ok(())
    }
}

/// Replaces the file crash-safely.
fn write_file(path: &Path, luns: &BTreeMap<String, SavedLun>) -> std::io::Result<()> {
    let file = File {
        version: FILE_VERSION,
        luns: luns.values().cloned().collect(),
    };
    let text = serde_json::to_string_pretty(&file).map_err(std::io::Error::other)? + "\n";
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state saved with APTPL comes back from a new store on the same directory; saving it
    /// without APTPL forgets it.
    #[test]
    fn survives_reopen_and_aptpl_clear_forgets() {
        let dir = tempfile::tempdir().expect("tempdir");
        let id = [7u8; 16];
        let state = PrState {
            generation: 3,
            registrations: vec![("iqn.a,i,0x1".into(), 0xabc)],
            reservation: Some(Reservation {
                holder: "iqn.a,i,0x1".into(),
                ty: super::super::pr::TYPE_WE,
            }),
            aptpl: true,
        };
        let store = PrStore::open(dir.path()).expect("open");
        store.save(&id, &state).expect("save");
        let again = PrStore::open(dir.path()).expect("reopen");
        let loaded = again.load(&id).expect("saved");
        assert_eq!(loaded.registrations, state.registrations);
        assert_eq!(loaded.reservation, state.reservation);
        assert_eq!(loaded.generation, 3);
        assert!(again.load(&[8u8; 16]).is_none());
        let cleared = PrState {
            aptpl: false,
            ..loaded
        };
        again.save(&id, &cleared).expect("forget");
        assert!(PrStore::open(dir.path()).expect("open").load(&id).is_none());
    }
}
