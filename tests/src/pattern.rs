//! The deterministic payload test clients send: byte `i` is a function of
//! `i`, so reordering or duplication changes checksums, and any slice of it
//! can serve as a marker that a sniffer looks for on the wire.

/// Fills `buf` with the pattern starting at stream offset `offset`.
pub fn fill(buf: &mut [u8], offset: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        let x = offset + i as u64;
        *b = (x ^ (x >> 8) ^ (x >> 16)).wrapping_mul(31) as u8;
    }
}

/// `len` bytes of the pattern at `offset`.
pub fn slice(offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, offset);
    v
}
