//! The Internet checksum (RFC 1071), plain for IPv4 headers and under the
//! IPv4 and IPv6 pseudo-headers for TCP.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::PROTO_TCP;

/// Adds `data` as big-endian 16-bit words (an odd last byte is padded with
/// zero, RFC 1071). `u64` so that no realistic length can overflow before
/// [`fold`].
fn sum_words(data: &[u8], mut acc: u64) -> u64 {
    let mut words = data.chunks_exact(2);
    for w in &mut words {
        acc += u64::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = words.remainder() {
        acc += u64::from(*last) << 8;
    }
    acc
}

/// Folds the carries back in and complements: the checksum field's value.
fn fold(mut acc: u64) -> u16 {
    while acc >> 16 != 0 {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

/// The Internet checksum (RFC 1071) of `data`, e.g. of an IPv4 header with
/// its checksum field zeroed. Over data that includes a correct checksum,
/// the result is 0.
pub fn checksum(data: &[u8]) -> u16 {
    fold(sum_words(data, 0))
}

/// The TCP checksum of `segment` (checksum field zeroed) under the IPv4
/// pseudo-header: source, destination, zero, protocol 6, TCP length.
pub fn tcp_checksum_v4(src: Ipv4Addr, dst: Ipv4Addr, segment: &[u8]) -> u16 {
    let mut acc = sum_words(&src.octets(), 0);
    acc = sum_words(&dst.octets(), acc);
    acc += u64::from(PROTO_TCP);
    acc += segment.len() as u64;
    fold(sum_words(segment, acc))
}

/// The TCP checksum of `segment` (checksum field zeroed) under the IPv6
/// pseudo-header (RFC 8200 section 8.1): source, destination, the
/// upper-layer length and next header 6. Extension headers between the IPv6
/// header and TCP are not part of it: the length is TCP's, the next header is
/// TCP's, whatever the IPv6 header's own next header field says.
pub fn tcp_checksum_v6(src: Ipv6Addr, dst: Ipv6Addr, segment: &[u8]) -> u16 {
    let mut acc = sum_words(&src.octets(), 0);
    acc = sum_words(&dst.octets(), acc);
    acc += segment.len() as u64;
    acc += u64::from(PROTO_TCP);
    fold(sum_words(segment, acc))
}

#[cfg(test)]
mod tests {
    use super::super::{AddrPair, DESTOPTS_LEN, IPV6_HEADER_LEN, Shape, fixtures::syn, ip_packets};
    use super::*;

    #[test]
    fn checksum_matches_rfc1071_example() {
        // RFC 1071 section 3: the words sum to 0xddf2, so the checksum is
        // its complement.
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(checksum(&data), !0xddf2);
        // An odd length pads the last byte on the right.
        assert_eq!(checksum(&[0x12]), !0x1200);
    }

    #[test]
    fn tcp_checksum_v4_matches_known_segment() {
        // smoltcp's TCP test segment: 192.168.1.1 -> 192.168.1.2, ports
        // 48896 -> 80, with one option and 4 data bytes; checksum 0x01b6.
        let mut segment = [
            0xbf, 0x00, 0x00, 0x50, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x60, 0x35,
            0x01, 0x23, 0x00, 0x00, 0x02, 0x01, 0x03, 0x03, 0x0c, 0x01, 0xaa, 0x00, 0x00, 0xff,
        ];
        let (src, dst) = (Ipv4Addr::new(192, 168, 1, 1), Ipv4Addr::new(192, 168, 1, 2));
        assert_eq!(tcp_checksum_v4(src, dst, &segment), 0x01b6);
        segment[16..18].copy_from_slice(&[0x01, 0xb6]);
        assert_eq!(tcp_checksum_v4(src, dst, &segment), 0, "verifies");
    }

    #[test]
    fn tcp_checksum_v6_uses_upper_layer_length_and_tcp() {
        // Computed independently (a few lines of Python summing the RFC 8200
        // pseudo-header and the segment) for fd00:250::1 -> fd00:250::2.
        let addrs = AddrPair::V6 {
            src: "fd00:250::1".parse().unwrap(),
            dst: "fd00:250::2".parse().unwrap(),
        };
        let bytes = syn().encode(addrs);
        assert_eq!(u16::from_be_bytes([bytes[16], bytes[17]]), 0xf166);
        let AddrPair::V6 { src, dst } = addrs else {
            unreachable!()
        };
        assert_eq!(tcp_checksum_v6(src, dst, &bytes), 0, "verifies");
        // The Destination Options header changes nothing in the checksum.
        let packet = &ip_packets(addrs, Shape::Destopts6, 0, &bytes)[0];
        assert_eq!(&packet[IPV6_HEADER_LEN + DESTOPTS_LEN..], &bytes[..]);
    }
}
