//! One outgoing TCP segment: the flag bits and [`Segment`], which encodes a
//! header without options plus data, checksummed for its [`AddrPair`].

use super::{AddrPair, tcp_checksum_v4, tcp_checksum_v6};

/// TCP flag bits (byte 13 of the TCP header).
pub const FIN: u8 = 0x01;
/// See [`FIN`].
pub const SYN: u8 = 0x02;
/// See [`FIN`].
pub const RST: u8 = 0x04;
/// See [`FIN`].
pub const PSH: u8 = 0x08;
/// See [`FIN`].
pub const ACK: u8 = 0x10;

/// A TCP header without options: what every segment built here carries.
pub const TCP_HEADER_LEN: usize = 20;
/// IP protocol number / IPv6 next header of TCP.
pub const PROTO_TCP: u8 = 6;

/// One outgoing TCP segment, without options.
#[derive(Clone, Copy, Debug)]
pub struct Segment<'a> {
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// Sequence number.
    pub seq: u32,
    /// Acknowledgment number (sent as is; meaningful with [`ACK`]).
    pub ack: u32,
    /// Flag bits ([`SYN`], [`ACK`], ...).
    pub flags: u8,
    /// Receive window.
    pub window: u16,
    /// Data.
    pub payload: &'a [u8],
}

impl Segment<'_> {
    /// The segment's bytes, checksummed for `addrs`.
    pub fn encode(&self, addrs: AddrPair) -> Vec<u8> {
        let mut out = Vec::with_capacity(TCP_HEADER_LEN + self.payload.len());
        out.extend_from_slice(&self.sport.to_be_bytes());
        out.extend_from_slice(&self.dport.to_be_bytes());
        out.extend_from_slice(&self.seq.to_be_bytes());
        out.extend_from_slice(&self.ack.to_be_bytes());
        out.push(((TCP_HEADER_LEN / 4) as u8) << 4); // data offset, in words
        out.push(self.flags);
        out.extend_from_slice(&self.window.to_be_bytes());
        out.extend_from_slice(&[0, 0, 0, 0]); // checksum (below), urgent pointer
        out.extend_from_slice(self.payload);
        let sum = match addrs {
            AddrPair::V4 { src, dst } => tcp_checksum_v4(src, dst, &out),
            AddrPair::V6 { src, dst } => tcp_checksum_v6(src, dst, &out),
        };
        out[16..18].copy_from_slice(&sum.to_be_bytes());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::{
        fixtures::{V4, syn},
        parse_tcp,
    };
    use super::*;

    #[test]
    fn segment_layout() {
        let bytes = syn().encode(V4);
        assert_eq!(bytes.len(), TCP_HEADER_LEN);
        assert_eq!(&bytes[..4], &[0x9c, 0x41, 0x1f, 0x90]);
        assert_eq!(&bytes[4..8], &[1, 2, 3, 4]);
        assert_eq!(bytes[12], 0x50);
        assert_eq!(bytes[13], SYN);
        let view = parse_tcp(&bytes).unwrap();
        assert_eq!(
            (view.sport, view.dport, view.seq),
            (40001, 8080, 0x0102_0304)
        );
        assert_eq!(view.flags, SYN);
        assert!(view.payload.is_empty());
    }
}
