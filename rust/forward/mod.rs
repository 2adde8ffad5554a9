//! The fast path's delivery layer: every connection's pending output (`outboxes`), the route
//! table mapping addresses to connections (`routes`), what crosses to other instances
//! (`crossing`); `Count` is what each of them counts.

pub mod crossing;
pub mod maps;
pub mod outboxes;
pub mod routes;

/// Messages and bytes forwarded by the fast path (what `/metrics` adds to Python's counters).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Count {
    pub messages: u64,
    pub bytes: u64,
}

impl Count {
    #[inline]
    pub fn add(&mut self, bytes: usize) {
        self.messages += 1;
        self.bytes += bytes as u64;
    }
}
