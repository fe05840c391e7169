//! The VM's initramfs: a static busybox, the modules needed to mount the
//! host's root over 9p, and an init that builds the test root and runs
//! the job.
//!
//! The test root is the host's `/` shared read-only, with fresh tmpfs on
//! `/tmp` and `/run` and the guest's own proc, sys, dev, cgroup2 and bpffs
//! mounted over it; the results folder (shared read-write) appears at
//! `/tmp/results`. The kernel's module auto-loading is routed through a
//! helper that runs the host's `modprobe` inside that root against the
//! unpacked kernel's module tree, so `ip link add type veth`, `tc qdisc
//! add clsact` and iptables load what they need as on a real machine.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

use super::kernels::Kernel;

/// Modules needed before the root can be mounted (built in on some
/// kernels; `--show-depends` then prints `builtin` and nothing is copied).
const BOOT_MODULES: &[&str] = &["virtio_pci", "virtio_console", "9pnet_virtio", "9p"];

/// Modules the tests need, loaded up front so a failure shows in the log
/// (auto-loading would load them too).
const TEST_MODULES: &[&str] = &[
    "veth",
    "sch_ingress",
    "cls_bpf",
    "nf_tables",
    "ip_tables",
    "ip6_tables",
    "iptable_nat",
    "ip6table_nat",
    "iptable_mangle",
    "ip6table_mangle",
    "nf_conntrack",
    "xt_mark",
    "xt_connmark",
    "xt_socket",
    "xt_TPROXY",
];

/// Marker the init prints once the job has ended, with its exit status.
pub const DONE_MARKER: &str = "ZT_VM_DONE rc=";

/// Builds `<vm_dir>/initramfs-<release>.cpio` for `kernel`.
pub fn build(vm_dir: &Path, kernel: &Kernel) -> Result<PathBuf> {
    // Built under names of this process and renamed into place, so two
    // runs at once (a full matrix beside `xtask test`) never see a torn file.
    let out = vm_dir.join(format!("initramfs-{}.cpio", kernel.release));
    let pid = std::process::id();
    let partial = vm_dir.join(format!("initramfs-{}.cpio.{pid}", kernel.release));
    let staging = vm_dir.join(format!("initramfs-{}.{pid}.d", kernel.release));
    let _ = std::fs::remove_dir_all(&staging);
    for dir in ["bin", "mod", "proc", "sys", "dev", "newroot"] {
        std::fs::create_dir_all(staging.join(dir))?;
    }
    let busybox = Path::new("/usr/bin/busybox");
    std::fs::copy(busybox, staging.join("bin/busybox"))
        .context("copy /usr/bin/busybox (package busybox-static)")?;

    let mut order = String::new();
    for module in BOOT_MODULES {
        for path in module_files(kernel, module)? {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .context("module file name")?;
            let compressed = path.extension().is_some_and(|e| e == "xz");
            let plain = name.strip_suffix(".xz").unwrap_or(name);
            if order.lines().any(|l| l == plain) {
                continue;
            }
            let target = staging.join("mod").join(plain);
            if compressed {
                // busybox insmod takes plain objects only.
                let data = Command::new("xz")
                    .arg("-dc")
                    .arg(&path)
                    .output()
                    .context("run xz -dc")?;
                if !data.status.success() {
                    bail!("xz -dc {} failed", path.display());
                }
                std::fs::write(&target, data.stdout)?;
            } else {
                std::fs::copy(&path, &target)?;
            }
            let _ = writeln!(order, "{plain}");
        }
    }
    std::fs::write(staging.join("mod/order"), order)?;

    let modprobe = if Path::new("/usr/sbin/modprobe").exists() {
        "/usr/sbin/modprobe"
    } else {
        "/sbin/modprobe"
    };
    let helper = format!(
        "#!/bin/busybox sh\nexec /bin/busybox chroot /newroot {modprobe} -d {} \"$@\"\n",
        kernel.root.display()
    );
    write_executable(&staging.join("bin/zt-modprobe"), &helper)?;
    // The guest's fresh tmpfs on /tmp and /run would hide a workspace that
    // lives there (a clone in /tmp): the job could not even `cd` into it.
    let workspace = vm_dir
        .parent()
        .and_then(Path::parent)
        .context("the VM folder is not <workspace>/target/vm")?;
    let hidden = [Path::new("/tmp"), Path::new("/run")]
        .iter()
        .any(|d| workspace.starts_with(d));
    write_executable(
        &staging.join("init"),
        &init_script(TEST_MODULES, hidden.then_some(workspace)),
    )?;

    let file =
        std::fs::File::create(&partial).with_context(|| format!("create {}", partial.display()))?;
    let status = Command::new("sh")
        .current_dir(&staging)
        .args(["-c", "find . | cpio -o -H newc --quiet"])
        .stdout(Stdio::from(file))
        .status()
        .context("run cpio (package cpio)")?;
    if !status.success() {
        bail!("cpio failed building {}", out.display());
    }
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::rename(&partial, &out).with_context(|| format!("rename to {}", out.display()))?;
    Ok(out)
}

