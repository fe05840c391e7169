//! `zt-probe`: the client and server processes the integration tests run
//! inside pods. Plain `std::net` sockets, so what they see is exactly what
//! an unmodified application would see.
//!
//! - `server --listen ADDR [--mode echo|digest]`: prints `READY <addr>`, then
//!   `ACCEPT peer=<p> local=<l>` per connection. `echo` sends everything
//!   back and half-closes on EOF; `digest` reads to EOF and answers
//!   `DIGEST <bytes> <fnv64>`.
//! - `client --connect ADDR --bytes N [--chunk C] [--mode echo|digest]`:
//!   sends N deterministic bytes in writes of C bytes, half-closes, checks
//!   what comes back, prints `RESULT ok bytes=N local=<l> peer=<p>`. Exit 1
//!   on a data mismatch, 2 when the connection fails (`CONNECT-ERROR ...`).

use std::{
    io::{BufRead as _, BufReader, Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    process::ExitCode,
    time::Duration,
};

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum Mode {
    Echo,
    Digest,
}

#[derive(Clone, Copy, ValueEnum)]
enum Io {
    Threads,
    Poll,
}

#[derive(Subcommand)]
enum Cmd {
    Server {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long, value_enum, default_value_t = Mode::Echo)]
        mode: Mode,
    },
    Client {
        #[arg(long)]
        connect: SocketAddr,
        #[arg(long, default_value_t = 1024)]
        bytes: u64,
        #[arg(long, default_value_t = 65536)]
        chunk: usize,
        #[arg(long, value_enum, default_value_t = Mode::Echo)]
        mode: Mode,
        /// Seconds before giving up on a silent peer.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
        /// Seconds before giving up on connecting.
        #[arg(long, default_value_t = 10)]
        connect_timeout: u64,
        /// `threads`: a blocking writer thread and a blocking reader (like a
        /// thread-per-connection app); `poll`: one thread, non-blocking,
        /// driven by poll(2) (like an event-loop app).
        #[arg(long, value_enum, default_value_t = Io::Threads)]
        io: Io,
    },
}

/// FNV-1a, streaming.
struct Fnv(u64);
impl Fnv {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
    fn feed(&mut self, data: &[u8]) {
        for b in data {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// Deterministic payload: byte i is a function of i (not constant, so
/// reordering or duplication changes the digest).
fn fill(buf: &mut [u8], offset: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        let x = offset + i as u64;
        *b = (x ^ (x >> 8) ^ (x >> 16)).wrapping_mul(31) as u8;
    }
}

fn main() -> ExitCode {
    match Cli::parse().cmd {
        Cmd::Server { listen, mode } => server(listen, mode),
        Cmd::Client {
            connect,
            bytes,
            chunk,
            mode,
            timeout,
            connect_timeout,
            io,
        } => client(connect, bytes, chunk, mode, (timeout, connect_timeout), io),
    }
}

fn server(listen: SocketAddr, mode: Mode) -> ExitCode {
    let listener = match TcpListener::bind(listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("bind {listen}: {e}");
            return ExitCode::from(2);
        }
    };
    println!("READY {}", listener.local_addr().map_or(listen, |a| a));
    let _ = std::io::stdout().flush();
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let local = stream
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        println!("ACCEPT peer={peer} local={local}");
        let _ = std::io::stdout().flush();
        std::thread::spawn(move || serve(stream, mode));
    }
    ExitCode::SUCCESS
}

fn serve(mut stream: TcpStream, mode: Mode) {
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    let mut digest = Fnv::new();
    loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                total += n as u64;
                match mode {
                    Mode::Echo => {
                        if stream.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                    Mode::Digest => digest.feed(&buf[..n]),
                }
            }
        }
    }
    if let Mode::Digest = mode {
        let _ = writeln!(stream, "DIGEST {total} {:016x}", digest.0);
    }
    let _ = stream.shutdown(Shutdown::Write);
}

