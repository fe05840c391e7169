//! One HTTP/1.1 GET, over TLS or plain TCP, bounded as a whole by a
//! timeout: the plugin's requests to the Kubernetes API server and to
//! ztunnel's admin endpoint. A fresh connection per request: a plugin
//! process makes two or three and exits.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty, Limited};
use hyper_util::rt::TokioIo;
use rustls::{ClientConfig, pki_types::ServerName};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
};

/// Largest body read: a pod object with its managed fields is tens of KiB.
const MAX_BODY: usize = 4 * 1024 * 1024;

/// Where requests go.
#[derive(Debug, Clone)]
pub struct Server {
    /// Host name or address (no brackets), for the connection, the `Host`
    /// header and the certificate check.
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// Prefixed to every request path (an API server behind a path).
    pub path_prefix: String,
    /// `None`: plain HTTP.
    pub tls: Option<Arc<ClientConfig>>,
}

impl Server {
    /// `https://host:port/prefix` or `http://...`, for messages.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}{}", self.authority(), self.path_prefix)
    }

    /// `host:port` (IPv6 in brackets), also the `Host` header.
    fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// Why a request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// No answer within the bound.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// TCP connect (or name resolution) failed.
    #[error("cannot connect: {0}")]
    Connect(std::io::Error),
    /// The TLS handshake failed (wrong CA, wrong name).
    #[error("TLS handshake failed: {0}")]
    Tls(std::io::Error),
    /// The server name is not a valid DNS name or address.
    #[error("invalid server name {0:?}")]
    Name(String),
    /// HTTP framing.
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
    /// The request could not be built (a header value).
    #[error("request: {0}")]
    Request(#[from] http::Error),
    /// The body was larger than [`MAX_BODY`] or broke off.
    #[error("reading the body: {0}")]
    Body(String),
}

/// GETs `path` with `headers`; returns the status and body. Everything,
/// from resolving the name to the last byte of the body, happens within
/// `timeout`.
pub async fn get(
    server: &Server,
    path: &str,
    headers: &[(&str, String)],
    timeout: Duration,
) -> Result<(u16, Bytes), HttpError> {
    tokio::time::timeout(timeout, get_unbounded(server, path, headers))
        .await
        .map_err(|_| HttpError::Timeout(timeout))?
}

async fn get_unbounded(
    server: &Server,
    path: &str,
    headers: &[(&str, String)],
) -> Result<(u16, Bytes), HttpError> {
    let tcp = TcpStream::connect((server.host.as_str(), server.port))
        .await
        .map_err(HttpError::Connect)?;
    let uri = format!("{}{path}", server.path_prefix);
    match &server.tls {
        Some(config) => {
            let name = ServerName::try_from(server.host.clone())
                .map_err(|_| HttpError::Name(server.host.clone()))?;
            let tls = tokio_rustls::TlsConnector::from(Arc::clone(config))
                .connect(name, tcp)
                .await
                .map_err(HttpError::Tls)?;
            exchange(tls, server, &uri, headers).await
        }
        None => exchange(tcp, server, &uri, headers).await,
    }
}

async fn exchange<S>(
    stream: S,
    server: &Server,
    uri: &str,
    headers: &[(&str, String)],
) -> Result<(u16, Bytes), HttpError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    // Drives the connection; ends when the response is read or on error
    // (which the request then reports).
    let driver = tokio::spawn(connection);
    let mut request = http::Request::get(uri).header(http::header::HOST, server.authority());
    for (name, value) in headers {
        request = request.header(*name, value.as_str());
    }
    let response = sender
        .send_request(request.body(Empty::<Bytes>::new())?)
        .await?;
    let status = response.status().as_u16();
    let body = Limited::new(response.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| HttpError::Body(e.to_string()))?
        .to_bytes();
    driver.abort();
    Ok((status, body))
}
