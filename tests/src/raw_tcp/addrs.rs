//! The two ends of one session: [`AddrPair`] keeps source and destination of
//! one family, so no packet builder ever has to handle a mixed pair.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use super::Shape;

/// Source and destination address of one session, of one family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddrPair {
    /// IPv4.
    V4 {
        /// The attacker's address.
        src: Ipv4Addr,
        /// The target's address.
        dst: Ipv4Addr,
    },
    /// IPv6.
    V6 {
        /// The attacker's address.
        src: Ipv6Addr,
        /// The target's address.
        dst: Ipv6Addr,
    },
}

impl AddrPair {
    /// `None` when the two addresses are of different families.
    pub fn new(src: IpAddr, dst: IpAddr) -> Option<Self> {
        match (src, dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => Some(Self::V4 { src, dst }),
            (IpAddr::V6(src), IpAddr::V6(dst)) => Some(Self::V6 { src, dst }),
            _ => None,
        }
    }

    /// Whether this is an IPv6 pair.
    pub fn is_v6(self) -> bool {
        matches!(self, Self::V6 { .. })
    }

    /// The target's address.
    pub fn dst(self) -> IpAddr {
        match self {
            Self::V4 { dst, .. } => IpAddr::V4(dst),
            Self::V6 { dst, .. } => IpAddr::V6(dst),
        }
    }

    /// Whether `shape` can be sent between these addresses.
    pub fn fits(self, shape: Shape) -> bool {
        match shape {
            Shape::Plain => true,
            Shape::Frag4 => !self.is_v6(),
            Shape::Destopts6 => self.is_v6(),
        }
    }
}

/// The socket address form of a pair's target, for messages.
pub fn target(addrs: AddrPair, port: u16) -> SocketAddr {
    match addrs {
        AddrPair::V4 { dst, .. } => SocketAddr::V4(SocketAddrV4::new(dst, port)),
        AddrPair::V6 { dst, .. } => SocketAddr::V6(SocketAddrV6::new(dst, port, 0, 0)),
    }
}
