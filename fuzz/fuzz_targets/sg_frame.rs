//! `cargo fuzz run sg_frame`: see rust/fuzzing.rs for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| _core::fuzzing::sg_frame(data));
