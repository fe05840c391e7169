//! The HBONE server's checks on a `CONNECT` stream: method, `:authority`,
//! the authority-vs-arrival-address rule and the own-port rule, on requests
//! shaped the way h2 hands them to the server (an authority-only URI, any
//! headers, `forwarded` included).
//!
//! Asserts: no panic; an accepted request is a `CONNECT` whose authority is
//! exactly the returned `ip:port`, on the arrival address and not on one of
//! ztunnel's own ports; every refusal maps to 400 or 503; headers never
//! change the decision; a request built the way the HBONE client builds it
//! is accepted for exactly its target. The service hint read from
//! `forwarded` (`forwarded_host`, for metrics only) never panics, is one
//! non-empty parameter value, and is exactly the host the client wrote.

#![no_main]

use std::net::{IpAddr, SocketAddr};

use bytes::Bytes;
use http::{Method, Request, StatusCode, Uri, uri};
use libfuzzer_sys::{
    arbitrary::{self, Arbitrary},
    fuzz_target,
};
use ztunnel::hbone::server::{ConnectRefusal, connect_target, forwarded_host};
use ztunnel_common::{INBOUND_HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT, SOCKS5_PORT};

#[derive(Debug, Arbitrary)]
enum MethodChoice {
    Connect,
    Get,
    Other(String),
}

#[derive(Debug, Arbitrary)]
enum Local {
    /// The authority's own IP (when it has one): the accepted path.
    SameAsAuthority,
    Ip(IpAddr),
}

#[derive(Debug, Arbitrary)]
enum AuthorityChoice {
    /// Text, as an HTTP/2 peer may send any `:authority`.
    Raw(String),
    /// A well-formed `ip:port`, so that the rules after parsing are reached.
    Addr(IpAddr, u16),
}

#[derive(Debug, Arbitrary)]
struct Input {
    method: MethodChoice,
    authority: Option<AuthorityChoice>,
    local: Local,
    headers: Vec<(String, Vec<u8>)>,
    forwarded: Option<String>,
}

fn own_port(port: u16) -> bool {
    [
        OUTBOUND_PORT,
        INBOUND_PLAINTEXT_PORT,
        INBOUND_HBONE_PORT,
        SOCKS5_PORT,
    ]
    .contains(&port)
}

/// A request as h2's server builds it: the URI holds only the authority
/// (`CONNECT` has no scheme or path). `None` where h2 itself would reject
/// the stream as malformed, so the server never sees it.
fn request(input: &Input, with_headers: bool) -> Option<Request<()>> {
    let method = match &input.method {
        MethodChoice::Connect => Method::CONNECT,
        MethodChoice::Get => Method::GET,
        MethodChoice::Other(m) => Method::from_bytes(m.as_bytes()).ok()?,
    };
    let mut parts = uri::Parts::default();
    parts.authority = match &input.authority {
        None => None,
        Some(AuthorityChoice::Raw(text)) => {
            Some(uri::Authority::from_maybe_shared(Bytes::from(text.clone())).ok()?)
        }
        Some(AuthorityChoice::Addr(ip, port)) => {
            Some(SocketAddr::new(*ip, *port).to_string().parse().ok()?)
        }
    };
    let mut builder = Request::builder()
        .method(method)
        .uri(Uri::from_parts(parts).ok()?);
    if with_headers {
        for (name, value) in &input.headers {
            builder = builder.header(name.as_str(), value.as_slice());
        }
        if let Some(forwarded) = &input.forwarded {
            builder = builder.header("forwarded", forwarded.as_str());
        }
    }
    builder.body(()).ok()
}

fuzz_target!(|input: Input| {
    let Some(bare) = request(&input, false) else {
        return;
    };
    let named: Option<SocketAddr> = bare.uri().authority().and_then(|a| a.as_str().parse().ok());
    let local = match (&input.local, named) {
        (Local::SameAsAuthority, Some(addr)) => addr.ip(),
        (Local::SameAsAuthority, None) => IpAddr::from([10, 0, 0, 1]),
        (Local::Ip(ip), _) => *ip,
    };
    let decision = connect_target(&bare, local);
    match decision {
        Ok(target) => {
            assert_eq!(bare.method(), Method::CONNECT);
            assert_eq!(Some(target), named);
            assert_eq!(target.ip(), local);
            assert!(!own_port(target.port()));
        }
        Err(refusal) => {
            let status = refusal.status();
            assert!(status == StatusCode::BAD_REQUEST || status == StatusCode::SERVICE_UNAVAILABLE);
            if let Some(target) = refusal.target() {
                assert_eq!(Some(target), named);
            }
            if matches!(refusal, ConnectRefusal::OwnPort(_)) {
                assert!(own_port(
                    named.expect("an own-port refusal named a target").port()
                ));
            }
        }
    }
    // Whatever the client claims in headers changes nothing.
    if let Some(with_headers) = request(&input, true) {
        assert_eq!(connect_target(&with_headers, local), decision);
        if let Some(host) = forwarded_host(&with_headers) {
            assert!(!host.is_empty() && !host.contains([',', ';']), "{host:?}");
        }
    }
    // The HBONE client (hbone::pool) writes the URI as `target.to_string()`
    // and adds `forwarded`; the server must take exactly that target back.
    if let Some(AuthorityChoice::Addr(ip, port)) = &input.authority {
        let target = SocketAddr::new(*ip, *port);
        let client = Request::builder()
            .method(Method::CONNECT)
            .uri(target.to_string())
            .header(
                "forwarded",
                format!("for=\"{local}\";host=web.test.svc.cluster.local"),
            )
            .body(())
            .expect("the client's request builds");
        assert_eq!(
            forwarded_host(&client).as_deref(),
            Some("web.test.svc.cluster.local")
        );
        let expected = if own_port(*port) {
            Err(ConnectRefusal::OwnPort(target))
        } else {
            Ok(target)
        };
        assert_eq!(connect_target(&client, target.ip()), expected);
    }
});
