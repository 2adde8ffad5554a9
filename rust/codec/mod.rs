//! Wire codecs that know no dialect, without I/O: HTTP/1.1, RFC 6455 websocket frames and their masking, JSON,
//! and the one interface through which a dialect's scanner reads the messages the websocket
//! decoder yields (`scanner`). Each file reads or writes one format; the dialects build their
//! own meaning on top.

pub mod http;
pub mod json;
pub mod mask;
pub mod scanner;
pub mod ws;
