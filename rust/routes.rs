//! Route table: which connection holds an RMB session or an SBD public key.
//!
//! Sessions are `(twin, sid)` where an absent sid and an empty sid are different sessions
//! (spec/rmb.md §1.5). Registering a key that is taken returns the displaced connection so the
//! caller can close it; unregistering only removes a mapping that still points at the caller,
//! so a replaced connection closing late never evicts its successor.

use std::collections::HashMap;

use crate::error::{Error, Result};

pub type ConnId = u64;
pub const PUBKEY_LEN: usize = 32;

/// Per twin: the sid-less session and the named ones (lookups borrow the sid, no allocation).
#[derive(Debug, Default)]
struct TwinSessions {
    bare: Option<ConnId>,
    named: HashMap<String, ConnId>,
}

impl TwinSessions {
    fn is_empty(&self) -> bool {
        self.bare.is_none() && self.named.is_empty()
    }
}

#[derive(Debug, Default)]
pub struct Routes {
    twins: HashMap<u32, TwinSessions>,
    sessions: usize,
    pubkeys: HashMap<[u8; PUBKEY_LEN], ConnId>,
}

impl Routes {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn register_session(
        &mut self,
        twin: u32,
        sid: Option<&str>,
        conn: ConnId,
    ) -> Option<ConnId> {
        let entry = self.twins.entry(twin).or_default();
        let previous = match sid {
            None => entry.bare.replace(conn),
            Some(sid) => entry.named.insert(sid.to_owned(), conn),
        };
        match previous {
            None => {
                self.sessions += 1;
                None
            }
            Some(old) if old == conn => None,
            Some(old) => Some(old),
        }
    }

    pub fn lookup_session(&self, twin: u32, sid: Option<&str>) -> Option<ConnId> {
        let entry = self.twins.get(&twin)?;
        match sid {
            None => entry.bare,
            Some(sid) => entry.named.get(sid).copied(),
        }
    }

    pub fn unregister_session(&mut self, twin: u32, sid: Option<&str>, conn: ConnId) -> bool {
        let Some(entry) = self.twins.get_mut(&twin) else {
            return false;
        };
        let removed = match sid {
            None if entry.bare == Some(conn) => {
                entry.bare = None;
                true
            }
            Some(sid) if entry.named.get(sid) == Some(&conn) => {
                entry.named.remove(sid);
                true
            }
            _ => false,
        };
        if removed {
            self.sessions -= 1;
            if entry.is_empty() {
                self.twins.remove(&twin);
            }
        }
        removed
    }

    pub fn register_pubkey(&mut self, pubkey: &[u8], conn: ConnId) -> Result<Option<ConnId>> {
        let key = pubkey_array(pubkey)?;
        Ok(self.pubkeys.insert(key, conn).filter(|old| *old != conn))
    }

    pub fn lookup_pubkey(&self, pubkey: &[u8]) -> Result<Option<ConnId>> {
        Ok(self.lookup_key(&pubkey_array(pubkey)?))
    }

    /// [`Routes::lookup_pubkey`] for a key already known to be 32 bytes.
    pub fn lookup_key(&self, key: &[u8; PUBKEY_LEN]) -> Option<ConnId> {
        self.pubkeys.get(key).copied()
    }

    pub fn unregister_pubkey(&mut self, pubkey: &[u8], conn: ConnId) -> Result<bool> {
        let key = pubkey_array(pubkey)?;
        if self.pubkeys.get(&key) == Some(&conn) {
            self.pubkeys.remove(&key);
            return Ok(true);
        }
        Ok(false)
    }

    pub fn session_count(&self) -> usize {
        self.sessions
    }

    pub fn pubkey_count(&self) -> usize {
        self.pubkeys.len()
    }
}

