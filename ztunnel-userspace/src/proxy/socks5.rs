//! SOCKS5 (RFC 1928) on 15080, for applications that opt in explicitly
//! instead of relying on capture: no authentication, `CONNECT` only, IPv4,
//! IPv6 and domain names. Names are resolved against the mesh state (a
//! workload or service name, optionally `name.namespace[.svc...]`), never
//! with DNS. Once the target is known the connection takes the same path as
//! a captured one (HBONE, same-node, passthrough or deny). A client that
//! has not sent its greeting and request within the SOCKS5 timeout is
//! disconnected.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
};
use tracing::Instrument as _;

use super::{
    ProxyError, next_connection_id,
    outbound::{self, OutboundContext},
};
use crate::{
    accept::{AcceptLoop, ListenerKind},
    hbone::HboneError,
    timeouts::{Phase, within},
};

const VERSION: u8 = 5;
const NO_AUTH: u8 = 0;
const NO_ACCEPTABLE_METHOD: u8 = 0xff;
const CMD_CONNECT: u8 = 1;
const ATYP_V4: u8 = 1;
const ATYP_NAME: u8 = 3;
const ATYP_V6: u8 = 4;

/// Reply codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Reply {
    /// Succeeded.
    Ok = 0,
    /// General failure.
    Failure = 1,
    /// Not allowed by the ruleset.
    NotAllowed = 2,
    /// Host unreachable (unknown name).
    HostUnreachable = 4,
    /// Connection refused.
    Refused = 5,
    /// Command not supported.
    CommandNotSupported = 7,
    /// Address type not supported.
    AddressNotSupported = 8,
}

/// A parsed request target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// An address.
    Addr(SocketAddr),
    /// A name and port.
    Name(String, u16),
}

