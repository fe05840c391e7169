//! `zt-layout` (run by `cargo xtask layout`): finds which functions of the
//! release `ztunnel` binary run, and writes the order the linker lays them
//! out in (`ztunnel-userspace/layout/ztunnel.order`, passed to lld as
//! `--symbol-ordering-file` by the crate's build script).
//!
//! Why: the kernel maps a binary's text in 64 KiB fault-around blocks, so a
//! few hundred bytes of start-up code scattered through the text make
//! almost the whole of it resident. Packed together, what start-up and an
//! idle proxy touch fills few blocks; the data path comes next, then
//! everything that never ran.
//!
//! How: ztunnel runs under valgrind's callgrind (which lists every function
//! that executed) in the test topology, twice: once started and left idle
//! (start-up, enrolment, timers, then a clean shutdown), once with traffic
//! over every path (HBONE both ways, the same-node fast path with a
//! stream, passthrough, plaintext inbound, a metrics scrape). The order
//! file lists the first run's functions, then what only the second ran.
//! The other node's ztunnel runs natively.

use std::{
    collections::{HashMap, HashSet},
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
    time::Duration,
};

use clap::Parser;
use ztunnel_tests::{
    Cluster,
    cgroup::TestCgroup,
    flows::{self, ClientRun, WorkloadEntry},
    ztunnel::{SHIPPED_LOG, Ztunnel},
};

#[derive(Parser)]
#[command(about = "Record which ztunnel functions run and write the link order")]
struct Args {
    /// The release ztunnel binary to observe (its symbols name the
    /// functions).
    #[arg(long, default_value = "target/release/ztunnel")]
    ztunnel: PathBuf,
    /// Where to write the order.
    #[arg(long, default_value = "ztunnel-userspace/layout/ztunnel.order")]
    out: PathBuf,
    /// Instead: start the binary natively, leave it idle, and show which
    /// of its sections (and which libraries) are resident.
    #[arg(long)]
    inspect: bool,
    /// Instead: say how many of the order's functions the binary has (the
    /// names carry hashes that change with the toolchain and dependency
    /// versions); exits 1 below 90 %.
    #[arg(long)]
    check: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !nix::unistd::geteuid().is_root() {
        eprintln!("zt-layout: needs root (network namespaces, cgroups, eBPF)");
        return ExitCode::FAILURE;
    }
    if Command::new("valgrind").arg("--version").output().is_err() {
        eprintln!("zt-layout: valgrind is not installed (apt-get install valgrind)");
        return ExitCode::FAILURE;
    }
    let ztunnel = match fs::canonicalize(&args.ztunnel) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("zt-layout: {}: {e}", args.ztunnel.display());
            return ExitCode::FAILURE;
        }
    };
    if args.inspect {
        inspect(&ztunnel);
        return ExitCode::SUCCESS;
    }
    if args.check {
        return check(&ztunnel, &args.out);
    }
    // Under valgrind ztunnel runs some 50 times slower: the harness's waits
    // for its progress stretch six-fold with this (read at each wait).
    // SAFETY: no other thread exists yet.
    unsafe { std::env::set_var("ZTUNNEL_TESTS_EMULATED", "1") };

    let idle = observe(&ztunnel, false);
    let busy = observe(&ztunnel, true);
    // The hottest code of both groups meets at their boundary: start-up
    // functions from cold to hot (by what they cost under traffic), then
    // data-path functions from hot to cold.
    let heat: HashMap<&str, u64> = busy.iter().map(|(n, c)| (n.as_str(), *c)).collect();
    let heat_of = |n: &str| heat.get(n).copied().unwrap_or(0);
    let started: HashSet<&str> = idle.iter().map(|(n, _)| n.as_str()).collect();
    let mut order: Vec<&str> = idle.iter().map(|(n, _)| n.as_str()).collect();
    order.sort_by_key(|n| heat_of(n));
    let mut data: Vec<&str> = busy
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| !started.contains(n))
        .collect();
    data.sort_by_key(|n| std::cmp::Reverse(heat_of(n)));
    order.extend(data);
    let data_path = order.len() - idle.len();
    let mut text = order.join("\n");
    text.push('\n');
    if let Some(dir) = args.out.parent() {
        let _ = fs::create_dir_all(dir);
    }
    if let Err(e) = fs::write(&args.out, text) {
        eprintln!("zt-layout: write {}: {e}", args.out.display());
        return ExitCode::FAILURE;
    }
    println!(
        "zt-layout: {} functions ran at start-up and idle, {data_path} more with traffic; wrote {}",
        idle.len(),
        args.out.display()
    );
    ExitCode::SUCCESS
}

