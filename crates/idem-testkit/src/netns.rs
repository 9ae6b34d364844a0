//! Network namespaces as test hosts, so a consumer process can be cut from its servers and
//! healed (Linux, root, iproute2's `ip`).
//!
//! [`Netns::create`] makes a namespace `idemns-<pid>-<n>` joined to the root namespace by a veth
//! pair: the host side `10.77.<n>.1/30`, the namespace side `10.77.<n>.2/30`, loopback up.
//! A process started with [`Netns::command`] lives in it and reaches the root namespace at
//! [`Netns::host_ip`] only, where the test runs a [`Proxy`](crate::proxy::Proxy) per server.
//! [`Netns::cut`] sets the host side of the pair down: packets are dropped, nothing is reset,
//! so every connection across it goes half-open, as in a real partition; [`Netns::heal`] sets
//! it up again.
//!
//! The namespace (and with it the pair) is deleted on drop; namespaces left by a test process
//! that died are deleted by the next [`Netns::create`].

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::Mutex;

/// Prefix of every namespace this module makes.
const PREFIX: &str = "idemns-";

/// Subnets this process has taken (the `n` of `10.77.<n>.0/30`).
static TAKEN: Mutex<Vec<u8>> = Mutex::new(Vec::new());

/// A network namespace joined to the root namespace by a veth pair; deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
    host_veth: String,
    subnet: u8,
    /// Whether this value made the veth pair (a name taken by another process is not ours).
    owns_veth: bool,
}

/// Runs `ip args…`; its stderr as the error.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("`ip {}`: {e}", args.join(" ")))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!("`ip {}`: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
}

/// The names of the existing namespaces.
fn namespaces() -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output();
    let Ok(out) = out else { return Vec::new() };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

/// Deletes the namespaces `idemns-<pid>-<n>` whose process is gone (a test run that crashed or
/// was killed before its drops ran). Deleting a namespace destroys its end of the veth pair,
/// which destroys the other end.
pub fn sweep_stale() {
    for ns in namespaces() {
        let pid = ns.strip_prefix(PREFIX).and_then(|r| r.split('-').next());
        // Only names this module makes: another tool's namespace is never touched.
        let Some(Ok(pid)) = pid.map(str::parse::<u32>) else { continue };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "del", &ns]);
        }
    }
}

impl Netns {
    /// A new namespace with its veth pair up and addressed, after deleting stale ones.
    ///
    /// # Errors
    /// Why namespaces are unavailable: not root, no `ip`, a kernel without namespaces, or every
    /// subnet taken.
    pub fn create() -> Result<Self, String> {
        sweep_stale();
        let pid = std::process::id();
        // Another process may hold a subnet: its veth name is taken and `ip link add` fails.
        let mut last = String::from("no subnet tried");
        for subnet in 1..=250u8 {
            {
                let mut taken = TAKEN.lock().unwrap_or_else(|e| e.into_inner());
                if taken.contains(&subnet) {
                    continue;
                }
                taken.push(subnet);
            }
            let mut ns = Self {
                name: format!("{PREFIX}{pid}-{subnet}"),
                host_veth: format!("idem{subnet}h"),
                subnet,
                owns_veth: false,
            };
            match ns.setup() {
                Ok(()) => return Ok(ns),
                Err(e) if e.contains("File exists") => last = e, // drop deletes what was made
                Err(e) => return Err(e),
            }
        }
        Err(format!("no free subnet 10.77.n.0/30: {last}"))
    }

    fn setup(&mut self) -> Result<(), String> {
        let peer = format!("idem{}n", self.subnet);
        let (host, guest) = (self.host_cidr(), format!("{}/30", self.ns_ip()));
        ip(&["netns", "add", &self.name])?;
        let link = [
            "link",
            "add",
            &self.host_veth,
            "type",
            "veth",
            "peer",
            "name",
            &peer,
            "netns",
            &self.name,
        ];
        ip(&link)?;
        self.owns_veth = true;
        ip(&["addr", "add", &host, "dev", &self.host_veth])?;
        ip(&["link", "set", &self.host_veth, "up"])?;
        self.exec_ip(&["link", "set", "lo", "up"])?;
        self.exec_ip(&["addr", "add", &guest, "dev", &peer])?;
        self.exec_ip(&["link", "set", &peer, "up"])
    }

    fn exec_ip(&self, args: &[&str]) -> Result<(), String> {
        let mut all = vec!["netns", "exec", &self.name, "ip"];
        all.extend_from_slice(args);
        ip(&all)
    }

    fn host_cidr(&self) -> String {
        format!("{}/30", self.host_ip())
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The root namespace's address on the pair (`10.77.<n>.1`): where proxies listen.
    pub fn host_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, self.subnet, 1)
    }

    /// The namespace's address on the pair (`10.77.<n>.2`).
    pub fn ns_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, self.subnet, 2)
    }

    /// A command that runs `program` inside the namespace (`ip netns exec`).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }

    /// Partitions the namespace: the host side of the pair goes down, so packets either way are
    /// dropped without a reset and open connections go half-open.
    ///
    /// # Panics
    /// When `ip` fails (the test cannot inject its fault).
    pub fn cut(&self) {
        ip(&["link", "set", &self.host_veth, "down"]).unwrap_or_else(|e| panic!("cut: {e}"));
    }

    /// Heals the partition: the host side goes up again (with its address, which stays).
    ///
    /// # Panics
    /// When `ip` fails.
    pub fn heal(&self) {
        ip(&["link", "set", &self.host_veth, "up"]).unwrap_or_else(|e| panic!("heal: {e}"));
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // The veth pair goes with the namespace (its peer lives there); the host side is
        // deleted first so that the pair is gone even if the namespace deletion fails.
        if self.owns_veth {
            let _ = ip(&["link", "del", &self.host_veth]);
        }
        let _ = ip(&["netns", "del", &self.name]);
        TAKEN.lock().unwrap_or_else(|e| e.into_inner()).retain(|s| *s != self.subnet);
    }
}

/// A namespace, or `None` after printing `skipped: network namespaces unavailable (<why>)`.
///
/// # Panics
/// When namespaces are unavailable and the environment has `CI=true`: a partition suite that
/// passes without partitions is a defect.
pub fn require() -> Option<Netns> {
    // `id -u` rather than a libc call: the crate forbids unsafe code.
    let root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0");
    let made = if root { Netns::create() } else { Err("not root".to_owned()) };
    match made {
        Ok(ns) => Some(ns),
        Err(why) => {
            assert!(
                !crate::service::in_ci(),
                "network namespaces unavailable ({why}) and CI=true: failing instead of skipping"
            );
            eprintln!("skipped: network namespaces unavailable ({why})");
            None
        }
    }
}