/// Why a SOCKS exchange failed before proxying.
#[derive(Debug, thiserror::Error)]
pub enum SocksError {
    /// Not SOCKS5, or malformed.
    #[error("not a SOCKS5 client: {0}")]
    Protocol(&'static str),
    /// The greeting does not offer no-authentication (answered with
    /// "no acceptable method").
    #[error("not a SOCKS5 client: client does not offer no-authentication")]
    NoAcceptableMethod,
    /// Refused with this reply.
    #[error("refused ({0:?})")]
    Refused(Reply),
    /// The client did not finish its greeting and request in time.
    #[error(transparent)]
    TimedOut(#[from] crate::timeouts::TimedOut),
    /// I/O.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Accepts SOCKS5 clients forever.
pub async fn serve(listener: TcpListener, ctx: OutboundContext) {
    // One copy for all connections (see `outbound::serve`).
    let ctx = std::sync::Arc::new(ctx);
    let accept = AcceptLoop::pod(
        ListenerKind::Socks5,
        ctx.shared.limits.pod(&ctx.pod.uid),
        std::sync::Arc::clone(&ctx.shared.metrics),
    );
    accept
        .run(listener, |stream, client| {
            let id = next_connection_id();
            let span = tracing::info_span!("conn", id, pod = %ctx.pod.uid, direction = "outbound", via = "socks5", src = %client, dst = tracing::field::Empty);
            let ctx = std::sync::Arc::clone(&ctx);
            Some(
                async move {
                    if let Err(e) = session(stream, &ctx).await {
                        tracing::warn!(error = %e, result = "error", "SOCKS5 connection failed");
                    }
                }
                .instrument(span),
            )
        })
        .await;
}

async fn session(mut stream: TcpStream, ctx: &OutboundContext) -> Result<(), SocksError> {
    let client = stream.peer_addr()?;
    let target = within(
        Phase::Socks5,
        ctx.shared.timeouts.socks5,
        client,
        &ctx.shared.metrics,
        handshake(&mut stream),
    )
    .await??;
    let state = ctx.shared.state.current();
    let dst = match target {
        Target::Addr(addr) => addr,
        Target::Name(name, port) => {
            let v6 = ctx.pod.ips.iter().all(IpAddr::is_ipv6);
            if let Some(addr) = state.resolve_name(&name, port, v6) {
                addr
            } else {
                reply(&mut stream, Reply::HostUnreachable).await?;
                return Err(SocksError::Refused(Reply::HostUnreachable));
            }
        }
    };
    tracing::Span::current().record("dst", tracing::field::display(dst));
    // Boxed for the reason given in `outbound::handle`.
    match Box::pin(outbound::open(dst, client.port(), ctx, None)).await {
        Ok((upstream, record)) => {
            reply(&mut stream, Reply::Ok).await?;
            outbound::carry(&ctx.shared, &ctx.pod.uid, stream, upstream, record)
                .await
                .map_err(|e| SocksError::Io(std::io::Error::other(e)))
        }
        Err(e) => {
            let code = match &e {
                ProxyError::Denied(_) => Reply::NotAllowed,
                ProxyError::Connect { .. } => Reply::Refused,
                ProxyError::TimedOut(_)
                | ProxyError::Hbone(HboneError::TimedOut(_) | HboneError::OpenFailed { .. }) => {
                    Reply::HostUnreachable
                }
                _ => Reply::Failure,
            };
            reply(&mut stream, code).await?;
            Err(SocksError::Io(std::io::Error::other(e)))
        }
    }
}

/// How far a parser got with the bytes it was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed<T> {
    /// It cannot decide yet: at least this many bytes in all are needed,
    /// always more than it was given.
    Incomplete(usize),
    /// Decided, having used this many bytes.
    Done(T, usize),
}

/// Parses the client's greeting (VER, NMETHODS, METHODS). Done when the
/// client offers no-authentication, the only method served.
///
/// The parsers are pure so that the fuzz targets exercise the very code
/// the listener runs; [`read_parsed`] feeds them exactly the bytes they ask
/// for, never more, so nothing the client sends after its request is
/// consumed here.
pub fn parse_greeting(bytes: &[u8]) -> Result<Parsed<()>, SocksError> {
    let [version, count, ..] = *bytes else {
        return Ok(Parsed::Incomplete(2));
    };
    if version != VERSION {
        return Err(SocksError::Protocol("version is not 5"));
    }
    let len = 2 + usize::from(count);
    let Some(methods) = bytes.get(2..len) else {
        return Ok(Parsed::Incomplete(len));
    };
    if methods.contains(&NO_AUTH) {
        Ok(Parsed::Done((), len))
    } else {
        Err(SocksError::NoAcceptableMethod)
    }
}

/// Parses the request (VER, CMD, RSV, ATYP, DST.ADDR, DST.PORT). A command
/// other than `CONNECT` or an unknown address type is
/// [`SocksError::Refused`] with the reply code to send.
pub fn parse_request(bytes: &[u8]) -> Result<Parsed<Target>, SocksError> {
    let [version, command, _reserved, address_type, ..] = *bytes else {
        return Ok(Parsed::Incomplete(4));
    };
    if version != VERSION {
        return Err(SocksError::Protocol("request version is not 5"));
    }
    if command != CMD_CONNECT {
        return Err(SocksError::Refused(Reply::CommandNotSupported));
    }
    let port_at = |at: usize| u16::from_be_bytes([bytes[at], bytes[at + 1]]);
    match address_type {
        ATYP_V4 => {
            let Some(b) = bytes.get(4..10) else {
                return Ok(Parsed::Incomplete(10));
            };
            let ip = Ipv4Addr::new(b[0], b[1], b[2], b[3]);
            Ok(Parsed::Done(
                Target::Addr(SocketAddr::new(ip.into(), port_at(8))),
                10,
            ))
        }
        ATYP_V6 => {
            let Some(b) = bytes.get(4..22) else {
                return Ok(Parsed::Incomplete(22));
            };
            let mut ip = [0u8; 16];
            ip.copy_from_slice(&b[..16]);
            Ok(Parsed::Done(
                Target::Addr(SocketAddr::new(Ipv6Addr::from(ip).into(), port_at(20))),
                22,
            ))
        }
        ATYP_NAME => {
            let Some(&len) = bytes.get(4) else {
                return Ok(Parsed::Incomplete(5));
            };
            let end = 5 + usize::from(len);
            if bytes.len() < end + 2 {
                return Ok(Parsed::Incomplete(end + 2));
            }
            let name = std::str::from_utf8(&bytes[5..end])
                .map_err(|_| SocksError::Protocol("name is not UTF-8"))?;
            Ok(Parsed::Done(
                Target::Name(name.to_owned(), port_at(end)),
                end + 2,
            ))
        }
        _ => Err(SocksError::Refused(Reply::AddressNotSupported)),
    }
}

/// Reads exactly the bytes `parse` asks for until it decides.
async fn read_parsed<T>(
    stream: &mut TcpStream,
    parse: fn(&[u8]) -> Result<Parsed<T>, SocksError>,
) -> Result<T, SocksError> {
    let mut buf = Vec::new();
    loop {
        match parse(&buf)? {
            Parsed::Done(value, _) => return Ok(value),
            Parsed::Incomplete(needed) => {
                let have = buf.len();
                if needed <= have {
                    // A parser bug must not become a busy loop.
                    return Err(SocksError::Protocol("parser asked for no more bytes"));
                }
                buf.resize(needed, 0);
                stream.read_exact(&mut buf[have..]).await?;
            }
        }
    }
}

/// Reads the greeting and the request; answers the method selection, and
/// refusals the client is owed a reply for.
async fn handshake(stream: &mut TcpStream) -> Result<Target, SocksError> {
    match read_parsed(stream, parse_greeting).await {
        Ok(()) => stream.write_all(&[VERSION, NO_AUTH]).await?,
        Err(e @ SocksError::NoAcceptableMethod) => {
            stream.write_all(&[VERSION, NO_ACCEPTABLE_METHOD]).await?;
            return Err(e);
        }
        Err(e) => return Err(e),
    }
    match read_parsed(stream, parse_request).await {
        Err(SocksError::Refused(code)) => {
            reply(stream, code).await?;
            Err(SocksError::Refused(code))
        }
        result => result,
    }
}

async fn reply(stream: &mut TcpStream, code: Reply) -> std::io::Result<()> {
    // BND.ADDR/PORT are not meaningful here; 0.0.0.0:0 as most servers do.
    stream
        .write_all(&[VERSION, code as u8, 0, ATYP_V4, 0, 0, 0, 0, 0, 0])
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_greeting_needs_every_method_byte_and_no_auth() {
        assert_eq!(parse_greeting(&[]).expect("short"), Parsed::Incomplete(2));
        assert_eq!(
            parse_greeting(&[5, 2, 2]).expect("short"),
            Parsed::Incomplete(4)
        );
        assert_eq!(
            parse_greeting(&[5, 2, 2, 0]).expect("ok"),
            Parsed::Done((), 4)
        );
        assert!(matches!(
            parse_greeting(&[5, 1, 2]),
            Err(SocksError::NoAcceptableMethod)
        ));
        assert!(matches!(
            parse_greeting(&[4, 1, 0]),
            Err(SocksError::Protocol(_))
        ));
    }

    #[test]
    fn requests_for_each_address_type() {
        let v4 = [5, 1, 0, ATYP_V4, 10, 0, 0, 1, 0x1f, 0x90];
        assert_eq!(
            parse_request(&v4).expect("v4"),
            Parsed::Done(Target::Addr("10.0.0.1:8080".parse().expect("addr")), 10)
        );
        assert_eq!(
            parse_request(&v4[..7]).expect("short"),
            Parsed::Incomplete(10)
        );
        let mut v6 = vec![5, 1, 0, ATYP_V6];
        v6.extend_from_slice(&Ipv6Addr::LOCALHOST.octets());
        v6.extend_from_slice(&[0, 80]);
        assert_eq!(
            parse_request(&v6).expect("v6"),
            Parsed::Done(Target::Addr("[::1]:80".parse().expect("addr")), 22)
        );
        let name = [5, 1, 0, ATYP_NAME, 3, b'w', b'e', b'b', 0, 80];
        assert_eq!(
            parse_request(&name[..4]).expect("short"),
            Parsed::Incomplete(5)
        );
        assert_eq!(
            parse_request(&name[..5]).expect("short"),
            Parsed::Incomplete(10)
        );
        assert_eq!(
            parse_request(&name).expect("name"),
            Parsed::Done(Target::Name("web".into(), 80), 10)
        );
    }

    #[test]
    fn refusals_carry_the_reply_code() {
        assert!(matches!(
            parse_request(&[5, 2, 0, ATYP_V4]),
            Err(SocksError::Refused(Reply::CommandNotSupported))
        ));
        assert!(matches!(
            parse_request(&[5, 1, 0, 9]),
            Err(SocksError::Refused(Reply::AddressNotSupported))
        ));
        assert!(matches!(
            parse_request(&[5, 1, 0, ATYP_NAME, 1, 0xff, 0, 80]),
            Err(SocksError::Protocol("name is not UTF-8"))
        ));
    }
}
