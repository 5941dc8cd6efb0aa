//! `nodeplan install` and `nodeplan uninstall`: put the agent on a machine the way system-agent's
//! installer does, and take it off again.
//!
//! This module owns the installer's settings (system-agent's `CATTLE_*` installer variables and the
//! command's flags, [`settings`]), the exchange with the Rancher server that yields the connection
//! info ([`fetch`]: `/cacerts` checked against `CATTLE_CA_CHECKSUM`, then `/v3/connect/agent`),
//! the pure planning of what to write ([`plan`]: config, connection info, unit, environment file,
//! binary, the `cattle-id`, the manifest; which existing files may be replaced), and the executor
//! that carries a plan out under a root directory ([`run`], through [`tree`]), records a manifest
//! of what it wrote and enables the unit. Uninstall removes exactly what the manifest lists and
//! still holds the content install wrote.
//!
//! It must not start or stop plans, read or write the agent's state (work, plan and PID
//! directories), or follow a symlink inside an install tree: every file goes through
//! [`crate::safefs`].

pub mod fetch;
pub mod plan;
pub mod run;
pub mod settings;
pub mod tree;

/// The unit file nodeplan installs; `deploy/nodeplan.service` in the repository, the one copy the
/// packages ship too.
pub const UNIT_TEMPLATE: &str = include_str!("../../deploy/nodeplan.service");

/// Where the unit goes (systemd's directory for units the administrator installs).
pub const UNIT_PATH: &str = "/etc/systemd/system/nodeplan.service";

/// The unit's environment file the installer manages a block of (proxy variables, log level).
pub const ENV_PATH: &str = "/etc/systemd/system/nodeplan.env";

/// The `enable` link of the unit (what `systemctl enable` makes for `WantedBy=multi-user.target`).
pub const WANTS_LINK: &str = "/etc/systemd/system/multi-user.target.wants/nodeplan.service";

/// The manifest of what install wrote, in the config directory.
pub const MANIFEST_NAME: &str = "nodeplan-install.json";

/// The kept Cattle id, in the config directory (system-agent's installer keeps it there too).
pub const CATTLE_ID_NAME: &str = "cattle-id";

/// The SHA-256 of `data` in lowercase hex.
pub fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}
