//! `zt-raw`: a hostile client outside the mesh, for the privileged tests.
//!
//! ```text
//! zt-raw --src IP --dst IP:PORT [--sport N] --mode plain|frag4|destopts6
//!        [--payload TEXT] [--timeout-ms N]
//! ```
//!
//! It runs ONE TCP client session by hand over raw IP sockets, so that it
//! can shape its packets the way no `connect(2)` would (see
//! `ztunnel_tests::raw_tcp`): SYN; wait for the SYN-ACK; ACK; one data
//! segment; wait for the target's reaction (data, FIN or RST), acking what
//! arrives; RST. Every segment it sends, not only the SYN, has the chosen
//! shape, so a defence that only copes with plain packets after the
//! handshake cannot be what stops it.
//!
//! It prints exactly one JSON line, e.g.
//! `{"syn_ack":true,"data":"HELLO\n","fin":false,"rst":false,"sport":40001}`,
//! and exits 0 whenever the session ran, whatever its outcome; 1 when a
//! socket, the firewall rule or a signal stopped it; 2 on bad usage.
//!
//! The attacker's own kernel has no socket for this connection, so it would
//! answer the target's SYN-ACK with an RST and spoil the session. While the
//! session runs, `zt-raw` therefore installs
//! `OUTPUT -p tcp -m mark ! --mark <ours> --tcp-flags RST RST --sport <sport> -j DROP`
//! with `iptables`/`ip6tables`, and removes it when it exits, also on errors
//! and on SIGINT/SIGTERM/SIGHUP. The rule goes into the network namespace
//! `zt-raw` runs in and nowhere else; the tests always start it in a
//! throwaway attacker namespace, and it refuses to run in the host's
//! (`init_net`, or PID 1's). Only SIGKILL can leave the rule behind, and then it
//! dies with that throwaway namespace. The mark exception lets our own
//! packets (marked with `SO_MARK`) through: the final RST, and the first
//! fragment of a `frag4` segment, which holds too little of TCP for the tcp
//! match (legacy iptables drops such a fragment outright rather than skip it).