/// How much of the order at `order` names functions of `binary`.
fn check(binary: &Path, order: &Path) -> ExitCode {
    use object::{Object as _, ObjectSymbol as _};

    let Ok(wanted) = fs::read_to_string(order) else {
        println!(
            "zt-layout: no order at {}: the text keeps the compiler's layout",
            order.display()
        );
        return ExitCode::FAILURE;
    };
    let data = fs::read(binary).expect("read the binary");
    let elf = object::File::parse(&*data).expect("parse the binary");
    let names: HashSet<&str> = elf.symbols().filter_map(|s| s.name().ok()).collect();
    let wanted: Vec<&str> = wanted.lines().filter(|l| !l.is_empty()).collect();
    let found = wanted.iter().filter(|n| names.contains(*n)).count();
    let share = found as f64 / wanted.len().max(1) as f64;
    println!(
        "zt-layout: {found} of the {} functions in {} are in {} ({:.0} %)",
        wanted.len(),
        order.display(),
        binary.display(),
        share * 100.0
    );
    if share < 0.9 {
        println!(
            "zt-layout: the order is stale (a toolchain or dependency change renamed the functions): \
             idle RSS grows until `cargo xtask layout` records it again"
        );
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// Starts `ztunnel` natively for one node with two enrolled pods, lets it
/// idle for 5 s and prints its resident memory by section of the binary
/// and by library, from `/proc/PID/pagemap`.
fn inspect(ztunnel: &Path) {
    let mut cluster = Cluster::new();
    let a = cluster.add_node("node-a");
    cluster.add_pod(a, "a1");
    cluster.add_pod(a, "a2");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("a1", "node-a"),
            WorkloadEntry::enrolled("a2", "node-a"),
        ],
    );
    let config = config.to_str().expect("utf-8");
    let mut z = Ztunnel::start_binary(&cluster, a, ztunnel, SHIPPED_LOG, &["--config", config]);
    z.wait_for_log("pod enrolled pod=a2", Duration::from_secs(20));
    z.wait_for_log("pod enrolled pod=a1", Duration::from_secs(20));
    std::thread::sleep(Duration::from_secs(5));
    let pid = z.pid();
    println!("VmRSS {} KiB, RssAnon {} KiB", z.rss_kib(), z.anon_kib());
    for (what, kib) in resident_by_section(pid, ztunnel) {
        println!("{kib:>6} KiB  {what}");
    }
    z.stop();
}

