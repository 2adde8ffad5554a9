//! The 신경 native path's index (`singyeong.rs`): the non-restricted local clients by
//! (application, key, canonical value), kept in step by Python, and the routing of one
//! readable SEND/BROADCAST into its receivers' outboxes.

use std::collections::HashMap;

use super::{dispatch_text, routable, IdMap, Routable};
use crate::forward::outboxes::Outboxes;
use crate::forward::routes::ConnId;

#[derive(Debug)]
pub(super) struct Client {
    app: String,
    json: bool,
    /// (key, canonical value; None: tainted)
    values: Vec<(String, Option<Vec<u8>>)>,
}

/// `len(app) app len(key) key`: unambiguous for any strings.
pub(super) fn app_key(out: &mut Vec<u8>, app: &str, key: &str) {
    out.clear();
    out.extend_from_slice(&(app.len() as u32).to_le_bytes());
    out.extend_from_slice(app.as_bytes());
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
}

/// The non-restricted local clients by (application, key, canonical value); see module docs.
#[derive(Debug, Default)]
pub struct Index {
    clients: IdMap<Client>,
    pub(super) buckets: HashMap<Vec<u8>, Vec<ConnId>>,
    taint: HashMap<Vec<u8>, u32>,
    rng: u64,
    key: Vec<u8>,
    found: Vec<ConnId>,
    text: Vec<u8>,
    /// SENDs and BROADCASTs answered here (each one frame in; the DISPATCH frames written
    /// are the outboxes' `sg` count, as RMB's and SBD's are): Python adds them to its metrics
    pub sends: u64,
    pub broadcasts: u64,
}

/// What [`Index::route`] did with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// written to this many receivers' outboxes
    Delivered(usize),
    /// not answered here: the frame goes to Python
    Python,
}

impl Index {
    pub fn new(seed: u64) -> Self {
        Index {
            rng: seed | 1,
            ..Index::default()
        }
    }

    pub fn len(&self) -> usize {
        self.clients.len()
    }

    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    /// The client on `conn` is `app` with these values (replacing what it had).
    pub fn set(
        &mut self,
        conn: ConnId,
        app: String,
        json: bool,
        values: Vec<(String, Option<Vec<u8>>)>,
    ) {
        self.remove(conn);
        let mut key = std::mem::take(&mut self.key);
        for (k, v) in &values {
            app_key(&mut key, &app, k);
            match v {
                None => *self.taint.entry(key.clone()).or_default() += 1,
                Some(v) => {
                    key.extend_from_slice(v);
                    self.buckets.entry(key.clone()).or_default().push(conn);
                }
            }
        }
        self.key = key;
        self.clients.insert(conn, Client { app, json, values });
    }

    /// The client on `conn` is gone (or restricted, or closing).
    pub fn remove(&mut self, conn: ConnId) {
        let Some(client) = self.clients.remove(&conn) else {
            return;
        };
        let mut key = std::mem::take(&mut self.key);
        for (k, v) in &client.values {
            app_key(&mut key, &client.app, k);
            match v {
                None => {
                    if let Some(n) = self.taint.get_mut(&key) {
                        *n -= 1;
                        if *n == 0 {
                            self.taint.remove(&key);
                        }
                    }
                }
                Some(v) => {
                    key.extend_from_slice(v);
                    if let Some(members) = self.buckets.get_mut(&key) {
                        if let Some(at) = members.iter().position(|c| *c == conn) {
                            members.swap_remove(at);
                        }
                        if members.is_empty() {
                            self.buckets.remove(&key);
                        }
                    }
                }
            }
        }
        self.key = key;
    }