use std::{
    io::Write as _,
    net::{IpAddr, SocketAddr},
    process::{Command, ExitCode},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use ztunnel_tests::raw_tcp::{
    ACK, AddrPair, FIN, Outcome, PSH, RST, RawReceiver, RawSender, SYN, Segment, Shape, ip_packets,
    parse_tcp, random_u32, target,
};

/// Default of `--timeout-ms`, per wait (SYN-ACK, then the reaction): a veth
/// round trip takes well under a millisecond, and 3 s still holds on a busy
/// 2-core CI machine, while a blocked attempt (which always waits it out)
/// stays cheap.
const DEFAULT_TIMEOUT_MS: u64 = 3000;
/// Upper bound of `--timeout-ms`: a test that needs more has another problem.
const MAX_TIMEOUT_MS: u64 = 60_000;
/// Once data has arrived, this much silence ends the wait: an echo server
/// answers and then waits for us, without ever sending FIN.
const QUIET_AFTER_DATA: Duration = Duration::from_millis(300);
/// Packets examined per wait at most, matching or not: the raw socket sees
/// every TCP packet of the namespace, and a flood must not keep us forever.
const MAX_PACKETS_PER_WAIT: usize = 4096;
/// Data kept from the target at most; the rest is acked but not stored.
const MAX_DATA: usize = 64 * 1024;
/// Largest `--payload`: the segment must fit one packet on any link
/// (IPv6's minimum MTU is 1280).
const MAX_PAYLOAD: usize = 1024;
/// Range of the random default source port; clear of Linux's ephemeral range
/// (32768..60999 overlaps, but the attacker namespace runs nothing else).
const SPORT_RANGE: std::ops::Range<u16> = 40000..60000;
/// Receive window we advertise: the largest without window scaling.
const WINDOW: u16 = 65535;
/// `SO_MARK` of our raw packets, which the RST filter lets through. Its low
/// 12 bits are zero so it can never look like ztunnel's own mark.
const ATTACKER_MARK: u32 = 0x00ac_0000;
/// Largest packet we can receive (an IPv4 packet with a 64 KiB payload).
const RECV_BUF: usize = 65536 + 60;

/// Command line of one session.
#[derive(Parser)]
#[command(name = "zt-raw", about = "One hand-made TCP session over raw sockets")]
struct Cli {
    /// Our address (must be on an interface of this namespace).
    #[arg(long)]
    src: IpAddr,
    /// The target.
    #[arg(long)]
    dst: SocketAddr,
    /// Source port; default: random in 40000..60000.
    #[arg(long)]
    sport: Option<u16>,
    /// How each segment is wrapped: plain, frag4 (IPv4 fragments of 8 bytes),
    /// destopts6 (IPv6 with a Destination Options header).
    #[arg(long, value_enum)]
    mode: Shape,
    /// Data sent after the handshake.
    #[arg(long, default_value = "HELLO\n")]
    payload: String,
    /// Bound of each wait, in milliseconds.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_MS)]
    timeout_ms: u64,
}

/// A validated session plan.
struct Plan {
    addrs: AddrPair,
    sport: u16,
    dport: u16,
    shape: Shape,
    payload: Vec<u8>,
    timeout: Duration,
}

/// Checks the command line, reporting every problem at once.
fn plan(cli: Cli) -> Result<Plan, Vec<String>> {
    let mut errors = Vec::new();
    let addrs = AddrPair::new(cli.src, cli.dst.ip());
    match addrs {
        None => errors.push(format!(
            "--src {} and --dst {} are of different families",
            cli.src, cli.dst
        )),
        Some(a) if !a.fits(cli.mode) => errors.push(format!(
            "--mode {:?} does not fit --dst {} (frag4 is IPv4 only, destopts6 IPv6 only)",
            cli.mode, cli.dst
        )),
        Some(_) => {}
    }
    if cli.dst.port() == 0 || cli.sport == Some(0) {
        errors.push("ports must not be 0".into());
    }
    if cli.payload.is_empty() || cli.payload.len() > MAX_PAYLOAD {
        errors.push(format!("--payload must be 1..={MAX_PAYLOAD} bytes"));
    }
    if !(1..=MAX_TIMEOUT_MS).contains(&cli.timeout_ms) {
        errors.push(format!("--timeout-ms must be 1..={MAX_TIMEOUT_MS}"));
    }
    let sport = match cli.sport {
        Some(p) => p,
        None => match random_u32() {
            Ok(r) => {
                let span = u32::from(SPORT_RANGE.end - SPORT_RANGE.start);
                SPORT_RANGE.start + (r % span) as u16
            }
            Err(e) => {
                errors.push(format!("getrandom for the source port: {e}"));
                0
            }
        },
    };
    match addrs {
        Some(addrs) if errors.is_empty() => Ok(Plan {
            addrs,
            sport,
            dport: cli.dst.port(),
            shape: cli.mode,
            payload: cli.payload.into_bytes(),
            timeout: Duration::from_millis(cli.timeout_ms),
        }),
        _ => Err(errors),
    }
}

/// Set by the signal handler; the waits check it.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Turns SIGINT/SIGTERM/SIGHUP into [`INTERRUPTED`], so the firewall rule's
/// guard still runs. No `SA_RESTART`: a pending poll(2) returns at once.
fn catch_signals() -> Result<()> {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        // SAFETY: the handler only stores to an atomic.
        unsafe { sigaction(signal, &action) }.with_context(|| format!("sigaction {signal}"))?;
    }
    Ok(())
}

/// The inode number of the initial network namespace (`init_net`), fixed by
/// the kernel (`PROC_NET_INIT_INO`, 0xEFFFFFF9) since Linux 3.8.
const INIT_NET_INODE: u64 = 0xEFFF_FFF9;

