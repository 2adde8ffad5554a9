//! `cargo fuzz run http_request`: see rust/fuzzing.rs for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| _core::fuzzing::http_request(data));
