//! Route table: which connection holds an address. Two kinds of address exist: a session,
//! `(twin, sid)`, where an absent sid and an empty sid are different sessions (spec/rmb.md
//! §1.5), and a 32-byte public key (spec/sbd.md). Registering a key that is taken returns the displaced connection so the
//! caller can close it; unregistering only removes a mapping that still points at the caller,
//! so a replaced connection closing late never evicts its successor.
//!
//! Remote routes: a session another instance of this relay holds, as the cluster's presence
//! cache answered it (`cluster/presence.py`), mirrored here by Python with the cache entry's
//! expiry so the scanner can queue a message for that instance inside `feed`
//! (`crossing.rs`) instead of handing it to Python. Python drops a mirrored route whenever
//! the cache entry it copies is dropped or replaced (and all routes to an instance found
//! gone); a route is used only from when it was set until its expiry (a clock that went back
//! past the setting ends it too), so it lives no longer than the cache entry.

use std::collections::HashMap;

use crate::error::{Error, Result};

pub type ConnId = u64;
pub const PUBKEY_LEN: usize = 32;

/// Per twin, something for its sid-less session and for each named one: the local connection
/// (`twins`) or the remote route (`remote`). Lookups borrow the sid, no allocation.
#[derive(Debug)]
struct BySid<T> {
    bare: Option<T>,
    named: HashMap<String, T>,
}

impl<T> Default for BySid<T> {
    fn default() -> Self {
        Self {
            bare: None,
            named: HashMap::new(),
        }
    }
}

impl<T> BySid<T> {
    fn is_empty(&self) -> bool {
        self.bare.is_none() && self.named.is_empty()
    }

    fn get(&self, sid: Option<&str>) -> Option<&T> {
        match sid {
            None => self.bare.as_ref(),
            Some(sid) => self.named.get(sid),
        }
    }

    /// The previous value, if any.
    fn insert(&mut self, sid: Option<&str>, value: T) -> Option<T> {
        match sid {
            None => self.bare.replace(value),
            Some(sid) => self.named.insert(sid.to_owned(), value),
        }
    }

    fn remove(&mut self, sid: Option<&str>) -> Option<T> {
        match sid {
            None => self.bare.take(),
            Some(sid) => self.named.remove(sid),
        }
    }
}

/// A session held by another instance: that instance's index (Python's numbering), its
/// address name in the bus records (`cluster/keys.py`) and from when until when (the scan
/// clock, ns).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remote {
    pub instance: u32,
    pub name: Box<[u8]>,
    pub since: u64,
    pub expires: u64,
}

#[derive(Debug, Default)]
pub struct Routes {
    twins: HashMap<u32, BySid<ConnId>>,
    sessions: usize,
    pubkeys: HashMap<[u8; PUBKEY_LEN], ConnId>,
    remote: HashMap<u32, BySid<Remote>>,
    remote_count: usize,
}

