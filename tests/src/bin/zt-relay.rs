//! `zt-relay`: the least a userspace proxy can do, for `zt-bench`'s
//! `bare-relay` scenario. It accepts TCP connections and copies bytes to a
//! fixed destination and back: no TLS, no HTTP/2, no policy, no capture.
//! `zt-bench` runs one in the client's pod and one in the server's, so a
//! connection takes the mesh's shape (client -> relay -> relay -> server)
//! and the figures show the floor a two-hop userspace relay reaches on this
//! machine, next to ztunnel's.
//!
//! `--listen ADDR --to ADDR`, repeatable in pairs: the n-th `--listen`
//! forwards to the n-th `--to`. Prints `READY` once every listener is
//! bound, nothing per connection (nobody reads a bench helper's output, and
//! a full pipe would stall it), and on SIGTERM exits 0 after printing
//! `RELAYED connections=N failed=M` on stderr.

use std::{
    net::SocketAddr,
    process::ExitCode,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use clap::Parser;
use tokio::{
    net::{TcpListener, TcpStream},
    signal::unix::{SignalKind, signal},
};

/// Upper bound of one outbound connect: a relay whose destination is gone
/// must fail the client's connection, not hold it. Five seconds is what
/// `zt-probe` clients and iperf3 (`--connect-timeout 5000`) wait too.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Copy buffer per direction: 64 KiB, the largest segment the kernel
/// offloads in one go, so a bulk stream moves in few syscalls (tokio's
/// default is 8 KiB).
const BUFFER: usize = 64 * 1024;

/// Pause after a failed `accept` (e.g. out of descriptors), so the loop
/// does not spin while nothing can be accepted.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

/// Data-plane worker threads: ztunnel's default `--worker-threads`, so the
/// relay gets the same share of the machine's cores.
const WORKER_THREADS: usize = 2;

#[derive(Parser)]
#[command(about = "minimal TCP relay (the benchmark's floor)")]
struct Cli {
    /// Address to accept on (repeatable; paired with `--to` in order).
    #[arg(long = "listen", required = true)]
    listen: Vec<SocketAddr>,
    /// Where the connections of the matching `--listen` go.
    #[arg(long = "to", required = true)]
    to: Vec<SocketAddr>,
    /// Worker threads of the runtime.
    #[arg(long, default_value_t = WORKER_THREADS)]
    worker_threads: usize,
}

/// What the relay did, reported when it stops.
#[derive(Default)]
struct Tally {
    relayed: AtomicU64,
    failed: AtomicU64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.listen.len() != cli.to.len() {
        eprintln!(
            "zt-relay: {} --listen but {} --to: they go in pairs",
            cli.listen.len(),
            cli.to.len()
        );
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cli.worker_threads.max(1))
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("zt-relay: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("zt-relay: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> std::io::Result<()> {
    let mut terminate = signal(SignalKind::terminate())?;
    let tally = Arc::new(Tally::default());
    let mut listeners = Vec::new();
    for (listen, to) in cli.listen.iter().zip(&cli.to) {
        let listener = TcpListener::bind(listen).await.map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot listen on {listen}: {e}"))
        })?;
        listeners.push((listener, *to));
    }
    println!("READY");
    for (listener, to) in listeners {
        tokio::spawn(accept_loop(listener, to, Arc::clone(&tally)));
    }
    terminate.recv().await;
    eprintln!(
        "RELAYED connections={} failed={}",
        tally.relayed.load(Ordering::Relaxed),
        tally.failed.load(Ordering::Relaxed)
    );
    Ok(())
}

async fn accept_loop(listener: TcpListener, to: SocketAddr, tally: Arc<Tally>) {
    loop {
        match listener.accept().await {
            Ok((inbound, _)) => {
                let tally = Arc::clone(&tally);
                tokio::spawn(async move {
                    let counter = if relay(inbound, to).await.is_ok() {
                        &tally.relayed
                    } else {
                        &tally.failed
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                });
            }
            Err(_) => tokio::time::sleep(ACCEPT_BACKOFF).await,
        }
    }
}

/// One connection: connect to `to` (bounded), then copy both ways until
/// both sides have closed; a half-close is passed on.
async fn relay(mut inbound: TcpStream, to: SocketAddr) -> std::io::Result<()> {
    inbound.set_nodelay(true)?;
    let mut outbound = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(to))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    outbound.set_nodelay(true)?;
    tokio::io::copy_bidirectional_with_sizes(&mut inbound, &mut outbound, BUFFER, BUFFER).await?;
    Ok(())
}