fn pubkey_array(pubkey: &[u8]) -> Result<[u8; PUBKEY_LEN]> {
    pubkey.try_into().map_err(|_| {
        Error::InvalidArgument(format!(
            "public key must be {PUBKEY_LEN} bytes, got {}",
            pubkey.len()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_returns_displaced_connection() {
        let mut r = Routes::new();
        assert_eq!(r.register_session(7, None, 1), None);
        assert_eq!(r.register_session(7, None, 2), Some(1));
        assert_eq!(
            r.register_session(7, None, 2),
            None,
            "same connection again displaces nothing"
        );
        assert_eq!(r.lookup_session(7, None), Some(2));
        assert_eq!(r.session_count(), 1);
    }

    #[test]
    fn absent_and_empty_sid_are_different_sessions() {
        let mut r = Routes::new();
        r.register_session(7, None, 1);
        r.register_session(7, Some(""), 2);
        r.register_session(7, Some("a"), 3);
        assert_eq!(r.lookup_session(7, None), Some(1));
        assert_eq!(r.lookup_session(7, Some("")), Some(2));
        assert_eq!(r.lookup_session(7, Some("a")), Some(3));
        assert_eq!(r.lookup_session(7, Some("b")), None);
        assert_eq!(r.session_count(), 3);
    }

    #[test]
    fn replaced_connection_does_not_evict_successor() {
        let mut r = Routes::new();
        r.register_session(7, Some("x"), 1);
        r.register_session(7, Some("x"), 2);
        assert!(!r.unregister_session(7, Some("x"), 1));
        assert_eq!(r.lookup_session(7, Some("x")), Some(2));
        assert!(r.unregister_session(7, Some("x"), 2));
        assert_eq!(r.lookup_session(7, Some("x")), None);
        assert_eq!(r.session_count(), 0);
    }

    #[test]
    fn pubkeys_route_and_displace() {
        let mut r = Routes::new();
        let pk = [9u8; 32];
        assert_eq!(r.register_pubkey(&pk, 1).unwrap(), None);
        assert_eq!(r.register_pubkey(&pk, 2).unwrap(), Some(1));
        assert!(!r.unregister_pubkey(&pk, 1).unwrap());
        assert_eq!(r.lookup_pubkey(&pk).unwrap(), Some(2));
        assert!(r.unregister_pubkey(&pk, 2).unwrap());
        assert_eq!(r.pubkey_count(), 0);
        assert!(r.lookup_pubkey(&[0u8; 31]).is_err());
    }
}

pub mod py {
    use pyo3::prelude::*;

    /// Session (twin, sid) -> connection id and 32-byte pubkey -> connection id.
    #[pyclass(module = "rmb_relay._core")]
    #[derive(Default)]
    pub struct RouteTable {
        pub(crate) inner: super::Routes,
    }

    #[pymethods]
    impl RouteTable {
        #[new]
        fn new() -> Self {
            Self::default()
        }

        #[pyo3(signature = (twin, sid, conn_id))]
        fn register_session(&mut self, twin: u32, sid: Option<&str>, conn_id: u64) -> Option<u64> {
            self.inner.register_session(twin, sid, conn_id)
        }

        #[pyo3(signature = (twin, sid))]
        fn lookup_session(&self, twin: u32, sid: Option<&str>) -> Option<u64> {
            self.inner.lookup_session(twin, sid)
        }

        #[pyo3(signature = (twin, sid, conn_id))]
        fn unregister_session(&mut self, twin: u32, sid: Option<&str>, conn_id: u64) -> bool {
            self.inner.unregister_session(twin, sid, conn_id)
        }

        fn register_pubkey(&mut self, pubkey: &[u8], conn_id: u64) -> PyResult<Option<u64>> {
            Ok(self.inner.register_pubkey(pubkey, conn_id)?)
        }

        fn lookup_pubkey(&self, pubkey: &[u8]) -> PyResult<Option<u64>> {
            Ok(self.inner.lookup_pubkey(pubkey)?)
        }

        fn unregister_pubkey(&mut self, pubkey: &[u8], conn_id: u64) -> PyResult<bool> {
            Ok(self.inner.unregister_pubkey(pubkey, conn_id)?)
        }

        #[getter]
        fn session_count(&self) -> usize {
            self.inner.session_count()
        }

        #[getter]
        fn pubkey_count(&self) -> usize {
            self.inner.pubkey_count()
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<RouteTable>()?;
        Ok(())
    }
}