/// The files `modprobe --show-depends` would insert for `module`, in order.
fn module_files(kernel: &Kernel, module: &str) -> Result<Vec<PathBuf>> {
    let out = Command::new("modprobe")
        .arg("-d")
        .arg(&kernel.root)
        .args(["-S", &kernel.release, "--show-depends", module])
        .output()
        .context("run modprobe --show-depends (package kmod)")?;
    if !out.status.success() {
        bail!(
            "module {module} not found for {}: {}",
            kernel.release,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("insmod "))
        .filter_map(|l| l.split_whitespace().next())
        .map(PathBuf::from)
        .collect())
}

fn write_executable(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::write(path, text)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// The guest's init. `expose`: a host folder under `/tmp` or `/run` to
/// show through the guest's own tmpfs there (bound from a second view of
/// the host root taken before the tmpfs goes on).
fn init_script(test_modules: &[&str], expose: Option<&Path>) -> String {
    let preload = test_modules.join(" ");
    let (keep_view, rebind) = match expose {
        Some(dir) => {
            let dir = dir.display();
            (
                "mkdir -p /hostview && mount -o bind /newroot /hostview || fail \"cannot bind the host root\"".to_owned(),
                format!("mkdir -p /newroot{dir} && mount -o bind /hostview{dir} /newroot{dir} || fail \"cannot show {dir} in the guest\""),
            )
        }
        None => (String::new(), String::new()),
    };
    format!(
        r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /mod/order); do insmod /mod/$m || echo "ZT_VM insmod $m failed"; done
echo "ZT_VM_INIT $(uname -r)"
fail() {{ echo "ZT_VM $1"; echo "{DONE_MARKER}99"; poweroff -f; }}
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose hostroot /newroot || fail "cannot mount the host root"
{keep_view}
for d in tmp run; do mount -t tmpfs $d /newroot/$d; done
{rebind}
mount -t proc proc /newroot/proc
mount -t sysfs sys /newroot/sys
mount -t devtmpfs dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts pts /newroot/dev/pts
mount -t tmpfs shm /newroot/dev/shm
mount -t cgroup2 cgroup2 /newroot/sys/fs/cgroup
mount -t bpf bpf /newroot/sys/fs/bpf
mkdir -p /newroot/tmp/results
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 results /newroot/tmp/results || fail "cannot mount the results folder"
echo /bin/zt-modprobe > /proc/sys/kernel/modprobe
for m in {preload}; do /bin/zt-modprobe -q $m || echo "ZT_VM modprobe $m failed"; done
ip link set lo up
chroot /newroot /bin/sh /tmp/results/job.sh
rc=$?
sync
echo "{DONE_MARKER}$rc"
poweroff -f
"#
    )
}
