//! `zt-hostile`: clients that behave the way a hostile or careless pod does,
//! for the capture tests. Each prints one `RESULT key=value ...` line.
//!
//! - `sport`: one connection from a fixed source port (`SO_REUSEADDR`), send
//!   a payload, read until EOF or a timeout, then close gracefully, so the
//!   side that closed first keeps a `TIME_WAIT` socket for the 4-tuple. Run
//!   twice with the same port to reuse that tuple.
//! - `churn`: open one long-lived connection, note its `getpeername()`, then
//!   make N short connections that are reset at once (connect, RST), and
//!   report `getpeername()` of the long one again plus whether it still
//!   carries data. A per-connection record that is evicted or leaks shows
//!   up as a changed peer name or a failed echo.
//! - `stall`: a slowloris. Opens N connections, sends the first bytes of a
//!   TLS record on each (a record header announcing more than it sends) and
//!   then nothing, and watches for the peer to close them; prints `OPENED
//!   <n>` once they are all open, then `RESULT opened=<n> failed=<f>
//!   closed=<c> max_close_ms=<ms>` (the longest any one was held).
//! - `hang`: N non-blocking connects, spread over the given destinations,
//!   none of which is expected to complete (the pod drops its own SYNs);
//!   prints `OPENED <n> failed=<f>` once they are all started, holds them
//!   for the given time, then `RESULT opened=<n> established=<e>`.
//! - `deaf`: a server that listens and never accepts, so what a client
//!   sends stops once the kernel's receive buffers are full; prints
//!   `LISTENING`, holds for the given time.
//! - `push`: N connections, each written to (never read) until a write
//!   blocks for a second: a sender whose peer stopped reading, so every
//!   relay between them stalls holding whatever it had in flight. Prints
//!   `OPENED <n> written=<bytes>`, holds them for the given time, then
//!   `RESULT opened=<n>`.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use clap::{Parser, Subcommand};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

#[derive(Parser)]
#[command(name = "zt-hostile")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// One connection from a fixed source port.
    Sport {
        /// Destination.
        #[arg(long)]
        connect: SocketAddr,
        /// Source port to bind.
        #[arg(long)]
        sport: u16,
        /// Payload to send.
        #[arg(long, default_value = "HELLO\n")]
        payload: String,
        /// Upper bound for connect and for reading, in milliseconds.
        #[arg(long, default_value_t = 3000)]
        timeout_ms: u64,
    },
    /// Long-lived connection plus N reset short ones.
    Churn {
        /// Destination of the long-lived connection (an echo server).
        #[arg(long)]
        long: SocketAddr,
        /// Destination of the short connections.
        #[arg(long)]
        short: SocketAddr,
        /// Number of short connections.
        #[arg(long, default_value_t = 100_000)]
        count: u32,
        /// Upper bound of the whole run, in seconds.
        #[arg(long, default_value_t = 240)]
        limit_secs: u64,
    },
    /// N connections that stall after a few bytes of a TLS record.
    Stall {
        /// Destination (a TLS port).
        #[arg(long)]
        connect: SocketAddr,
        /// Connections to open.
        #[arg(long, default_value_t = 200)]
        count: usize,
        /// Bytes of the TLS record header to send (at most 5).
        #[arg(long, default_value_t = 5)]
        bytes: usize,
        /// How long to wait for the peer to close them, in seconds.
        #[arg(long, default_value_t = 10)]
        wait_secs: u64,
    },
    /// N connects left hanging.
    Hang {
        /// Destinations, used in turn (several: more source ports).
        #[arg(long, required = true)]
        connect: Vec<SocketAddr>,
        /// Connects to start.
        #[arg(long)]
        count: usize,
        /// How long to hold them, in seconds.
        #[arg(long, default_value_t = 60)]
        hold_secs: u64,
    },
    /// A listener that never accepts.
    Deaf {
        /// Address to listen on.
        #[arg(long)]
        bind: SocketAddr,
        /// How long to listen, in seconds.
        #[arg(long, default_value_t = 60)]
        hold_secs: u64,
    },
    /// Connections written to until they stall.
    Push {
        /// Destination (a `deaf` server).
        #[arg(long)]
        connect: SocketAddr,
        /// Connections to open.
        #[arg(long)]
        count: usize,
        /// How long to hold them once stalled, in seconds.
        #[arg(long, default_value_t = 60)]
        hold_secs: u64,
    },
}

