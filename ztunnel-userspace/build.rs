//! Embeds the kernel object built by `cargo xtask build-ebpf`.
//!
//! There is exactly one builder (xtask). This script only checks that the
//! object it finds was built from the current eBPF sources, using the same
//! code xtask uses to stamp it, and refuses to build otherwise: a stale or
//! missing object is never embedded silently.

#[path = "../xtask/src/ebpf_artifact.rs"]
mod ebpf_artifact;

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    );
    let workspace = manifest
        .parent()
        .expect("crate lives in the workspace")
        .to_path_buf();
    let artifact = ebpf_artifact::Artifact::locate(&workspace);

    println!("cargo:rerun-if-changed={}", artifact.object.display());
    println!("cargo:rerun-if-changed={}", artifact.stamp.display());
    for input in ebpf_artifact::input_files(&workspace) {
        println!("cargo:rerun-if-changed={}", input.display());
    }
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");

    if let Err(problem) = artifact.check_current(&workspace) {
        eprintln!(
            "error: ztunnel-userspace embeds the eBPF object, but {problem}.\n\
             Run `cargo xtask build-ebpf` (or `cargo xtask test`) first."
        );
        std::process::exit(1);
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::copy(&artifact.object, out.join(ebpf_artifact::OBJECT_NAME))
        .expect("copy the eBPF object into OUT_DIR");
}
