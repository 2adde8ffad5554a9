//! `cargo fuzz run rmb_envelope`: see rust/fuzzing.rs for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| _core::fuzzing::rmb_envelope(data));
