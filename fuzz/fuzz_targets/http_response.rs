//! `cargo fuzz run http_response`: see rust/fuzzing.rs for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| _core::fuzzing::http_response(data));
