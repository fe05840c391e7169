//! `zt-waypoint`: a small waypoint (an HBONE server) for the tests, and a
//! direct HBONE client for the tests of traffic that skips the waypoint.
//!
//! - `serve`: listens for HBONE (mutual TLS, HTTP/2 `CONNECT`) with a
//!   certificate for `--identity` from the cluster's development CA. For
//!   each `CONNECT` it prints `RECORD authority=<a> peer=<spiffe id>
//!   forwarded=<Forwarded header or ->`, then carries the stream on over
//!   HBONE to the endpoint: `--route AUTHORITY=ENDPOINT` when given for that
//!   authority, else the authority itself, at the endpoint's port 15008,
//!   presenting its own identity (as a waypoint does). Answers 200 once the
//!   endpoint accepted, 503 when it did not.
//! - `connect`: one `CONNECT` straight to a pod's 15008 as `--identity`;
//!   sends a payload and prints `RESULT status=<code> echoed=<bool>` (or
//!   `RESULT status=error error=<why>` when no answer came).

use std::{
    collections::HashMap,
    net::SocketAddr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use bytes::Bytes;
use clap::{Parser, Subcommand};
use h2::{RecvStream, SendStream};
use http::{Method, Request, Response, StatusCode};
use rustls::{ClientConfig, ServerConfig, pki_types::ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use ztunnel::{
    identity::{Identity, ca::CertificateAuthority, identity_of},
    tls::{
        ALPN_H2, provider,
        verify::{SpiffeClientVerifier, SpiffeServerVerifier},
    },
};

/// Each step (connect, handshakes, the answer) gets at most this long.
const STEP: Duration = Duration::from_secs(10);

#[derive(Parser)]
#[command(name = "zt-waypoint")]
struct Cli {
    /// The cluster's development CA folder (ztunnel's `--ca-dir`).
    #[arg(long)]
    ca_dir: PathBuf,
    /// The SPIFFE id this program presents.
    #[arg(long)]
    identity: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Be a waypoint.
    Serve {
        /// Where to listen.
        #[arg(long, default_value = "[::]:15008")]
        listen: SocketAddr,
        /// `AUTHORITY=ENDPOINT`: where streams for an authority (a service
        /// VIP:port) go; others go to their authority.
        #[arg(long = "route")]
        routes: Vec<String>,
        /// Identities the endpoints may present.
        #[arg(long = "upstream-identity")]
        upstream: Vec<String>,
    },
    /// One direct `CONNECT`.
    Connect {
        /// The pod's HBONE address (IP:15008).
        #[arg(long)]
        to: SocketAddr,
        /// The `:authority`.
        #[arg(long)]
        authority: SocketAddr,
        /// The identity the pod must present.
        #[arg(long)]
        expect: String,
        /// Bytes to send (an echo server sends them back).
        #[arg(long, default_value = "HELLO\n")]
        payload: String,
    },
}

struct Credentials {
    ca: CertificateAuthority,
    identity: Identity,
}

impl Credentials {
    fn load(cli: &Cli) -> Result<Self> {
        let identity = Identity::parse(&cli.identity).context("--identity")?;
        let ca = CertificateAuthority::development(&cli.ca_dir, &identity.trust_domain)
            .context("--ca-dir")?;
        Ok(Self { ca, identity })
    }

    fn roots(&self) -> rustls::RootCertStore {
        let mut store = rustls::RootCertStore::empty();
        for root in self.ca.roots() {
            let _ = store.add(root.clone());
        }
        store
    }

    fn server(&self) -> Result<Arc<ServerConfig>> {
        let cert = self.ca.issue(&self.identity, Duration::from_secs(3600))?;
        let verifier =
            SpiffeClientVerifier::new(self.roots(), &self.identity.trust_domain, provider())?;
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(Arc::new(verifier))
            .with_single_cert(cert.chain, cert.key)?;
        config.alpn_protocols = vec![ALPN_H2.to_vec()];
        Ok(Arc::new(config))
    }

    fn client(&self, expected: Vec<Identity>) -> Result<Arc<ClientConfig>> {
        let cert = self.ca.issue(&self.identity, Duration::from_secs(3600))?;
        let verifier = SpiffeServerVerifier::new(self.roots(), expected, provider());
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_auth_cert(cert.chain, cert.key)?;
        config.alpn_protocols = vec![ALPN_H2.to_vec()];
        Ok(Arc::new(config))
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let credentials = Credentials::load(&cli)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::Serve {
            listen,
            routes,
            upstream,
        } => {
            let routes = routes
                .iter()
                .map(|r| {
                    let (from, to) = r
                        .split_once('=')
                        .ok_or_else(|| anyhow!("--route {r}: AUTHORITY=ENDPOINT"))?;
                    Ok((from.parse()?, to.parse()?))
                })
                .collect::<Result<HashMap<SocketAddr, SocketAddr>>>()?;
            let upstream = upstream
                .iter()
                .map(|u| Identity::parse(u).context("--upstream-identity"))
                .collect::<Result<Vec<_>>>()?;
            let waypoint = Arc::new(Waypoint {
                server: credentials.server()?,
                client: credentials.client(upstream)?,
                routes,
            });
            runtime.block_on(serve(listen, waypoint))
        }
        Command::Connect {
            to,
            authority,
            expect,
            payload,
        } => {
            let client = credentials.client(vec![Identity::parse(&expect)?])?;
            let line = match runtime.block_on(connect_once(&client, to, authority, &payload)) {
                Ok((status, echoed)) => {
                    format!("RESULT status={} echoed={echoed}", status.as_u16())
                }
                Err(e) => format!("RESULT status=error error={e:#}"),
            };
            println!("{line}");
            Ok(())
        }
    }
}

struct Waypoint {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    routes: HashMap<SocketAddr, SocketAddr>,
}

async fn serve(listen: SocketAddr, waypoint: Arc<Waypoint>) -> Result<()> {
    let listener = TcpListener::bind(listen).await?;
    println!("READY {listen}");
    let acceptor = TlsAcceptor::from(Arc::clone(&waypoint.server));
    loop {
        let (tcp, _) = listener.accept().await?;
        let (acceptor, waypoint) = (acceptor.clone(), Arc::clone(&waypoint));
        tokio::spawn(async move {
            if let Err(e) = downstream(tcp, acceptor, waypoint).await {
                println!("ERROR downstream: {e:#}");
            }
        });
    }
}

async fn downstream(tcp: TcpStream, acceptor: TlsAcceptor, waypoint: Arc<Waypoint>) -> Result<()> {
    let tls = tokio::time::timeout(STEP, acceptor.accept(tcp)).await??;
    let peer = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .and_then(|c| identity_of(c))
        .map_or_else(|| "-".to_owned(), |i| i.to_string());
    let mut conn = tokio::time::timeout(STEP, h2::server::handshake(tls)).await??;
    while let Some(request) = conn.accept().await {
        let (request, respond) = request?;
        let (waypoint, peer) = (Arc::clone(&waypoint), peer.clone());
        tokio::spawn(async move {
            if let Err(e) = stream(request, respond, &waypoint, &peer).await {
                println!("ERROR stream: {e:#}");
            }
        });
    }
    Ok(())
}

async fn stream(
    request: Request<RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    waypoint: &Waypoint,
    peer: &str,
) -> Result<()> {
    let authority = request
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .unwrap_or_default();
    let forwarded = request
        .headers()
        .get(http::header::FORWARDED)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-");
    println!("RECORD authority={authority} peer={peer} forwarded={forwarded}");
    let answer = |status: StatusCode| Response::builder().status(status).body(());
    if request.method() != Method::CONNECT {
        respond.send_response(answer(StatusCode::METHOD_NOT_ALLOWED)?, true)?;
        return Ok(());
    }
    let authority: SocketAddr = authority.parse().context("authority")?;
    let endpoint = waypoint
        .routes
        .get(&authority)
        .copied()
        .unwrap_or(authority);
    let (up_send, up_recv) = match open(&waypoint.client, endpoint, endpoint).await {
        Ok(opened) => opened,
        Err(e) => {
            println!("UPSTREAM_FAILED authority={authority} endpoint={endpoint} error={e:#}");
            respond.send_response(answer(StatusCode::SERVICE_UNAVAILABLE)?, true)?;
            return Ok(());
        }
    };
    let down_send = respond.send_response(answer(StatusCode::OK)?, false)?;
    let down_recv = request.into_body();
    tokio::try_join!(pump(down_recv, up_send), pump(up_recv, down_send))?;
    Ok(())
}

/// HBONE to `endpoint`'s port 15008, `CONNECT authority`; the stream once
/// the endpoint answered 200.
async fn open(
    client: &Arc<ClientConfig>,
    endpoint: SocketAddr,
    authority: SocketAddr,
) -> Result<(SendStream<Bytes>, RecvStream)> {
    let hbone = SocketAddr::new(endpoint.ip(), 15008);
    let (response, stream) = connect(client, hbone, authority).await?;
    if response.status() != StatusCode::OK {
        bail!("{hbone} answered {}", response.status());
    }
    Ok((stream, response.into_body()))
}

/// TLS and HTTP/2 to `hbone`, then `CONNECT authority`: the answer.
async fn connect(
    client: &Arc<ClientConfig>,
    hbone: SocketAddr,
    authority: SocketAddr,
) -> Result<(Response<RecvStream>, SendStream<Bytes>)> {
    let tcp = tokio::time::timeout(STEP, TcpStream::connect(hbone)).await??;
    let name = ServerName::IpAddress(hbone.ip().into());
    let tls = tokio::time::timeout(
        STEP,
        TlsConnector::from(Arc::clone(client)).connect(name, tcp),
    )
    .await??;
    let (send, conn) = tokio::time::timeout(STEP, h2::client::handshake(tls)).await??;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut send = tokio::time::timeout(STEP, send.ready()).await??;
    let request = Request::builder()
        .method(Method::CONNECT)
        .uri(authority.to_string())
        .body(())?;
    let (response, stream) = send.send_request(request, false)?;
    let response = tokio::time::timeout(STEP, response).await??;
    Ok((response, stream))
}

/// Moves one direction until its end of stream.
async fn pump(mut from: RecvStream, mut to: SendStream<Bytes>) -> Result<()> {
    while let Some(data) = from.data().await {
        let mut data = data?;
        let _ = from.flow_control().release_capacity(data.len());
        while !data.is_empty() {
            to.reserve_capacity(data.len());
            let granted = std::future::poll_fn(|cx| to.poll_capacity(cx))
                .await
                .ok_or_else(|| anyhow!("stream closed"))??;
            to.send_data(data.split_to(granted.min(data.len())), false)?;
        }
    }
    to.send_data(Bytes::new(), true)?;
    Ok(())
}

async fn connect_once(
    client: &Arc<ClientConfig>,
    to: SocketAddr,
    authority: SocketAddr,
    payload: &str,
) -> Result<(StatusCode, bool)> {
    let (response, mut stream) = connect(client, to, authority).await?;
    let status = response.status();
    if status != StatusCode::OK {
        return Ok((status, false));
    }
    stream.send_data(Bytes::from(payload.to_owned()), true)?;
    let mut body = response.into_body();
    let mut echoed = Vec::new();
    let deadline = Instant::now() + STEP;
    while echoed.len() < payload.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, body.data()).await {
            Ok(Some(Ok(data))) => {
                let _ = body.flow_control().release_capacity(data.len());
                echoed.extend_from_slice(&data);
            }
            _ => break,
        }
    }
    Ok((status, echoed == payload.as_bytes()))
}
