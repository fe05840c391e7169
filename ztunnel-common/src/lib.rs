//! Everything ztunnel's kernel programs and its userspace must agree on:
//! ports, the socket mark, map names, and the `#[repr(C)]` layout of every
//! map key and value. One definition, used by both sides; there are no
//! copies anywhere else.
//!
//! Byte order is part of each field's name or doc: the kernel hands us
//! addresses in network order and some ports in host order, and mixing them
//! up is the classic bug in this kind of code.
#![no_std]

pub mod maps;
pub mod ports;

pub use maps::*;
pub use ports::*;