/// Refuses the host's namespace: the RST filter must only ever land in a
/// throwaway one. The host's is recognised as `init_net` (by its fixed
/// inode, which needs no privilege to read) or as PID 1's namespace (inside
/// a container; skipped where /proc/1 is not readable, as in sandboxes
/// without CAP_SYS_PTRACE).
fn check_namespace() -> Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let ours = std::fs::metadata("/proc/self/ns/net").context("stat /proc/self/ns/net")?;
    let init = std::fs::metadata("/proc/1/ns/net").ok();
    let same_as_init = init.is_some_and(|i| (i.dev(), i.ino()) == (ours.dev(), ours.ino()));
    if ours.ino() == INIT_NET_INODE || same_as_init {
        bail!(
            "refusing to run in the host's network namespace (net:[{}]): zt-raw installs a \
             firewall rule and belongs in a throwaway namespace",
            ours.ino()
        );
    }
    Ok(())
}

/// While alive, keeps this namespace's kernel from sending RSTs from our
/// source port (see the top of this file); the rule goes on drop.
struct KernelRstFilter {
    tool: &'static str,
    spec: Vec<String>,
}

impl KernelRstFilter {
    fn install(v6: bool, sport: u16) -> Result<Self> {
        let tool = if v6 { "ip6tables" } else { "iptables" };
        let spec: Vec<String> = [
            "-p",
            "tcp",
            // Matches run in order: our marked packets leave the rule here,
            // before the tcp match could look at a truncated first fragment.
            "-m",
            "mark",
            "!",
            "--mark",
            &format!("{ATTACKER_MARK:#x}"),
            "-m",
            "tcp",
            "--tcp-flags",
            "RST",
            "RST",
            "--sport",
            &sport.to_string(),
            "-j",
            "DROP",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        // First in the chain, so nothing accepted earlier slips through.
        iptables(tool, &["-I", "OUTPUT", "1"], &spec)
            .with_context(|| format!("installing the kernel RST filter with {tool}"))?;
        Ok(Self { tool, spec })
    }
}

impl Drop for KernelRstFilter {
    fn drop(&mut self) {
        // Log, never panic, in Drop.
        if let Err(e) = iptables(self.tool, &["-D", "OUTPUT"], &self.spec) {
            eprintln!("zt-raw: removing the kernel RST filter: {e:#}");
        }
    }
}

/// Runs `tool -w 5 <head> <spec>` (waiting at most 5 s for the xtables lock).
fn iptables(tool: &str, head: &[&str], spec: &[String]) -> Result<()> {
    let out = Command::new(tool)
        .args(["-w", "5"])
        .args(head)
        .args(spec)
        .output()
        .with_context(|| format!("cannot run {tool} (install the iptables package)"))?;
    if !out.status.success() {
        bail!(
            "`{tool} {} {}` failed: {}",
            head.join(" "),
            spec.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// `a` comes before `b` in sequence space (RFC 1982 arithmetic).
fn seq_before(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

/// A received segment of our connection, copied out of the buffer.
struct Received {
    seq: u32,
    ack: u32,
    flags: u8,
    payload: Vec<u8>,
}

/// The two raw sockets of one session and its fixed addressing.
struct Wire {
    sender: RawSender,
    receiver: RawReceiver,
    addrs: AddrPair,
    shape: Shape,
    sport: u16,
    dport: u16,
    ip_id: u16,
    buf: Vec<u8>,
}

impl Wire {
    /// Sends one segment in the session's shape; each segment gets its own
    /// IPv4 id (never 0: the kernel would replace a 0 in every fragment with
    /// a different id of its own, and reassembly would fail).
    fn send(&mut self, seq: u32, ack: u32, flags: u8, payload: &[u8]) -> Result<()> {
        let segment = Segment {
            sport: self.sport,
            dport: self.dport,
            seq,
            ack,
            flags,
            window: WINDOW,
            payload,
        }
        .encode(self.addrs);
        self.ip_id = self.ip_id.wrapping_add(1).max(1);
        for packet in ip_packets(self.addrs, self.shape, self.ip_id, &segment) {
            self.sender
                .send(&packet, self.addrs.dst())
                .with_context(|| format!("raw send to {}", self.addrs.dst()))?;
        }
        Ok(())
    }

    /// The next segment of our connection before `deadline`, skipping other
    /// traffic; `None` on timeout or after [`MAX_PACKETS_PER_WAIT`] packets.
    fn recv(&mut self, deadline: Instant) -> Result<Option<Received>> {
        for _ in 0..MAX_PACKETS_PER_WAIT {
            if INTERRUPTED.load(Ordering::SeqCst) {
                bail!("interrupted by a signal");
            }
            let (from, tcp) = match self.receiver.recv(&mut self.buf, deadline) {
                Ok(Some(got)) => got,
                Ok(None) => return Ok(None),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e).context("raw receive"),
            };
            if from != self.addrs.dst() {
                continue;
            }
            let Some(view) = parse_tcp(tcp) else {
                continue;
            };
            if view.sport == self.dport && view.dport == self.sport {
                return Ok(Some(Received {
                    seq: view.seq,
                    ack: view.ack,
                    flags: view.flags,
                    payload: view.payload.to_vec(),
                }));
            }
        }
        Ok(None)
    }
}

/// Runs the session and says what happened.
fn session(wire: &mut Wire, payload: &[u8], timeout: Duration) -> Result<Outcome> {
    let mut out = Outcome {
        sport: wire.sport,
        ..Outcome::default()
    };
    let isn = random_u32().context("getrandom for the initial sequence number")?;
    wire.send(isn, 0, SYN, &[])?;

    // The SYN-ACK (or an RST acking our SYN: the port is closed).
    let deadline = Instant::now() + timeout;
    let peer_isn = loop {
        let Some(seg) = wire.recv(deadline)? else {
            return Ok(out); // silence: dropped somewhere
        };
        let acks_syn = seg.flags & ACK != 0 && seg.ack == isn.wrapping_add(1);
        if seg.flags & RST != 0 && (acks_syn || seg.flags & ACK == 0) {
            out.rst = true;
            return Ok(out);
        }
        if seg.flags & (SYN | ACK) == SYN | ACK && acks_syn {
            break seg.seq;
        }
    };
    out.syn_ack = true;

    let mut snd_nxt = isn.wrapping_add(1);
    let mut rcv_nxt = peer_isn.wrapping_add(1);
    // What the target has acked of ours: the sequence number its RST
    // check expects (an RST elsewhere in the window only earns a challenge
    // ACK, RFC 5961).
    let mut peer_acked = snd_nxt;
    wire.send(snd_nxt, rcv_nxt, ACK, &[])?;
    wire.send(snd_nxt, rcv_nxt, PSH | ACK, payload)?;
    snd_nxt = snd_nxt.wrapping_add(payload.len() as u32);

    let mut data = Vec::new();
    let deadline = Instant::now() + timeout;
    let mut last_data: Option<Instant> = None;
    for _ in 0..MAX_PACKETS_PER_WAIT {
        let until = last_data.map_or(deadline, |t| deadline.min(t + QUIET_AFTER_DATA));
        let Some(seg) = wire.recv(until)? else {
            break;
        };
        if seg.flags & ACK != 0 && seq_before(peer_acked, seg.ack) && !seq_before(snd_nxt, seg.ack)
        {
            peer_acked = seg.ack;
        }
        if seg.flags & RST != 0 {
            out.rst = true;
            break;
        }
        if seg.flags & SYN != 0 {
            // A retransmitted SYN-ACK: our ACK was lost; say it again.
            wire.send(snd_nxt, rcv_nxt, ACK, &[])?;
            continue;
        }
        // Take what is new in this segment: all of it when it starts at
        // rcv_nxt, the tail when it overlaps what we have, nothing when it
        // starts beyond (a gap: the dup ACK below asks for the rest).
        let end = seg.seq.wrapping_add(seg.payload.len() as u32);
        if !seq_before(rcv_nxt, seg.seq) && seq_before(rcv_nxt, end) {
            // In range by the check above; `get` all the same, never a panic.
            let skip = rcv_nxt.wrapping_sub(seg.seq) as usize;
            let new = seg.payload.get(skip..).unwrap_or_default();
            let room = MAX_DATA.saturating_sub(data.len());
            data.extend_from_slice(&new[..new.len().min(room)]);
            rcv_nxt = end;
            last_data = Some(Instant::now());
        }
        if seg.flags & FIN != 0 && end == rcv_nxt {
            rcv_nxt = rcv_nxt.wrapping_add(1);
            out.fin = true;
        }
        if !seg.payload.is_empty() || seg.flags & FIN != 0 {
            // Ack (or re-ack) so the target does not retransmit for minutes.
            wire.send(snd_nxt, rcv_nxt, ACK, &[])?;
        }
        if out.fin {
            break; // nothing follows a FIN
        }
    }
    out.data = String::from_utf8_lossy(&data).into_owned();

    if !out.rst {
        wire.send(peer_acked, rcv_nxt, RST | ACK, &[])?;
    }
    Ok(out)
}

/// Everything after the command line was checked.
fn run(plan: &Plan) -> Result<Outcome> {
    catch_signals()?;
    check_namespace()?;
    let v6 = plan.addrs.is_v6();
    let family = if v6 { "AF_INET6" } else { "AF_INET" };
    // The receiver first: a SYN-ACK may come back before the SYN's send
    // call even returns.
    let receiver = RawReceiver::open(v6)
        .with_context(|| format!("{family} SOCK_RAW IPPROTO_TCP receive socket"))?;
    let sender = RawSender::open(v6, ATTACKER_MARK)
        .with_context(|| format!("{family} SOCK_RAW IPPROTO_RAW send socket (header included)"))?;
    let _filter = KernelRstFilter::install(v6, plan.sport)?;
    let mut wire = Wire {
        sender,
        receiver,
        addrs: plan.addrs,
        shape: plan.shape,
        sport: plan.sport,
        dport: plan.dport,
        ip_id: random_u32().context("getrandom for the IP id")? as u16,
        buf: vec![0; RECV_BUF],
    };
    session(&mut wire, &plan.payload, plan.timeout).with_context(|| {
        format!(
            "session {} -> {}",
            plan.sport,
            target(plan.addrs, plan.dport)
        )
    })
}

fn main() -> ExitCode {
    let plan = match plan(Cli::parse()) {
        Ok(p) => p,
        Err(errors) => {
            for e in errors {
                eprintln!("zt-raw: {e}");
            }
            return ExitCode::from(2);
        }
    };
    match run(&plan) {
        Ok(outcome) => {
            println!("{}", outcome.to_json_line());
            let _ = std::io::stdout().flush();
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("zt-raw: {e:#}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("zt-raw").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn plan_reports_every_problem_at_once() {
        let errors = plan(cli(&[
            "--src",
            "10.0.0.1",
            "--dst",
            "[::1]:0",
            "--mode",
            "frag4",
            "--payload",
            "",
            "--timeout-ms",
            "0",
        ]))
        .err()
        .unwrap();
        assert_eq!(errors.len(), 4, "{errors:?}");
    }

    #[test]
    fn plan_refuses_shapes_of_the_other_family() {
        let v6_frag = cli(&["--src", "::1", "--dst", "[::1]:80", "--mode", "frag4"]);
        assert!(plan(v6_frag).is_err());
        let v4_ext = cli(&[
            "--src",
            "10.0.0.1",
            "--dst",
            "10.0.0.2:80",
            "--mode",
            "destopts6",
        ]);
        assert!(plan(v4_ext).is_err());
    }

    #[test]
    fn plan_defaults() {
        let p = plan(cli(&[
            "--src",
            "::1",
            "--dst",
            "[::1]:80",
            "--mode",
            "destopts6",
        ]))
        .unwrap();
        assert!(SPORT_RANGE.contains(&p.sport));
        assert_eq!(p.payload, b"HELLO\n");
        assert_eq!(p.timeout, Duration::from_millis(DEFAULT_TIMEOUT_MS));
        let fixed = cli(&[
            "--src",
            "10.0.0.1",
            "--dst",
            "10.0.0.2:80",
            "--mode",
            "plain",
            "--sport",
            "40001",
        ]);
        assert_eq!(plan(fixed).unwrap().sport, 40001);
    }

    #[test]
    fn sequence_comparison_wraps() {
        assert!(seq_before(1, 2));
        assert!(seq_before(u32::MAX, 0));
        assert!(!seq_before(0, u32::MAX));
        assert!(!seq_before(5, 5));
    }
}
