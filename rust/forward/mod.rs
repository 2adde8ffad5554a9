//! The fast path's delivery layer: every connection's pending output (`outboxes`), the route
//! table mapping addresses to connections (`routes`), what crosses to other instances
//! (`crossing`), and the buffers lent to Python without a copy (`lent`).

pub mod crossing;
pub mod lent;
pub mod maps;
pub mod outboxes;
pub mod routes;
