//! What talking to istiod needs, whichever service is called (the CA, or
//! xDS): a TLS channel that verifies istiod against the mesh root, and the
//! credentials every call carries (`authorization: Bearer <token>`, read
//! again per call because the kubelet rotates it, and `clusterid`).

use std::{path::Path, time::Duration};

use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// TCP connect to istiod.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A channel to istiod, dialled on first use.
#[derive(Debug, Clone)]
pub struct IstiodChannel {
    /// The channel.
    pub channel: Channel,
    /// The name istiod's certificate must carry (the address's host).
    pub host: String,
    /// The root file's text.
    pub root_pem: String,
}

/// Why a channel could not be made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChannelError {
    /// The address is not `host:port`.
    Address(String),
    /// The root file cannot be read.
    Root(String),
}

/// How the calls on a channel end.
#[derive(Debug, Clone, Copy)]
pub enum Calls {
    /// Each call must end within this (unary calls).
    Bounded(Duration),
    /// Calls are long-lived streams: no bound on the call, but HTTP/2
    /// keep-alive PINGs every `.0`, and a PING unanswered for `.1` drops
    /// the connection, so a dead istiod is noticed.
    Streaming(Duration, Duration),
}

/// A lazy TLS channel to `address` (`host:port`, an `https://` prefix is
/// accepted), verifying istiod against the PEM roots in `root_cert`.
pub fn channel(
    address: &str,
    root_cert: &Path,
    calls: Calls,
) -> Result<IstiodChannel, ChannelError> {
    let address = address.strip_prefix("https://").unwrap_or(address);
    let uri: http::Uri = format!("https://{address}")
        .parse()
        .map_err(|e| ChannelError::Address(format!("{e}")))?;
    let host = uri
        .host()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| ChannelError::Address("no host".to_owned()))?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    if uri.port_u16().is_none() {
        return Err(ChannelError::Address(
            "no port (istiod's is 15012)".to_owned(),
        ));
    }
    let root_pem =
        std::fs::read_to_string(root_cert).map_err(|e| ChannelError::Root(e.to_string()))?;
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&root_pem))
        .domain_name(host.clone());
    let endpoint = Endpoint::from(uri)
        .tls_config(tls)
        .map_err(|e| ChannelError::Address(e.to_string()))?
        .connect_timeout(CONNECT_TIMEOUT);
    let endpoint = match calls {
        Calls::Bounded(limit) => endpoint.timeout(limit),
        Calls::Streaming(interval, timeout) => endpoint
            .http2_keep_alive_interval(interval)
            .keep_alive_timeout(timeout)
            .keep_alive_while_idle(true),
    };
    Ok(IstiodChannel {
        channel: endpoint.connect_lazy(),
        host,
        root_pem,
    })
}

/// Reads the bearer token (trimmed); an empty file is an error.
pub fn read_token(path: &Path) -> Result<String, String> {
    let token = std::fs::read_to_string(path)
        .map_err(|e| format!("reading the token {}: {e}", path.display()))?;
    let token = token.trim();
    if token.is_empty() {
        return Err(format!("the token file {} is empty", path.display()));
    }
    Ok(token.to_owned())
}

/// Puts istiod's credentials on `request`: the token in `token_file` as
/// `authorization: Bearer`, and `clusterid`.
pub fn authenticate<T>(
    request: &mut tonic::Request<T>,
    token_file: &Path,
    cluster_id: &str,
) -> Result<(), String> {
    let token = read_token(token_file)?;
    let headers = request.metadata_mut();
    headers.insert(
        "authorization",
        format!("Bearer {token}")
            .parse()
            .map_err(|_| "the token is not valid in a header".to_owned())?,
    );
    headers.insert(
        "clusterid",
        cluster_id
            .parse()
            .map_err(|_| "the cluster id is not valid in a header".to_owned())?,
    );
    Ok(())
}

/// A gRPC status in a sentence, with the code's name.
pub fn describe(status: &tonic::Status) -> String {
    let message = status.message();
    if message.is_empty() {
        format!("{:?}", status.code())
    } else {
        format!("{:?}: {message}", status.code())
    }
}
