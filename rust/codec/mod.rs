//! Wire formats shared by several dialects, without I/O and without Python: each file reads
//! or writes one format, and the dialects build their own meaning on top.

pub mod json;
