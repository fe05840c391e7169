//! SOCKS5 (RFC 1928) on 15080, for applications that opt in explicitly
//! instead of relying on capture: no authentication, `CONNECT` only, IPv4,
//! IPv6 and domain names. Names are resolved against the mesh state (a
//! workload or service name, optionally `name.namespace[.svc...]`), never
//! with DNS. Once the target is known the connection takes the same path as
//! a captured one (HBONE, same-node, passthrough or deny).

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
    /// Refused with this reply.
    #[error("refused ({0:?})")]
    Refused(Reply),
    /// I/O.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Accepts SOCKS5 clients forever.
pub async fn serve(listener: TcpListener, ctx: OutboundContext) {
    loop {
        let (stream, client) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(pod = %ctx.pod.uid, error = %e, "SOCKS5 accept failed");
                continue;
            }
        };
        let id = next_connection_id();
        let span = tracing::info_span!("conn", id, pod = %ctx.pod.uid, direction = "outbound", via = "socks5", src = %client, dst = tracing::field::Empty);
        let ctx = ctx.clone();
        tokio::spawn(
            async move {
                if let Err(e) = session(stream, &ctx).await {
                    tracing::warn!(error = %e, result = "error", "SOCKS5 connection failed");
                }
            }
            .instrument(span),
        );
    }
}

async fn session(mut stream: TcpStream, ctx: &OutboundContext) -> Result<(), SocksError> {
    let target = handshake(&mut stream).await?;
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
    let client_port = stream.peer_addr().map_or(0, |a| a.port());
    match outbound::open(dst, client_port, ctx).await {
        Ok((upstream, record)) => {
            reply(&mut stream, Reply::Ok).await?;
            outbound::carry(stream, upstream, record)
                .await
                .map_err(|e| SocksError::Io(std::io::Error::other(e)))
        }
        Err(e) => {
            let code = match &e {
                ProxyError::Denied(_) => Reply::NotAllowed,
                ProxyError::Connect { .. } => Reply::Refused,
                _ => Reply::Failure,
            };
            reply(&mut stream, code).await?;
            Err(SocksError::Io(std::io::Error::other(e)))
        }
    }
}

/// Reads the greeting and the request; answers the method selection.
async fn handshake(stream: &mut TcpStream) -> Result<Target, SocksError> {
    let mut head = [0u8; 2];
    stream.read_exact(&mut head).await?;
    if head[0] != VERSION {
        return Err(SocksError::Protocol("version is not 5"));
    }
    let mut methods = vec![0u8; usize::from(head[1])];
    stream.read_exact(&mut methods).await?;
    if !methods.contains(&NO_AUTH) {
        stream.write_all(&[VERSION, NO_ACCEPTABLE_METHOD]).await?;
        return Err(SocksError::Protocol(
            "client does not offer no-authentication",
        ));
    }
    stream.write_all(&[VERSION, NO_AUTH]).await?;

    let mut req = [0u8; 4];
    stream.read_exact(&mut req).await?;
    if req[0] != VERSION {
        return Err(SocksError::Protocol("request version is not 5"));
    }
    if req[1] != CMD_CONNECT {
        reply(stream, Reply::CommandNotSupported).await?;
        return Err(SocksError::Refused(Reply::CommandNotSupported));
    }
    let target = match req[3] {
        ATYP_V4 => {
            let mut b = [0u8; 6];
            stream.read_exact(&mut b).await?;
            Target::Addr(SocketAddr::new(
                Ipv4Addr::new(b[0], b[1], b[2], b[3]).into(),
                u16::from_be_bytes([b[4], b[5]]),
            ))
        }
        ATYP_V6 => {
            let mut b = [0u8; 18];
            stream.read_exact(&mut b).await?;
            let mut ip = [0u8; 16];
            ip.copy_from_slice(&b[..16]);
            Target::Addr(SocketAddr::new(
                Ipv6Addr::from(ip).into(),
                u16::from_be_bytes([b[16], b[17]]),
            ))
        }
        ATYP_NAME => {
            let len = usize::from(stream.read_u8().await?);
            let mut name = vec![0u8; len + 2];
            stream.read_exact(&mut name).await?;
            let port = u16::from_be_bytes([name[len], name[len + 1]]);
            let name = String::from_utf8(name[..len].to_vec())
                .map_err(|_| SocksError::Protocol("name is not UTF-8"))?;
            Target::Name(name, port)
        }
        _ => {
            reply(stream, Reply::AddressNotSupported).await?;
            return Err(SocksError::Refused(Reply::AddressNotSupported));
        }
    };
    Ok(target)
}

async fn reply(stream: &mut TcpStream, code: Reply) -> std::io::Result<()> {
    // BND.ADDR/PORT are not meaningful here; 0.0.0.0:0 as most servers do.
    stream
        .write_all(&[VERSION, code as u8, 0, ATYP_V4, 0, 0, 0, 0, 0, 0])
        .await
}
