//! Reading what the raw receive socket hands over: [`ipv4_transport`] strips
//! the IPv4 header, [`parse_tcp`] reads the TCP header. Both take untrusted
//! bytes and return `None` rather than panic on anything malformed.

use std::net::Ipv4Addr;

use super::{IPV4_HEADER_LEN, PROTO_TCP, TCP_HEADER_LEN, shape::IPV4_MF};

/// One received TCP segment, read from untrusted bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpView<'a> {
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// Sequence number.
    pub seq: u32,
    /// Acknowledgment number.
    pub ack: u32,
    /// Flag bits.
    pub flags: u8,
    /// Data after the header and its options.
    pub payload: &'a [u8],
}

/// Reads a TCP segment; `None` when it is too short or its data offset
/// points outside it. The checksum is not checked: over veth the sender's
/// checksum may legitimately still be a partial one (offload), and the
/// kernel has not validated it yet when raw sockets get their copy.
pub fn parse_tcp(segment: &[u8]) -> Option<TcpView<'_>> {
    let header = segment.get(..TCP_HEADER_LEN)?;
    let data_offset = usize::from(header[12] >> 4) * 4;
    if data_offset < TCP_HEADER_LEN {
        return None;
    }
    Some(TcpView {
        sport: u16::from_be_bytes([header[0], header[1]]),
        dport: u16::from_be_bytes([header[2], header[3]]),
        seq: u32::from_be_bytes([header[4], header[5], header[6], header[7]]),
        ack: u32::from_be_bytes([header[8], header[9], header[10], header[11]]),
        flags: header[13],
        payload: segment.get(data_offset..)?,
    })
}

/// What an `AF_INET` raw socket hands over: the IPv4 header, then TCP.
/// Returns source, destination and the TCP bytes; `None` for anything that
/// is not a whole, unfragmented IPv4 TCP packet (the kernel reassembles
/// before raw delivery, so a fragment here would be a surprise, not data).
pub fn ipv4_transport(packet: &[u8]) -> Option<(Ipv4Addr, Ipv4Addr, &[u8])> {
    let first = *packet.first()?;
    let header_len = usize::from(first & 0x0f) * 4;
    if first >> 4 != 4 || header_len < IPV4_HEADER_LEN || packet.len() < header_len {
        return None;
    }
    let total = usize::from(u16::from_be_bytes([packet[2], packet[3]]));
    let flags_offset = u16::from_be_bytes([packet[6], packet[7]]);
    if packet[9] != PROTO_TCP || flags_offset & (IPV4_MF | 0x1fff) != 0 || total < header_len {
        return None;
    }
    let src = Ipv4Addr::new(packet[12], packet[13], packet[14], packet[15]);
    let dst = Ipv4Addr::new(packet[16], packet[17], packet[18], packet[19]);
    // Trailing bytes past the total length (Ethernet padding) are not TCP.
    Some((src, dst, packet.get(header_len..total)?))
}

#[cfg(test)]
mod tests {
    use super::super::{
        Shape,
        fixtures::{V4, syn},
        ip_packets,
    };
    use super::*;

    #[test]
    fn parsers_reject_malformed_input_without_panicking() {
        assert!(parse_tcp(&[0; 19]).is_none());
        let mut bad_offset = [0u8; 20];
        bad_offset[12] = 0x40; // 16 bytes: shorter than the fixed header
        assert!(parse_tcp(&bad_offset).is_none());
        bad_offset[12] = 0xf0; // 60 bytes: longer than the segment
        assert!(parse_tcp(&bad_offset).is_none());
        assert!(ipv4_transport(&[]).is_none());
        assert!(ipv4_transport(&[0x4f; 20]).is_none(), "IHL past the end");
        let mut short_total = ip_packets(V4, Shape::Plain, 1, &[0; 20]).remove(0);
        short_total[2..4].copy_from_slice(&10u16.to_be_bytes());
        assert!(ipv4_transport(&short_total).is_none());
        let mut long_total = ip_packets(V4, Shape::Plain, 1, &[0; 20]).remove(0);
        long_total[2..4].copy_from_slice(&100u16.to_be_bytes());
        assert!(ipv4_transport(&long_total).is_none());
        // Every prefix of a real packet, and of garbage, parses or not,
        // but never panics.
        let real = ip_packets(V4, Shape::Plain, 1, &syn().encode(V4)).remove(0);
        for n in 0..=real.len() {
            let _ = ipv4_transport(&real[..n]).and_then(|(_, _, t)| parse_tcp(t));
            let _ = parse_tcp(&real[..n]);
        }
    }
}
