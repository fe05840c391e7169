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
        } => client(connect, bytes, chunk, mode, timeout),
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

fn client(addr: SocketAddr, bytes: u64, chunk: usize, mode: Mode, timeout: u64) -> ExitCode {
    let stream = match TcpStream::connect_timeout(&addr, Duration::from_secs(10)) {
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

    let mut writer = stream.try_clone().expect("clone stream");
    let chunk = chunk.max(1);
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
