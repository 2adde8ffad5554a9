//! Each dialect's per-message work: its wire format and its scanner (the decisions the fast
//! path takes inside the websocket decoder's `feed`), pure Rust with a thin `py` binding.

pub mod rmb;
pub mod sbd;
pub mod singyeong;
pub mod tunnel;
