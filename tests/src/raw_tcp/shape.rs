//! How an encoded TCP segment becomes IP packets: [`Shape`] names the three
//! ways, [`ip_packets`] builds them. `Frag4` splits the segment into 8-byte
//! IPv4 fragments, so the first fragment holds the ports but not the flags;
//! `Destopts6` puts an IPv6 Destination Options header in front of TCP.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::{AddrPair, PROTO_TCP, checksum};

/// An IPv4 header without options.
pub const IPV4_HEADER_LEN: usize = 20;
/// The fixed IPv6 header.
pub const IPV6_HEADER_LEN: usize = 40;
/// The Destination Options header of [`Shape::Destopts6`]: one PadN option.
pub const DESTOPTS_LEN: usize = 8;
/// IPv6 next header of a Destination Options header.
pub const NEXT_HEADER_DESTOPTS: u8 = 60;
/// Payload bytes per IPv4 fragment in [`Shape::Frag4`]: the smallest legal
/// fragment (offsets count 8-byte units), so the first fragment holds only
/// the ports and the sequence number, and the flags land in the second.
pub const FRAGMENT_PAYLOAD: usize = 8;
/// TTL / hop limit of every packet sent: Linux's default.
const HOP_LIMIT: u8 = 64;

/// IPv4 flag: more fragments follow.
pub(super) const IPV4_MF: u16 = 0x2000;
/// IPv4 flag: do not fragment.
const IPV4_DF: u16 = 0x4000;

/// How the attacker wraps its TCP segments into IP packets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Shape {
    /// One ordinary IPv4 or IPv6 packet per segment.
    Plain,
    /// IPv4 only: each segment split into fragments of
    /// [`FRAGMENT_PAYLOAD`] bytes.
    Frag4,
    /// IPv6 only: a Destination Options header (one PadN option) between
    /// the IPv6 header and TCP.
    Destopts6,
}

/// An IPv4 header without options, with its checksum. `flags_offset` is the
/// 16-bit flags + fragment offset word (offset in 8-byte units).
pub fn ipv4_header(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    id: u16,
    flags_offset: u16,
    payload_len: usize,
) -> [u8; IPV4_HEADER_LEN] {
    let total = (IPV4_HEADER_LEN + payload_len) as u16;
    let mut h = [0u8; IPV4_HEADER_LEN];
    h[0] = 0x45; // version 4, 5 words
    h[2..4].copy_from_slice(&total.to_be_bytes());
    h[4..6].copy_from_slice(&id.to_be_bytes());
    h[6..8].copy_from_slice(&flags_offset.to_be_bytes());
    h[8] = HOP_LIMIT;
    h[9] = PROTO_TCP;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let sum = checksum(&h);
    h[10..12].copy_from_slice(&sum.to_be_bytes());
    h
}

/// The Destination Options header of [`Shape::Destopts6`]: next header,
/// length 0 (8 bytes in all), and one PadN option (type 1) padding the other
/// 6 bytes: a header any stack must skip and accept.
pub fn destopts_padn(next_header: u8) -> [u8; DESTOPTS_LEN] {
    [next_header, 0, 1, 4, 0, 0, 0, 0]
}

/// An IPv6 header; `payload_len` counts everything after it (extension
/// headers included).
pub fn ipv6_header(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    next_header: u8,
    payload_len: usize,
) -> [u8; IPV6_HEADER_LEN] {
    let mut h = [0u8; IPV6_HEADER_LEN];
    h[0] = 0x60; // version 6, traffic class and flow label 0
    h[4..6].copy_from_slice(&(payload_len as u16).to_be_bytes());
    h[6] = next_header;
    h[7] = HOP_LIMIT;
    h[8..24].copy_from_slice(&src.octets());
    h[24..40].copy_from_slice(&dst.octets());
    h
}

