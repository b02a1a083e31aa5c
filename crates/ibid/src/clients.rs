//! Who is connected to which volume: NBD connections (by export: a volume, or a snapshot as
//! `VOLUME@SNAPSHOT`) and iSCSI connections of normal sessions that have sent commands to a
//! volume's LUN. The front ends hand over a handle that lives exactly as long as the connection;
//! this registry keeps a `Weak` of it, so a closed connection drops out by itself.
//!
//! The API lists a volume's clients and refuses to delete a volume (or snapshot) that has any,
//! unless forced (`in_use`).

use parking_lot::Mutex;
use serde::Serialize;
use std::any::Any;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Weak;
use std::time::{SystemTime, UNIX_EPOCH};

/// One open connection using a volume, as the API shows it.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ClientView {
    /// `nbd` or `iscsi`.
    pub protocol: &'static str,
    /// The client's address, `host:port` (empty if unknown).
    pub remote: String,
    /// The export it opened: the volume, or `VOLUME@SNAPSHOT`.
    pub export: String,
    /// The iSCSI initiator name (iSCSI only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initiator: Option<String>,
    /// When the connection started using the volume, in seconds since the epoch.
    pub connected_unix_s: u64,
}

struct Entry {
    view: ClientView,
    alive: Weak<dyn Any + Send + Sync>,
}

/// The registry: export name → its connections.
#[derive(Default)]
pub struct Clients {
    by_export: Mutex<HashMap<String, Vec<Entry>>>,
}

impl Clients {
    /// Notes a connection using `export` while `alive` can be upgraded.
    pub fn add(
        &self,
        export: &str,
        protocol: &'static str,
        remote: Option<SocketAddr>,
        initiator: Option<String>,
        alive: Weak<dyn Any + Send + Sync>,
    ) {
        let view = ClientView {
            protocol,
            remote: remote.map(|r| r.to_string()).unwrap_or_default(),
            export: export.to_string(),
            initiator,
            connected_unix_s: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        };
        let mut map = self.by_export.lock();
        let entries = map.entry(export.to_string()).or_default();
        entries.retain(|e| e.alive.strong_count() > 0);
        entries.push(Entry { view, alive });
    }

    /// The open connections using `volume` or any of its snapshots: what deleting the volume
    /// would cut off.
    pub fn of_volume_and_snapshots(&self, volume: &str) -> Vec<ClientView> {
        self.matching(|export| {
            export == volume
                || export
                    .strip_prefix(volume)
                    .is_some_and(|rest| rest.starts_with('@'))
        })
    }

    /// The open connections using the export `name` (a volume or `VOLUME@SNAPSHOT`).
    pub fn of_export(&self, name: &str) -> Vec<ClientView> {
        self.matching(|export| export == name)
    }

    /// Forgets `volume`'s and its snapshots' connections (the volume was deleted: a new volume
    /// of the same name starts with none; the old connections' I/O fails).
    pub fn forget_volume(&self, volume: &str) {
        self.by_export.lock().retain(|export, _| {
            !(export == volume
                || export
                    .strip_prefix(volume)
                    .is_some_and(|rest| rest.starts_with('@')))
        });
    }

    /// Forgets the connections of one export (a deleted snapshot).
    pub fn forget_export(&self, name: &str) {
        self.by_export.lock().remove(name);
    }

    fn matching(&self, want: impl Fn(&str) -> bool) -> Vec<ClientView> {
        let mut map = self.by_export.lock();
        let mut out = Vec::new();
        map.retain(|export, entries| {
            entries.retain(|e| e.alive.strong_count() > 0);
            if want(export) {
                out.extend(entries.iter().map(|e| e.view.clone()));
            }
            !entries.is_empty()
        });
        out.sort_by(|a, b| (a.connected_unix_s, &a.remote).cmp(&(b.connected_unix_s, &b.remote)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn closed_connections_drop_out() {
        let clients = Clients::default();
        let nbd: Arc<dyn Any + Send + Sync> = Arc::new(1u8);
        let snap: Arc<dyn Any + Send + Sync> = Arc::new(2u8);
        let addr = "127.0.0.1:5000".parse().ok();
        clients.add("vm", "nbd", addr, None, Arc::downgrade(&nbd));
        clients.add("vm@s", "nbd", addr, None, Arc::downgrade(&snap));
        clients.add("vm2", "nbd", addr, None, Arc::downgrade(&snap));
        assert_eq!(clients.of_export("vm").len(), 1);
        assert_eq!(clients.of_volume_and_snapshots("vm").len(), 2);
        assert_eq!(clients.of_volume_and_snapshots("v").len(), 0);
        drop(nbd);
        assert_eq!(clients.of_export("vm").len(), 0);
        assert_eq!(clients.of_volume_and_snapshots("vm").len(), 1);
        clients.forget_volume("vm");
        assert_eq!(clients.of_volume_and_snapshots("vm").len(), 0);
        assert_eq!(clients.of_export("vm2").len(), 1);
    }
}
