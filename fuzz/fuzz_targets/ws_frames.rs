//! `cargo fuzz run ws_frames`: see rust/fuzzing.rs for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| _core::fuzzing::ws_frames(data));
