//! A cluster made of network namespaces.
//!
//! ```text
//!  fabric ns: bridge br0 ──┬── veth ── node ns (10.244.0.N)
//!                          ├── veth ── pod ns eth0 (10.244.N.M, fd00:10:244::N:M)
//!                          └── ...
//! ```
//! One flat L2 segment: every address is on-link, so no routes leave the
//! test's namespaces. Each pod also gets a cgroup below the cluster's
//! cgroup, which is what tests attach the capture programs to.
//!
//! Drop order (fields are dropped in declaration order): pod processes are
//! owned by tests and dropped before the cluster; then pods (netns first,
//! then their cgroups), nodes, the fabric, the cluster cgroup, and last the
//! bpffs mount.

use std::path::{Path, PathBuf};

use crate::{
    bpffs::TestBpffs, cgroup::TestCgroup, netns::TestNetns, process::command_in, unique_prefix,
};

/// The fabric bridge's name inside the fabric namespace.
const BRIDGE: &str = "br0";

/// One pod: namespace, cgroup, addresses.
#[derive(Debug)]
pub struct Pod {
    /// Short name, e.g. `app-a1`.
    pub name: String,
    /// Index of the node it runs on.
    pub node: usize,
    /// IPv4 address (on `eth0`).
    pub ip: std::net::Ipv4Addr,
    /// IPv6 address (on `eth0`).
    pub ip6: std::net::Ipv6Addr,
    netns: TestNetns,
    cgroup: TestCgroup,
}

impl Pod {
    /// The namespace.
    pub fn netns(&self) -> &TestNetns {
        &self.netns
    }

    /// The namespace's path, as given to ztunnel.
    pub fn netns_path(&self) -> PathBuf {
        self.netns.path()
    }

    /// The pod's cgroup directory.
    pub fn cgroup(&self) -> &Path {
        self.cgroup.path()
    }

    /// A command that will run inside this pod (namespace and cgroup).
    pub fn command(&self, program: &Path) -> std::process::Command {
        command_in(&self.netns.path(), &self.cgroup.procs(), program)
    }
}

/// One node: a namespace on the fabric.
#[derive(Debug)]
pub struct Node {
    /// Short name, e.g. `node-a`.
    pub name: String,
    /// Address on the fabric.
    pub ip: std::net::Ipv4Addr,
    netns: TestNetns,
}

impl Node {
    /// The node's namespace.
    pub fn netns(&self) -> &TestNetns {
        &self.netns
    }
}

/// A whole test topology. Everything is removed on drop.
#[derive(Debug)]
pub struct Cluster {
    prefix: String,
    pods: Vec<Pod>,
    nodes: Vec<Node>,
    fabric: TestNetns,
    cgroup: TestCgroup,
    bpffs: TestBpffs,
    dir: TestDir,
    veths: u32,
}

/// A scratch folder for config files, sockets and logs; removed on drop.
#[derive(Debug)]
struct TestDir(PathBuf);

impl Drop for TestDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("cleanup: cannot remove {}: {e}", self.0.display());
        }
    }
}

impl Cluster {
    /// Creates the fabric (with its bridge), the cluster cgroup and a private
    /// bpffs. Sweeps stale objects of crashed earlier runs first.
    pub fn new() -> Self {
        crate::sweep::stale();
        let prefix = unique_prefix();
        let bpffs = TestBpffs::mount(&prefix);
        let dir = PathBuf::from(crate::sweep::SCRATCH_PARENT).join(&prefix);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        let dir = TestDir(dir);
        let cgroup = TestCgroup::create(&prefix);
        let fabric = TestNetns::create(&format!("{prefix}-fabric"));
        fabric.ip(&["link", "add", BRIDGE, "type", "bridge"]);
        fabric.ip(&["link", "set", BRIDGE, "up"]);
        Self {
            prefix,
            pods: Vec::new(),
            nodes: Vec::new(),
            fabric,
            cgroup,
            bpffs,
            dir,
            veths: 0,
        }
    }

