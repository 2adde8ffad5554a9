//! RMB: envelopes read straight from protobuf bytes, and the session scanner.

pub mod envelope;
pub mod scanner;