/// The IP packets that carry `segment` between `addrs` in `shape`; `ip_id`
/// is the IPv4 identification (every fragment of one segment shares it).
/// Empty when the shape does not fit the family (see [`AddrPair::fits`]).
pub fn ip_packets(addrs: AddrPair, shape: Shape, ip_id: u16, segment: &[u8]) -> Vec<Vec<u8>> {
    match (addrs, shape) {
        (AddrPair::V4 { src, dst }, Shape::Plain) => {
            let mut p = ipv4_header(src, dst, ip_id, IPV4_DF, segment.len()).to_vec();
            p.extend_from_slice(segment);
            vec![p]
        }
        (AddrPair::V4 { src, dst }, Shape::Frag4) => segment
            .chunks(FRAGMENT_PAYLOAD)
            .enumerate()
            .map(|(i, chunk)| {
                let offset_units = (i * FRAGMENT_PAYLOAD / 8) as u16;
                let last = (i + 1) * FRAGMENT_PAYLOAD >= segment.len();
                let flags = if last { 0 } else { IPV4_MF };
                let mut p =
                    ipv4_header(src, dst, ip_id, flags | offset_units, chunk.len()).to_vec();
                p.extend_from_slice(chunk);
                p
            })
            .collect(),
        (AddrPair::V6 { src, dst }, Shape::Plain) => {
            let mut p = ipv6_header(src, dst, PROTO_TCP, segment.len()).to_vec();
            p.extend_from_slice(segment);
            vec![p]
        }
        (AddrPair::V6 { src, dst }, Shape::Destopts6) => {
            let len = DESTOPTS_LEN + segment.len();
            let mut p = ipv6_header(src, dst, NEXT_HEADER_DESTOPTS, len).to_vec();
            p.extend_from_slice(&destopts_padn(PROTO_TCP));
            p.extend_from_slice(segment);
            vec![p]
        }
        (AddrPair::V4 { .. }, Shape::Destopts6) | (AddrPair::V6 { .. }, Shape::Frag4) => vec![],
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::super::{
        ACK, PSH, SYN, Segment, TCP_HEADER_LEN,
        fixtures::{V4, syn},
        ipv4_transport,
    };
    use super::*;

    #[test]
    fn ipv4_header_checksum_matches_known_header() {
        // The textbook header 192.168.0.1 -> 192.168.0.199, UDP, total
        // length 0x73, DF, whose checksum is 0xb861.
        let h = ipv4_header(
            Ipv4Addr::new(192, 168, 0, 1),
            Ipv4Addr::new(192, 168, 0, 199),
            0,
            IPV4_DF,
            0x73 - IPV4_HEADER_LEN,
        );
        let mut udp = h;
        udp[9] = 17; // the known header is UDP; ours says TCP
        udp[10..12].copy_from_slice(&[0, 0]);
        assert_eq!(checksum(&udp), 0xb861);
        assert_eq!(checksum(&h), 0, "our own header verifies");
    }

    #[test]
    fn frag4_splits_the_syn_into_three_8_byte_fragments() {
        let segment = syn().encode(V4);
        let frags = ip_packets(V4, Shape::Frag4, 0x1234, &segment);
        assert_eq!(frags.len(), 3);
        let mut reassembled = Vec::new();
        for (i, frag) in frags.iter().enumerate() {
            let word = u16::from_be_bytes([frag[6], frag[7]]);
            let more = word & IPV4_MF != 0;
            assert_eq!(usize::from(word & 0x1fff), i, "offset in 8-byte units");
            assert_eq!(more, i < 2, "MF on all but the last");
            assert_eq!(word & IPV4_DF, 0, "fragments never say DF");
            assert_eq!(u16::from_be_bytes([frag[4], frag[5]]), 0x1234, "one id");
            let total = usize::from(u16::from_be_bytes([frag[2], frag[3]]));
            assert_eq!(total, frag.len());
            assert_eq!(checksum(&frag[..IPV4_HEADER_LEN]), 0, "header checksum");
            reassembled.extend_from_slice(&frag[IPV4_HEADER_LEN..]);
        }
        let lens: Vec<usize> = frags.iter().map(|f| f.len() - IPV4_HEADER_LEN).collect();
        assert_eq!(lens, [8, 8, 4]);
        assert_eq!(reassembled, segment);
        // The first fragment holds ports and sequence number, not the flags.
        assert_eq!(&frags[0][IPV4_HEADER_LEN..], &segment[..8]);
        assert_eq!(frags[1][IPV4_HEADER_LEN + 13 - 8], SYN);
    }

    #[test]
    fn frag4_data_segment_and_plain_v4() {
        let data = Segment {
            flags: PSH | ACK,
            payload: b"HELLO\n",
            ..syn()
        }
        .encode(V4);
        let frags = ip_packets(V4, Shape::Frag4, 7, &data);
        let lens: Vec<usize> = frags.iter().map(|f| f.len() - IPV4_HEADER_LEN).collect();
        assert_eq!(lens, [8, 8, 8, 2]);
        let plain = &ip_packets(V4, Shape::Plain, 7, &data)[0];
        assert_eq!(u16::from_be_bytes([plain[6], plain[7]]), IPV4_DF);
        let (src, dst, tcp) = ipv4_transport(plain).unwrap();
        assert_eq!((IpAddr::V4(dst), tcp), (V4.dst(), &data[..]));
        assert_eq!(src, Ipv4Addr::new(10, 250, 0, 1));
        assert!(
            ipv4_transport(&frags[0]).is_none(),
            "fragments are not data"
        );
    }

    #[test]
    fn destopts6_header_bytes() {
        assert_eq!(destopts_padn(PROTO_TCP), [6, 0, 1, 4, 0, 0, 0, 0]);
        let addrs = AddrPair::V6 {
            src: Ipv6Addr::LOCALHOST,
            dst: Ipv6Addr::LOCALHOST,
        };
        let segment = syn().encode(addrs);
        let packet = &ip_packets(addrs, Shape::Destopts6, 0, &segment)[0];
        assert_eq!(
            packet.len(),
            IPV6_HEADER_LEN + DESTOPTS_LEN + TCP_HEADER_LEN
        );
        assert_eq!(packet[0] >> 4, 6);
        assert_eq!(u16::from_be_bytes([packet[4], packet[5]]), 28, "ext + TCP");
        assert_eq!(packet[6], NEXT_HEADER_DESTOPTS);
        assert_eq!(packet[7], HOP_LIMIT);
        assert_eq!(&packet[40..48], &destopts_padn(PROTO_TCP));
        let plain = &ip_packets(addrs, Shape::Plain, 0, &segment)[0];
        assert_eq!((plain[6], plain.len()), (PROTO_TCP, 60));
    }

    #[test]
    fn shapes_fit_their_family_only() {
        assert!(ip_packets(V4, Shape::Destopts6, 1, &[0; 20]).is_empty());
        assert!(!V4.fits(Shape::Destopts6) && V4.fits(Shape::Frag4));
        let v6 = AddrPair::new("::1".parse().unwrap(), "::1".parse().unwrap()).unwrap();
        assert!(!v6.fits(Shape::Frag4) && v6.fits(Shape::Destopts6));
        assert!(AddrPair::new("::1".parse().unwrap(), V4.dst()).is_none());
    }
}
