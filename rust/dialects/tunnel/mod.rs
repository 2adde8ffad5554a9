//! The HTTP tunnel: the relay's hub (`hub`: every decision about a tunnelled request) and
//! what it writes for clients (`answer`), the connector websocket's messages (`wire`) and the
//! connector's per-request core (`connector`).

pub mod answer;
pub mod connector;
pub mod hub;
pub mod wire;