fn main() {
    match Cli::parse().command {
        Command::Sport {
            connect,
            sport,
            payload,
            timeout_ms,
        } => sport_client(connect, sport, &payload, Duration::from_millis(timeout_ms)),
        Command::Churn {
            long,
            short,
            count,
            limit_secs,
        } => churn(long, short, count, Duration::from_secs(limit_secs)),
        Command::Stall {
            connect,
            count,
            bytes,
            wait_secs,
        } => stall(connect, count, bytes, Duration::from_secs(wait_secs)),
        Command::Hang {
            connect,
            count,
            hold_secs,
        } => hang(&connect, count, Duration::from_secs(hold_secs)),
        Command::Deaf { bind, hold_secs } => deaf(bind, Duration::from_secs(hold_secs)),
        Command::Push {
            connect,
            count,
            hold_secs,
        } => push(connect, count, Duration::from_secs(hold_secs)),
    }
}

fn sport_client(dst: SocketAddr, sport: u16, payload: &str, timeout: Duration) {
    let bound = SocketAddr::new(
        if dst.is_ipv6() {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv4Addr::UNSPECIFIED.into()
        },
        sport,
    );
    let socket = Socket::new(Domain::for_address(dst), Type::STREAM, Some(Protocol::TCP))
        .unwrap_or_else(|e| fail(&format!("socket: {e}")));
    socket
        .set_reuse_address(true)
        .unwrap_or_else(|e| fail(&format!("SO_REUSEADDR: {e}")));
    socket
        .bind(&SockAddr::from(bound))
        .unwrap_or_else(|e| fail(&format!("bind {bound}: {e}")));
    if let Err(e) = socket.connect_timeout(&SockAddr::from(dst), timeout) {
        println!("RESULT connected=false error={:?}", e.kind());
        return;
    }
    let mut stream: TcpStream = socket.into();
    let _ = stream.set_read_timeout(Some(timeout));
    // An empty payload sends nothing: a peer that closes a connection with
    // unread data resets it, and only a FIN close leaves a TIME_WAIT.
    if !payload.is_empty() {
        let _ = stream.write_all(payload.as_bytes());
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + timeout;
    let end = loop {
        if Instant::now() >= deadline {
            break "timeout";
        }
        match stream.read(&mut buf) {
            Ok(0) => break "eof",
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break "reset",
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break "timeout";
            }
            Err(_) => break "error",
        }
    };
    // Graceful close (FIN, not RST), so the TIME_WAIT of whoever closed
    // first stays in place for the next run from this port.
    drop(stream);
    println!(
        "RESULT connected=true end={end} data={:?}",
        String::from_utf8_lossy(&got)
    );
}

fn churn(long: SocketAddr, short: SocketAddr, count: u32, limit: Duration) {
    let started = Instant::now();
    let mut held = TcpStream::connect_timeout(&long, Duration::from_secs(5))
        .unwrap_or_else(|e| fail(&format!("long connection to {long}: {e}")));
    let _ = held.set_read_timeout(Some(Duration::from_secs(5)));
    let before = held
        .peer_addr()
        .map_or_else(|e| format!("error:{e}"), |a| a.to_string());
    let mut made = 0u32;
    // Reset or refused, counted apart from other failures: how ztunnel's
    // refusal of a closed destination reaches the application.
    let mut refused = 0u32;
    let mut failed = 0u32;
    let mut first_error = String::from("none");
    for _ in 0..count {
        if started.elapsed() > limit {
            break;
        }
        match TcpStream::connect_timeout(&short, Duration::from_secs(2)) {
            Ok(s) => {
                // Reset at once: the cheapest connection the capture path
                // still sees from connect() to close.
                let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
                made += 1;
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionRefused
                ) =>
            {
                refused += 1;
            }
            Err(e) => {
                if failed == 0 {
                    first_error = format!("{:?}", e.kind());
                }
                failed += 1;
            }
        }
    }
    let after = held
        .peer_addr()
        .map_or_else(|e| format!("error:{e}"), |a| a.to_string());
    let echo_ok = held.write_all(b"still-here\n").is_ok() && {
        let mut buf = [0u8; 11];
        held.read_exact(&mut buf).is_ok() && &buf == b"still-here\n"
    };
    println!(
        "RESULT made={made} refused={refused} failed={failed} before={before} after={after} echo_ok={echo_ok} secs={} first_error={first_error}",
        started.elapsed().as_secs()
    );
}

/// A TLS handshake record header announcing 512 bytes that never come.
const STALLED_RECORD: [u8; 5] = [0x16, 0x03, 0x01, 0x02, 0x00];