    pub(super) fn next_random(&mut self) -> u64 {
        // xorshift64*: uniform enough to pick one receiver among the matches
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// The connections every condition matches (into `self.found`); false: Python decides
    /// (a tainted key). The smallest bucket of the conditions is read; its members meet
    /// that condition by construction, so only the others are checked on them (a lone `$eq`,
    /// the usual target, costs two hash lookups and a copy).
    pub(super) fn matching(&mut self, app: &str, conditions: &[(String, Vec<u8>)]) -> bool {
        self.found.clear();
        let mut key = std::mem::take(&mut self.key);
        let mut smallest: Option<(usize, usize)> = None;
        for (at, (k, v)) in conditions.iter().enumerate() {
            app_key(&mut key, app, k);
            if !self.taint.is_empty() && self.taint.contains_key(&key) {
                self.key = key;
                return false;
            }
            if conditions.len() == 1 {
                smallest = Some((0, 0));
                break;
            }
            key.extend_from_slice(v);
            let size = self.buckets.get(&key).map_or(0, Vec::len);
            if smallest.is_none_or(|(s, _)| size < s) {
                smallest = Some((size, at));
            }
        }
        let Some((_, chosen)) = smallest else {
            self.key = key;
            return true;
        };
        let (k, v) = &conditions[chosen];
        app_key(&mut key, app, k);
        key.extend_from_slice(v);
        if let Some(members) = self.buckets.get(&key) {
            if conditions.len() == 1 {
                self.found.extend_from_slice(members);
            } else {
                for &conn in members {
                    let Some(client) = self.clients.get(&conn) else {
                        continue;
                    };
                    let all = conditions.iter().enumerate().all(|(at, (k, v))| {
                        at == chosen
                            || client
                                .values
                                .iter()
                                .any(|(ck, cv)| ck == k && cv.as_deref() == Some(v.as_slice()))
                    });
                    if all {
                        self.found.push(conn);
                    }
                }
            }
        }
        self.key = key;
        true
    }

    /// The receivers of `frame` as this module would pick them (SEND: one at random), or
    /// None when Python decides. `accepts` says whether a connection's outbox takes frames.
    pub fn receivers(
        &mut self,
        r: &Routable<'_>,
        accepts: impl Fn(ConnId) -> bool,
    ) -> Option<Vec<ConnId>> {
        if !self.matching(&r.application, &r.conditions) || self.found.is_empty() {
            return None;
        }
        let chosen = if r.broadcast {
            std::mem::take(&mut self.found)
        } else {
            let at = (self.next_random() % self.found.len() as u64) as usize;
            vec![self.found[at]]
        };
        let ok = chosen
            .iter()
            .all(|c| self.clients.get(c).is_some_and(|cl| cl.json) && accepts(*c));
        ok.then_some(chosen)
    }

    /// Answer `frame` into the outboxes (see the module docs), or leave it to Python.
    pub fn route(&mut self, frame: &[u8], ts_ms: u64, outboxes: &mut Outboxes) -> Decision {
        match routable(frame) {
            Some(r) => self.deliver(&r, ts_ms, outboxes),
            None => Decision::Python,
        }
    }

    /// Write a routable SEND/BROADCAST's DISPATCH into its receivers' outboxes, or leave it
    /// to Python (no receiver, or one that is not JSON or does not accept).
    pub fn deliver(&mut self, r: &Routable<'_>, ts_ms: u64, outboxes: &mut Outboxes) -> Decision {
        let Some(receivers) = self.receivers(r, |c| outboxes.accepts(c)) else {
            return Decision::Python;
        };
        let mut text = std::mem::take(&mut self.text);
        dispatch_text(&mut text, r, ts_ms);
        for &conn in &receivers {
            if outboxes.forward(conn, crate::codec::ws::OP_TEXT, text.len(), |out| {
                out.copy_from_slice(&text)
            }) {
                outboxes.count(conn, text.len());
            }
        }
        self.text = text;
        let n = receivers.len();
        if r.broadcast {
            self.broadcasts += 1;
        } else {
            self.sends += 1;
        }
        if r.broadcast {
            self.found = receivers;
        }
        Decision::Delivered(n)
    }
}