fn client(
    addr: SocketAddr,
    bytes: u64,
    chunk: usize,
    mode: Mode,
    (timeout, connect_timeout): (u64, u64),
    io: Io,
) -> ExitCode {
    let stream = match TcpStream::connect_timeout(&addr, Duration::from_secs(connect_timeout)) {
        Ok(s) => s,
        Err(e) => {
            println!("CONNECT-ERROR {:?} {e}", e.kind());
            return ExitCode::from(2);
        }
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(timeout)));
    let local = stream
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();

    let chunk = chunk.max(1);
    if let (Io::Poll, Mode::Echo) = (io, mode) {
        return match echo_poll(stream, bytes, chunk, timeout) {
            Ok(true) => {
                println!("RESULT ok bytes={bytes} local={local} peer={peer}");
                ExitCode::SUCCESS
            }
            Ok(false) => {
                println!("RESULT mismatch bytes={bytes} local={local} peer={peer}");
                ExitCode::from(1)
            }
            Err(e) => {
                println!("READ-ERROR {:?} {e}", e.kind());
                ExitCode::from(2)
            }
        };
    }
    let mut writer = stream.try_clone().expect("clone stream");
    let sender = std::thread::spawn(move || {
        let mut sent = 0u64;
        let mut digest = Fnv::new();
        let mut buf = vec![0u8; chunk];
        while sent < bytes {
            let n = chunk.min((bytes - sent) as usize);
            fill(&mut buf[..n], sent);
            digest.feed(&buf[..n]);
            if writer.write_all(&buf[..n]).is_err() {
                return None;
            }
            sent += n as u64;
        }
        let _ = writer.shutdown(Shutdown::Write);
        Some(digest.0)
    });

    let ok = match mode {
        Mode::Echo => {
            let mut reader = stream;
            let mut got = 0u64;
            let mut digest = Fnv::new();
            let mut buf = vec![0u8; 256 * 1024];
            loop {
                match reader.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        digest.feed(&buf[..n]);
                        got += n as u64;
                    }
                    Err(e) => {
                        println!("READ-ERROR {:?} {e} after {got} bytes", e.kind());
                        return ExitCode::from(2);
                    }
                }
            }
            let sent = sender.join().ok().flatten();
            got == bytes && sent == Some(digest.0)
        }
        Mode::Digest => {
            let mut line = String::new();
            let mut reader = BufReader::new(stream);
            if let Err(e) = reader.read_line(&mut line) {
                println!("READ-ERROR {:?} {e}", e.kind());
                return ExitCode::from(2);
            }
            let sent = sender.join().ok().flatten();
            let expected = sent.map(|d| format!("DIGEST {bytes} {d:016x}"));
            expected.as_deref() == Some(line.trim())
        }
    };
    if ok {
        println!("RESULT ok bytes={bytes} local={local} peer={peer}");
        ExitCode::SUCCESS
    } else {
        println!("RESULT mismatch bytes={bytes} local={local} peer={peer}");
        ExitCode::from(1)
    }
}

/// Echo client on one non-blocking socket driven by poll(2): writes while
/// there is something to send, reads whatever comes back, half-closes after
/// the last byte, and compares digests at EOF.
fn echo_poll(
    mut stream: TcpStream,
    bytes: u64,
    chunk: usize,
    timeout: u64,
) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd as _;
    stream.set_nonblocking(true)?;
    let deadline = std::time::Instant::now() + Duration::from_secs(timeout);
    let (mut sent, mut got) = (0u64, 0u64);
    let (mut sent_digest, mut got_digest) = (Fnv::new(), Fnv::new());
    let mut out = vec![0u8; chunk];
    let (mut out_start, mut out_end) = (0usize, 0usize);
    let mut buf = vec![0u8; 256 * 1024];
    let mut write_closed = false;
    loop {
        if std::time::Instant::now() > deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "echo timed out",
            ));
        }
        let want_write = !write_closed;
        let mut pfd = libc::pollfd {
            fd: stream.as_raw_fd(),
            events: libc::POLLIN | if want_write { libc::POLLOUT } else { 0 },
            revents: 0,
        };
        // SAFETY: one valid pollfd; bounded wait.
        unsafe { libc::poll(&raw mut pfd, 1, 1000) };
        if want_write && pfd.revents & libc::POLLOUT != 0 {
            if out_start == out_end && sent < bytes {
                let n = chunk.min((bytes - sent) as usize);
                fill(&mut out[..n], sent);
                sent_digest.feed(&out[..n]);
                sent += n as u64;
                out_start = 0;
                out_end = n;
            }
            if out_start < out_end {
                match stream.write(&out[out_start..out_end]) {
                    Ok(n) => out_start += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
            }
            if out_start == out_end && sent == bytes {
                stream.shutdown(Shutdown::Write)?;
                write_closed = true;
            }
        }
        if pfd.revents & (libc::POLLIN | libc::POLLHUP) != 0 {
            match stream.read(&mut buf) {
                Ok(0) => return Ok(got == bytes && sent_digest.0 == got_digest.0),
                Ok(n) => {
                    got_digest.feed(&buf[..n]);
                    got += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    }
}
