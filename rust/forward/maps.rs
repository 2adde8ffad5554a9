//! Maps keyed by our own connection ids, which the outboxes and several dialects keep: std's
//! `HashMap` with SipHash where a peer chooses the keys, this where we do.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::forward::routes::ConnId;

/// Hashes a connection id with one multiplication. Ids are ours (a counter), never chosen by a
/// peer, so the map needs no protection against crafted keys, and SipHash costs ~15 ns a
/// lookup, three or four of which each forwarded message makes.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A map keyed by our own connection ids.
pub type IdMap<V> = HashMap<ConnId, V, BuildHasherDefault<IdHasher>>;
