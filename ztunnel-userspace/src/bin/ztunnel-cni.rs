//! `ztunnel-cni`: the CNI plugin (see `ztunnel::cni`). A container runtime
//! runs it with `CNI_*` variables and the network configuration on stdin;
//! it answers on stdout (a result or the specification's error document)
//! and logs to stderr, which runtimes keep in their own logs.

use std::io::{Read as _, Write as _};

/// Largest configuration read from stdin: a conflist entry with its
/// `prevResult` is a few KiB.
const MAX_STDIN: u64 = 1024 * 1024;

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ZTUNNEL_CNI_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let mut stdin = Vec::new();
    // VERSION may come with an empty stdin; a read error leaves it empty
    // and the configuration's parser names the problem.
    let _ = std::io::stdin().take(MAX_STDIN).read_to_end(&mut stdin);
    let reply = ztunnel::cni::invoke(|key| std::env::var(key).ok(), &stdin);
    if let Some(document) = reply.stdout {
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "{document}");
        let _ = stdout.flush();
    }
    std::process::exit(i32::from(!reply.success));
}
