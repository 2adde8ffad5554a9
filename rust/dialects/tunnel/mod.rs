//! The HTTP tunnel: the connector websocket's messages (`wire`) and the connector's
//! per-request core (`connector`).

pub mod connector;
pub mod wire;