/// How often the stalled connections are looked at.
const STALL_POLL: Duration = Duration::from_millis(20);

fn stall(dst: SocketAddr, count: usize, bytes: usize, wait: Duration) {
    let mut open: Vec<(TcpStream, Instant)> = Vec::with_capacity(count);
    let mut failed = 0usize;
    for _ in 0..count {
        match TcpStream::connect_timeout(&dst, Duration::from_secs(3)) {
            Ok(mut s) => {
                let sent = s.write_all(&STALLED_RECORD[..bytes.min(STALLED_RECORD.len())]);
                if sent.is_ok() && s.set_nonblocking(true).is_ok() {
                    open.push((s, Instant::now()));
                } else {
                    failed += 1;
                }
            }
            Err(_) => failed += 1,
        }
    }
    let opened = open.len();
    println!("OPENED {opened}");
    let deadline = Instant::now() + wait;
    let mut max_close = Duration::ZERO;
    let mut buf = [0u8; 512];
    while !open.is_empty() && Instant::now() < deadline {
        // Closed means EOF or an error other than "nothing yet"; a TLS
        // alert the peer sends first is read and ignored.
        open.retain_mut(|(s, since)| {
            let closed = loop {
                match s.read(&mut buf) {
                    Ok(0) => break true,
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break false,
                    Err(_) => break true,
                }
            };
            if closed {
                max_close = max_close.max(since.elapsed());
            }
            !closed
        });
        std::thread::sleep(STALL_POLL);
    }
    println!(
        "RESULT opened={opened} failed={failed} closed={} max_close_ms={}",
        opened - open.len(),
        max_close.as_millis()
    );
}

fn hang(dsts: &[SocketAddr], count: usize, hold: Duration) {
    // One descriptor per connect, beyond the usual soft limit. A pod may
    // raise its soft limit up to the hard one, no further (it has no
    // CAP_SYS_RESOURCE): more connects take more processes.
    let want = (count + 64) as libc::rlim_t;
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid struct to fill.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) };
    limit.rlim_cur = want;
    // SAFETY: a plain struct argument.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const limit) } != 0 {
        fail(&format!(
            "setrlimit({want}): {}",
            std::io::Error::last_os_error()
        ));
    }
    let mut open = Vec::with_capacity(count);
    let mut failed = 0usize;
    for i in 0..count {
        let dst = dsts[i % dsts.len()];
        let Ok(socket) = Socket::new(Domain::for_address(dst), Type::STREAM, Some(Protocol::TCP))
        else {
            failed += 1;
            continue;
        };
        if socket.set_nonblocking(true).is_err() {
            failed += 1;
            continue;
        }
        match socket.connect(&SockAddr::from(dst)) {
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => open.push(socket),
            Ok(()) => open.push(socket),
            Err(_) => failed += 1,
        }
    }
    println!("OPENED {} failed={failed}", open.len());
    std::thread::sleep(hold);
    let established = open.iter().filter(|s| s.peer_addr().is_ok()).count();
    println!("RESULT opened={} established={established}", open.len());
}

fn deaf(bind: SocketAddr, hold: Duration) {
    let listener =
        std::net::TcpListener::bind(bind).unwrap_or_else(|e| fail(&format!("bind {bind}: {e}")));
    println!("LISTENING");
    std::thread::sleep(hold);
    drop(listener);
}

/// Bytes one connection writes at most (its stall comes long before).
const PUSH_CAP: usize = 256 << 20;

fn push(dst: SocketAddr, count: usize, hold: Duration) {
    let chunk = vec![0x5a_u8; 64 * 1024];
    let mut open = Vec::with_capacity(count);
    let mut written = 0usize;
    for _ in 0..count {
        let mut stream = TcpStream::connect_timeout(&dst, Duration::from_secs(5))
            .unwrap_or_else(|e| fail(&format!("connect {dst}: {e}")));
        stream
            .set_write_timeout(Some(Duration::from_secs(1)))
            .unwrap_or_else(|e| fail(&format!("write timeout: {e}")));
        let mut mine = 0usize;
        while mine < PUSH_CAP {
            match stream.write(&chunk) {
                Ok(n) => mine += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    break;
                }
                Err(e) => fail(&format!("write to {dst}: {e}")),
            }
        }
        written += mine;
        open.push(stream);
    }
    println!("OPENED {} written={written}", open.len());
    std::thread::sleep(hold);
    println!("RESULT opened={}", open.len());
}

fn fail(message: &str) -> ! {
    eprintln!("zt-hostile: {message}");
    std::process::exit(2);
}
