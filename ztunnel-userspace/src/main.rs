//! The `ztunnel` binary: argument parsing and start-up; everything else is
//! in the library.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;
use ztunnel::{bpffs::PinRoot, capture, cgroup, loader, probe};

/// Default pin folder on bpffs.
const DEFAULT_BPFFS: &str = "/sys/fs/bpf/ztunnel";

#[derive(Parser)]
#[command(
    name = "ztunnel",
    version,
    about = "eBPF-accelerated node proxy for sidecar-less service meshes",
    long_about = "ztunnel captures the TCP traffic of enrolled pods with eBPF (cgroup connect \
                  hooks, sock_ops, TC ingress; no iptables) and carries it between nodes in \
                  HBONE tunnels (mTLS + HTTP/2 CONNECT)."
)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `ztunnel=debug`.
    #[arg(long, env = "ZTUNNEL_LOG", default_value = "info", global = true)]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load and attach the kernel programs and run until SIGINT/SIGTERM.
    Run(RunArgs),
    /// Check that this kernel has every hook ztunnel needs, and exit.
    Probe,
}

#[derive(clap::Args)]
struct RunArgs {
    /// cgroup v2 directory to attach the connect/sock_ops programs to.
    /// Default: the root of the cgroup v2 hierarchy (from /proc/self/mounts).
    /// Tests pass a cgroup they created; production may use the root.
    #[arg(long, env = "ZTUNNEL_CGROUP")]
    cgroup: Option<PathBuf>,
    /// Folder on bpffs where maps and links are pinned.
    #[arg(long, env = "ZTUNNEL_BPFFS", default_value = DEFAULT_BPFFS)]
    bpffs: PathBuf,
    /// Move payload between an app and its pod's ztunnel listener with
    /// sk_msg/sockhash instead of loopback TCP.
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    sockmap: OnOff,
    /// How to attach TC programs: tcx links (>= 6.6) or clsact filters.
    #[arg(long, value_enum, default_value_t = capture::tc::TcMode::Auto)]
    tc_mode: capture::tc::TcMode,
    /// On exit, remove every pin (and so every attachment) ztunnel made.
    /// Without it, attachments stay so that capture fails closed and a
    /// restarted ztunnel takes over without a window.
    #[arg(long)]
    cleanup: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum OnOff {
    On,
    Off,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_new(&cli.log).context("invalid --log filter")?)
        .init();
    match cli.command {
        Command::Probe => {
            probe::check_kernel()?;
            let mode = capture::tc::TcMode::Auto.resolve();
            println!("kernel ok: every required hook is available (TC attach mode: {mode:?})");
            Ok(())
        }
        Command::Run(args) => run(&args),
    }
}

fn run(args: &RunArgs) -> Result<()> {
    let cgroup_dir = match &args.cgroup {
        Some(dir) => dir.clone(),
        None => cgroup::cgroup2_mount()?,
    };
    cgroup::validate(&cgroup_dir)?;
    let pins = PinRoot::prepare(&args.bpffs)?;
    let mut programs = loader::load(&pins)?;
    let attached = capture::cgroup::attach(
        &mut programs.ebpf,
        &pins,
        &cgroup_dir,
        args.sockmap == OnOff::On,
    )?;
    tracing::info!(
        cgroup = %attached.cgroup.display(),
        took_over = attached.took_over,
        "capture programs attached"
    );

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        anyhow::Ok(())
    })?;

    if args.cleanup {
        capture::cgroup::unpin(&pins)?;
        drop(programs);
        pins.remove_all()?;
        tracing::info!("cleaned up: no pins left under {}", args.bpffs.display());
    }
    Ok(())
}