    /// The unique prefix of this cluster's objects.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The cluster's cgroup: the parent of every pod's cgroup, and where
    /// tests attach the capture programs.
    pub fn cgroup(&self) -> &Path {
        self.cgroup.path()
    }

    /// The cluster's private bpffs mount.
    pub fn bpffs(&self) -> &TestBpffs {
        &self.bpffs
    }

    /// Scratch folder for config files, sockets and logs.
    pub fn dir(&self) -> &Path {
        &self.dir.0
    }

    /// The fabric namespace.
    pub fn fabric(&self) -> &TestNetns {
        &self.fabric
    }

    /// Adds a node namespace with an address on the fabric.
    pub fn add_node(&mut self, name: &str) -> usize {
        let index = self.nodes.len();
        let netns = TestNetns::create(&format!("{}-{name}", self.prefix));
        let ip = std::net::Ipv4Addr::new(10, 244, 0, 1 + index as u8);
        self.wire(&netns, &format!("{ip}/16"), None);
        self.nodes.push(Node {
            name: name.to_owned(),
            ip,
            netns,
        });
        index
    }

    /// Adds a pod on `node` with `eth0`, IPv4 10.244.<node+1>.<10+k> and
    /// IPv6 `fd00:10:244::<node+1>:<10+k>`, plus its own cgroup.
    pub fn add_pod(&mut self, node: usize, name: &str) -> &Pod {
        let k = self.pods.iter().filter(|p| p.node == node).count() as u8;
        let ip = std::net::Ipv4Addr::new(10, 244, node as u8 + 1, 10 + k);
        let ip6: std::net::Ipv6Addr = format!("fd00:10:244::{}:{}", node + 1, 10 + k)
            .parse()
            .expect("valid v6");
        let netns = TestNetns::create(&format!("{}-{name}", self.prefix));
        self.wire(&netns, &format!("{ip}/16"), Some(&format!("{ip6}/64")));
        let cgroup = TestCgroup::create(&format!("{}/{name}", self.prefix));
        self.pods.push(Pod {
            name: name.to_owned(),
            node,
            ip,
            ip6,
            netns,
            cgroup,
        });
        self.pods.last().expect("just pushed")
    }

    /// A pod by name.
    pub fn pod(&self, name: &str) -> &Pod {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod {name}"))
    }

    /// A node by index.
    pub fn node(&self, index: usize) -> &Node {
        &self.nodes[index]
    }

    /// Connects `ns` to the fabric bridge with a veth whose inner end is
    /// `eth0`, and addresses it.
    fn wire(&mut self, ns: &TestNetns, v4: &str, v6: Option<&str>) {
        self.veths += 1;
        // Interface names are limited to 15 bytes; pid+counter keep them unique.
        let outer = format!("zv{:x}x{}", std::process::id(), self.veths);
        let fabric = self.fabric.name().to_owned();
        ns.ip(&[
            "link", "add", "eth0", "type", "veth", "peer", "name", &outer, "netns", &fabric,
        ]);
        self.fabric.ip(&["link", "set", &outer, "master", BRIDGE]);
        self.fabric.ip(&["link", "set", &outer, "up"]);
        if v6.is_some() {
            // Skip duplicate address detection so the address is usable now.
            ns.sysctl("net.ipv6.conf.eth0.accept_dad", "0");
        }
        ns.ip(&["addr", "add", v4, "dev", "eth0"]);
        if let Some(v6) = v6 {
            ns.ip(&["addr", "add", v6, "dev", "eth0", "nodad"]);
        }
        ns.ip(&["link", "set", "eth0", "up"]);
    }
}

impl Default for Cluster {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Pods before nodes before the fabric: deleting a namespace deletes
        // its veth end, and the fabric holds the other ends.
        self.pods.clear();
        self.nodes.clear();
    }
}
