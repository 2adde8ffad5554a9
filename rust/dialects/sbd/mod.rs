//! SBD: the 32-byte header and commands, and the connection scanner.

pub mod header;
pub mod scanner;
