//! `zt-raw`: a hostile client outside the mesh, for the privileged tests.
//!
//! ```text
//! zt-raw --src IP --dst IP:PORT [--sport N] --mode plain|frag4|destopts6
//!        [--payload TEXT] [--timeout-ms N] [--via ip|packet]
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
//!
//! The session, the sockets and the RST filter live in
//! `ztunnel_tests::raw_tcp`; this file is the command line around them: it
//! checks the arguments into a [`SessionPlan`], turns signals into the flag
//! [`run`] watches, and prints the [`Outcome`].

use std::{
    io::Write as _,
    net::{IpAddr, SocketAddr},
    process::ExitCode,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use anyhow::{Context as _, Result};
use clap::Parser;
use ztunnel_tests::raw_tcp::{self, AddrPair, Outcome, SessionPlan, Shape, Via, random_u32};

/// Default of `--timeout-ms`, per wait (SYN-ACK, then the reaction): a veth
/// round trip takes well under a millisecond, and 3 s still holds on a busy
/// 2-core CI machine, while a blocked attempt (which always waits it out)
/// stays cheap.
const DEFAULT_TIMEOUT_MS: u64 = 3000;
/// Upper bound of `--timeout-ms`: a test that needs more has another problem.
const MAX_TIMEOUT_MS: u64 = 60_000;
/// Largest `--payload`: the segment must fit one packet on any link
/// (IPv6's minimum MTU is 1280).
const MAX_PAYLOAD: usize = 1024;
/// Range of the random default source port; clear of Linux's ephemeral range
/// (32768..60999 overlaps, but the attacker namespace runs nothing else).
const SPORT_RANGE: std::ops::Range<u16> = 40000..60000;

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
    /// The socket the packets leave by: `ip` (raw IP, header included) or
    /// `packet` (`AF_PACKET` on eth0, to the target's link address).
    #[arg(long, value_enum, default_value_t = Via::Ip)]
    via: Via,
}

/// Checks the command line, reporting every problem at once.
fn plan(cli: Cli) -> Result<SessionPlan, Vec<String>> {
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
        Some(addrs) if errors.is_empty() => Ok(SessionPlan {
            addrs,
            sport,
            dport: cli.dst.port(),
            shape: cli.mode,
            payload: cli.payload.into_bytes(),
            timeout: Duration::from_millis(cli.timeout_ms),
            via: cli.via,
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

/// Everything after the command line was checked.
fn run(plan: &SessionPlan) -> Result<Outcome> {
    catch_signals()?;
    raw_tcp::run(plan, &INTERRUPTED)
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
}
