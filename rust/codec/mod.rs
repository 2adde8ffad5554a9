//! Wire codecs that know no dialect: HTTP/1.1 and RFC 6455 websocket frames, and the one
//! interface through which a dialect's scanner reads the messages the websocket decoder
//! yields (`scanner`).

pub mod http;
pub mod scanner;
pub mod ws;