/// Resident KiB of each file-backed mapping of `pid`, the binary's split by
/// ELF section, largest first.
fn resident_by_section(pid: u32, binary: &Path) -> Vec<(String, u64)> {
    use object::{Object as _, ObjectSection as _};
    use std::io::{Read as _, Seek as _, SeekFrom};

    let data = fs::read(binary).expect("read the binary");
    let elf = object::File::parse(&*data).expect("parse the binary");
    let sections: Vec<(String, u64, u64)> = elf
        .sections()
        .filter(|s| s.address() != 0)
        .map(|s| (s.name().unwrap_or("?").to_owned(), s.address(), s.size()))
        .collect();
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mut pagemap = fs::File::open(format!("/proc/{pid}/pagemap")).expect("pagemap");
    let binary = binary.to_str().expect("utf-8 path");
    let mut load_bias = None;
    let mut totals = std::collections::BTreeMap::<String, u64>::new();
    for line in maps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(range), Some(perms), Some(offset), Some(path)) =
            (fields.first(), fields.get(1), fields.get(2), fields.get(5))
        else {
            continue;
        };
        // Files only: the heap, stacks and [vsyscall] are not the layout's.
        if !path.starts_with('/') {
            continue;
        }
        let (start, end) = range.split_once('-').expect("range");
        let start = u64::from_str_radix(start, 16).expect("hex");
        let end = u64::from_str_radix(end, 16).expect("hex");
        let offset = u64::from_str_radix(offset, 16).expect("hex");
        if *path == binary && load_bias.is_none() {
            load_bias = Some(start - offset);
        }
        for page in (start..end).step_by(4096) {
            pagemap
                .seek(SeekFrom::Start(page / 4096 * 8))
                .expect("seek pagemap");
            let mut entry = [0u8; 8];
            pagemap.read_exact(&mut entry).expect("read pagemap");
            if u64::from_le_bytes(entry) >> 63 == 0 {
                continue;
            }
            let what = if *path == binary {
                let va = page - load_bias.unwrap_or(0);
                sections
                    .iter()
                    .find(|(_, at, size)| (*at..at + size).contains(&va))
                    .map_or_else(
                        || "ztunnel (between sections)".to_owned(),
                        |(n, ..)| format!("ztunnel {n}"),
                    )
            } else {
                format!("{path} ({perms})")
            };
            *totals.entry(what).or_default() += 4;
        }
    }
    let mut totals: Vec<_> = totals.into_iter().collect();
    totals.sort_by_key(|t| std::cmp::Reverse(t.1));
    totals
}

/// Runs node a's ztunnel under callgrind (with traffic when `traffic`),
/// stops it cleanly and returns the functions of the ztunnel binary that
/// ran, with the instructions each executed itself.
fn observe(ztunnel: &Path, traffic: bool) -> Vec<(String, u64)> {
    let mut cluster = Cluster::new();
    let a = cluster.add_node("node-a");
    let b = cluster.add_node("node-b");
    for (node, pod) in [(a, "a1"), (a, "a2"), (b, "b1"), (b, "c1")] {
        cluster.add_pod(node, pod);
    }
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("a1", "node-a"),
            WorkloadEntry::enrolled("a2", "node-a"),
            WorkloadEntry::enrolled("b1", "node-b"),
            WorkloadEntry::outside("c1", "node-b"),
        ],
    );
    let config = config.to_str().expect("utf-8");
    let out = cluster.dir().join("callgrind.out");
    let wrapper = cluster.dir().join("ztunnel-under-callgrind");
    fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec valgrind --tool=callgrind --demangle=no --compress-strings=no \
             --callgrind-out-file={} {} \"$@\"\n",
            out.display(),
            ztunnel.display()
        ),
    )
    .expect("write the wrapper");
    fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("make the wrapper executable");

    let port = 8080;
    let addr = |pod: &str| SocketAddr::from((cluster.pod(pod).ip, port));
    let _servers: Vec<_> = ["a1", "a2", "b1", "c1"]
        .iter()
        .map(|p| flows::server(cluster.pod(p), addr(p), "echo"))
        .collect();
    let mut za = Ztunnel::start_binary(&cluster, a, &wrapper, SHIPPED_LOG, &["--config", config]);
    let mut zb = Ztunnel::start_binary(&cluster, b, ztunnel, SHIPPED_LOG, &["--config", config]);
    za.wait_for_log("pod enrolled pod=a1", Duration::from_secs(20));
    za.wait_for_log("pod enrolled pod=a2", Duration::from_secs(20));
    zb.wait_for_log("pod enrolled pod=b1", Duration::from_secs(20));
    // Idle long enough for the periodic work (config watch, pool and
    // certificate timers) to run a few times.
    std::thread::sleep(Duration::from_secs(5));
    if traffic {
        let small = ClientRun {
            limit: Duration::from_mins(3),
            connect_timeout: 60,
            ..ClientRun::default()
        };
        let stream = ClientRun {
            bytes: 8 << 20,
            chunk: 256 * 1024,
            io: "poll",
            ..small.clone()
        };
        let (a1, b1, c1) = (cluster.pod("a1"), cluster.pod("b1"), cluster.pod("c1"));
        for _ in 0..3 {
            flows::assert_ok(&flows::client(a1, addr("b1"), &small)); // HBONE out
            flows::assert_ok(&flows::client(b1, addr("a1"), &small)); // HBONE in
            flows::assert_ok(&flows::client(a1, addr("a2"), &stream)); // same node
            flows::assert_ok(&flows::client(a1, addr("c1"), &small)); // passthrough
            flows::assert_ok(&flows::client(c1, addr("a1"), &small)); // plaintext in
        }
        let cg = TestCgroup::create(&format!("{}/metrics-client", cluster.prefix()));
        let _ = Ztunnel::metrics_of(&cluster, a, &cg);
    }
    zb.stop();
    za.stop();
    let object = ztunnel.to_str().expect("utf-8 path");
    functions_of(&out, object)
}