/// The session an address name stands for (`cluster/keys.py` `address_name`: `r:<twin>` or
/// `r:<twin>:<sid>`), when it is one in its plain form (ASCII digits, twin 1..2^32-1); None
/// leaves the name to Python's parser.
pub fn session_of_name(name: &[u8]) -> Option<(u32, Option<&str>)> {
    let rest = name.strip_prefix(b"r:")?;
    let (twin, sid) = match rest.iter().position(|&b| b == b':') {
        Some(at) => (&rest[..at], Some(&rest[at + 1..])),
        None => (rest, None),
    };
    if twin.is_empty() || twin.len() > 10 || !twin.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let value = twin.iter().fold(0u64, |n, &d| n * 10 + u64::from(d - b'0'));
    let twin = u32::try_from(value).ok().filter(|&t| t != 0)?;
    let sid = match sid {
        Some(sid) => Some(std::str::from_utf8(sid).ok()?),
        None => None,
    };
    Some((twin, sid))
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
        match self.twins.entry(twin).or_default().insert(sid, conn) {
            None => {
                self.sessions += 1;
                None
            }
            Some(old) if old == conn => None,
            Some(old) => Some(old),
        }
    }

    pub fn lookup_session(&self, twin: u32, sid: Option<&str>) -> Option<ConnId> {
        self.twins.get(&twin)?.get(sid).copied()
    }

    /// The connection holding the session an address name stands for ([`session_of_name`]).
    pub fn lookup_name(&self, name: &[u8]) -> Option<ConnId> {
        let (twin, sid) = session_of_name(name)?;
        self.lookup_session(twin, sid)
    }

    pub fn unregister_session(&mut self, twin: u32, sid: Option<&str>, conn: ConnId) -> bool {
        let Some(entry) = self.twins.get_mut(&twin) else {
            return false;
        };
        let removed = entry.get(sid) == Some(&conn);
        if removed {
            entry.remove(sid);
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

    /// Route `(twin, sid)` to another instance from `since` until `expires` (replacing what
    /// was there). The name must fit a bus record (at most 65535 bytes).
    pub fn set_remote(
        &mut self,
        twin: u32,
        sid: Option<&str>,
        instance: u32,
        name: &[u8],
        (since, expires): (u64, u64),
    ) -> Result<()> {
        if name.len() > usize::from(u16::MAX) {
            return Err(Error::InvalidArgument(format!(
                "address name of {} bytes is over 65535",
                name.len()
            )));
        }
        let route = Remote {
            instance,
            name: name.into(),
            since,
            expires,
        };
        if self
            .remote
            .entry(twin)
            .or_default()
            .insert(sid, route)
            .is_none()
        {
            self.remote_count += 1;
        }
        Ok(())
    }

    /// The remote route of `(twin, sid)` if `now` is within its time.
    #[inline]
    pub fn lookup_remote(&self, twin: u32, sid: Option<&str>, now: u64) -> Option<&Remote> {
        let route = self.remote.get(&twin)?.get(sid)?;
        (route.since <= now && now < route.expires).then_some(route)
    }

    /// Drop the remote route of `(twin, sid)`; whether there was one.
    pub fn forget_remote(&mut self, twin: u32, sid: Option<&str>) -> bool {
        let Some(entry) = self.remote.get_mut(&twin) else {
            return false;
        };
        let removed = entry.remove(sid).is_some();
        if removed {
            self.remote_count -= 1;
            if entry.is_empty() {
                self.remote.remove(&twin);
            }
        }
        removed
    }

    /// Drop every remote route to `instance` (it left, was reaped, or refused a write).
    pub fn forget_instance(&mut self, instance: u32) -> usize {
        let mut removed = 0;
        self.remote.retain(|_, entry| {
            if entry.bare.as_ref().is_some_and(|r| r.instance == instance) {
                entry.bare = None;
                removed += 1;
            }
            let before = entry.named.len();
            entry.named.retain(|_, r| r.instance != instance);
            removed += before - entry.named.len();
            !entry.is_empty()
        });
        self.remote_count -= removed;
        removed
    }

    /// Drop every remote route.
    pub fn clear_remote(&mut self) {
        self.remote.clear();
        self.remote_count = 0;
    }

    pub fn remote_count(&self) -> usize {
        self.remote_count
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
    fn session_names_parse_as_keys_py_writes_them() {
        assert_eq!(session_of_name(b"r:7"), Some((7, None)));
        assert_eq!(session_of_name(b"r:7:"), Some((7, Some(""))));
        assert_eq!(session_of_name(b"r:7:a:b"), Some((7, Some("a:b"))));
        assert_eq!(session_of_name(b"r:4294967295"), Some((u32::MAX, None)));
        for name in [
            &b"r:0"[..],
            b"r:4294967296",
            b"r:",
            b"r::x",
            b"r:-1",
            b"s:7",
            b"g:7",
            b"r:12345678901",
        ] {
            assert_eq!(session_of_name(name), None, "{name:?}");
        }
    }

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

    #[test]
    fn remote_routes_expire_and_are_forgotten() {
        let mut r = Routes::new();
        r.set_remote(7, None, 1, b"r:7", (0, 100)).unwrap();
        r.set_remote(7, Some("a"), 2, b"r:7:a", (0, 100)).unwrap();
        r.set_remote(8, Some(""), 1, b"r:8:", (0, 100)).unwrap();
        assert_eq!(r.remote_count(), 3);
        let at = |r: &Routes, twin, sid, now| r.lookup_remote(twin, sid, now).map(|x| x.instance);
        assert_eq!(at(&r, 7, None, 99), Some(1));
        assert_eq!(at(&r, 7, None, 100), None, "expired at its expiry");
        assert_eq!(at(&r, 7, Some("a"), 0), Some(2));
        assert_eq!(at(&r, 7, Some("b"), 0), None);
        assert_eq!(at(&r, 8, None, 0), None, "absent and empty sid differ");
        assert_eq!(&*r.lookup_remote(8, Some(""), 0).unwrap().name, b"r:8:");
        // replacing keeps the count
        r.set_remote(7, None, 3, b"r:7", (120, 200)).unwrap();
        assert_eq!((r.remote_count(), at(&r, 7, None, 150)), (3, Some(3)));
        assert_eq!(
            at(&r, 7, None, 119),
            None,
            "a clock gone back before it was set"
        );
        assert_eq!(r.forget_instance(1), 1);
        assert_eq!(at(&r, 8, Some(""), 0), None);
        assert!(r.forget_remote(7, Some("a")));
        assert!(!r.forget_remote(7, Some("a")));
        assert_eq!(r.remote_count(), 1);
        r.clear_remote();
        assert_eq!((r.remote_count(), at(&r, 7, None, 0)), (0, None));
        assert!(r.set_remote(1, None, 0, &[b'x'; 65536], (0, 1)).is_err());
        // local routes are apart
        assert_eq!(r.session_count(), 0);
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

        /// Route `(twin, sid)` to another instance (`instance`, Python's number of it) from
        /// `since` until `expires` (the scan clock, ns): the scanner queues its messages in
        /// `Outboxes`' crossing buffers. `name` is its address name in bus records.
        #[pyo3(signature = (twin, sid, instance, name, since, expires))]
        fn set_remote(
            &mut self,
            twin: u32,
            sid: Option<&str>,
            instance: u32,
            name: &[u8],
            since: u64,
            expires: u64,
        ) -> PyResult<()> {
            Ok(self
                .inner
                .set_remote(twin, sid, instance, name, (since, expires))?)
        }

        /// The instance a remote route names at `now`, or None (none, or expired).
        #[pyo3(signature = (twin, sid, now))]
        fn lookup_remote(&self, twin: u32, sid: Option<&str>, now: u64) -> Option<u32> {
            self.inner.lookup_remote(twin, sid, now).map(|r| r.instance)
        }

        #[pyo3(signature = (twin, sid))]
        fn forget_remote(&mut self, twin: u32, sid: Option<&str>) -> bool {
            self.inner.forget_remote(twin, sid)
        }

        fn forget_instance(&mut self, instance: u32) -> usize {
            self.inner.forget_instance(instance)
        }

        fn clear_remote(&mut self) {
            self.inner.clear_remote();
        }

        #[getter]
        fn remote_count(&self) -> usize {
            self.inner.remote_count()
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<RouteTable>()?;
        Ok(())
    }
}