/// The functions of `object` in callgrind's output `file`
/// (`--compress-strings=no`: every `fn=` line carries its name) with their
/// own instruction counts, in the order first listed.
fn functions_of(file: &Path, object: &str) -> Vec<(String, u64)> {
    let text = fs::read_to_string(file)
        .unwrap_or_else(|e| panic!("callgrind output {}: {e}", file.display()));
    let mut ours = false;
    let mut current: Option<usize> = None;
    let mut after_calls = false;
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut functions: Vec<(String, u64)> = Vec::new();
    for line in text.lines() {
        if let Some(ob) = line.strip_prefix("ob=") {
            ours = ob == object;
        } else if let Some(name) = line.strip_prefix("fn=") {
            // Code without a symbol shows as its address: nothing to order.
            current = (ours && !name.starts_with("0x")).then(|| {
                *index.entry(name.to_owned()).or_insert_with(|| {
                    functions.push((name.to_owned(), 0));
                    functions.len() - 1
                })
            });
        } else if line.starts_with("calls=") {
            // The next cost line is the call's inclusive cost, not ours.
            after_calls = true;
        } else if line.starts_with(|c: char| c.is_ascii_digit() || matches!(c, '+' | '-' | '*')) {
            if !after_calls && let Some(i) = current {
                let cost: u64 = line
                    .split_whitespace()
                    .nth(1)
                    .and_then(|c| c.parse().ok())
                    .unwrap_or(0);
                functions[i].1 += cost;
            }
            after_calls = false;
        }
    }
    assert!(
        !functions.is_empty(),
        "no function of {object} in {}",
        file.display()
    );
    functions
}

#[cfg(test)]
mod tests {
    use super::functions_of;

    #[test]
    fn self_costs_of_our_object_only_and_not_the_calls() {
        let dir = std::env::temp_dir().join(format!("zt-layout-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("callgrind.out");
        std::fs::write(
            &file,
            "events: Ir\n\
             ob=/bin/ztunnel\n\
             fl=src/main.rs\n\
             fn=main\n\
             10 5\n\
             +1 7\n\
             cob=/lib/libc.so.6\n\
             cfn=write\n\
             calls=1 0\n\
             12 900\n\
             ob=/lib/libc.so.6\n\
             fn=write\n\
             0 900\n\
             ob=/bin/ztunnel\n\
             fn=0x0000000000001234\n\
             0 3\n\
             fn=helper\n\
             * 4\n\
             fn=main\n\
             -2 1\n",
        )
        .unwrap();
        let got = functions_of(&file, "/bin/ztunnel");
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(got, vec![("main".to_owned(), 13), ("helper".to_owned(), 4)]);
    }
}
