//! The registries file (`/etc/rancher/agent/registries.yaml`), in the k3s/rke2 format: mirrors
//! (endpoints tried in order, then the registry itself) and per-host credentials and TLS.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, Default, Deserialize)]
pub struct Registries {
    #[serde(default)]
    pub mirrors: BTreeMap<String, Mirror>,
    #[serde(default)]
    pub configs: BTreeMap<String, HostConfig>,
}

#[derive(Debug, Default, Deserialize)]
pub struct Mirror {
    #[serde(default)]
    pub endpoint: Vec<String>,
}

#[derive(Debug, Default, Clone, Deserialize)]
pub struct HostConfig {
    #[serde(default)]
    pub auth: Option<Auth>,
    #[serde(default)]
    pub tls: Option<Tls>,
}

#[derive(Debug, Default, Clone, Deserialize)]
pub struct Auth {
    #[serde(default)]
    pub username: String,
    #[serde(default)]
    pub password: String,
    /// base64 of `username:password`.
    #[serde(default)]
    pub auth: String,
}

#[derive(Debug, Default, Clone, Deserialize)]
pub struct Tls {
    #[serde(default)]
    pub ca_file: String,
    #[serde(default)]
    pub cert_file: String,
    #[serde(default)]
    pub key_file: String,
    #[serde(default)]
    pub insecure_skip_verify: bool,
}

impl Auth {
    /// (username, password), from `auth` when the separate fields are empty.
    pub fn basic(&self) -> Option<(String, String)> {
        if !self.username.is_empty() {
            return Some((self.username.clone(), self.password.clone()));
        }
        use base64::Engine;
        let raw = base64::engine::general_purpose::STANDARD.decode(self.auth.trim()).ok()?;
        let text = String::from_utf8(raw).ok()?;
        let (u, p) = text.split_once(':')?;
        Some((u.to_string(), p.to_string()))
    }
}

/// One place to pull from: a base URL (`https://host[:port][/prefix]`) and its host's settings.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub base: String,
    pub config: HostConfig,
    /// Hosts (`host` or `host:port`) the registries file names, in `configs` keys or mirror
    /// endpoints: besides the endpoint's own, the only token realms its credentials may go to.
    pub named_hosts: Vec<String>,
}

impl Registries {
    /// Read `path`; a missing file means no mirrors and no credentials.
    pub fn load(path: &Path) -> Result<Registries, String> {
        match std::fs::read(path) {
            Ok(raw) if raw.iter().all(u8::is_ascii_whitespace) => Ok(Registries::default()),
            // The file holds registry passwords, which the parser's message can quote: position only.
            Ok(raw) => serde_yaml_ng::from_slice(&raw).map_err(|e| {
                format!("{}: invalid registries file {}", path.display(), crate::config::yaml_location(&e))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Registries::default()),
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        }
    }

    /// Where to pull an image of `registry` from, in order: its mirror endpoints (or those of the
    /// `*` mirror), then the registry itself (`registry-1.docker.io` for Docker Hub).
    pub fn endpoints(&self, registry: &str) -> Vec<Endpoint> {
        let mirror = self.mirrors.get(registry).or_else(|| self.mirrors.get("*"));
        let default = if registry == super::reference::DOCKER_HUB {
            "https://registry-1.docker.io".to_string()
        } else {
            format!("https://{registry}")
        };
        let mut bases: Vec<String> =
            mirror.map(|m| m.endpoint.iter().map(|e| normalize(e)).collect()).unwrap_or_default();
        bases.push(default);
        let named_hosts = self.named_hosts();
        let mut seen = std::collections::HashSet::new();
        bases
            .into_iter()
            .filter(|b| !b.is_empty() && seen.insert(b.clone()))
            .map(|base| {
                let host = host_of(&base);
                let config = self
                    .configs
                    .get(&host)
                    .or_else(|| (host == "registry-1.docker.io").then(|| self.configs.get(registry)).flatten())
                    .or_else(|| self.configs.get("*"))
                    .cloned()
                    .unwrap_or_default();
                Endpoint { base, config, named_hosts: named_hosts.clone() }
            })
            .collect()
    }
}

impl Endpoint {
    /// The base URL for messages, without any `user:password@` in it.
    pub fn shown(&self) -> String {
        super::reference::redact_userinfo(&self.base)
    }
}

impl Registries {
    /// Every host the file names: `configs` keys (but `*`) and the hosts of mirror endpoints.
    fn named_hosts(&self) -> Vec<String> {
        let configs = self.configs.keys().filter(|k| k.as_str() != "*").map(|k| k.trim().to_ascii_lowercase());
        let mirrors = self.mirrors.values().flat_map(|m| m.endpoint.iter()).map(|e| host_of(&normalize(e)));
        let mut hosts: Vec<String> = configs.chain(mirrors.map(|h| h.to_ascii_lowercase())).collect();
        hosts.sort();
        hosts.dedup();
        hosts
    }
}

/// `host:5000` → `https://host:5000`; no trailing `/` or `/v2`.
fn normalize(endpoint: &str) -> String {
    let e = endpoint.trim();
    let e = if e.contains("://") { e.to_string() } else { format!("https://{e}") };
    let e = e.trim_end_matches('/');
    e.strip_suffix("/v2").unwrap_or(e).to_string()
}

fn host_of(base: &str) -> String {
    let rest = base.split_once("://").map_or(base, |(_, r)| r);
    rest.split('/').next().unwrap_or(rest).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirrors_come_first_then_the_registry_with_per_host_settings() {
        let yaml = r#"
mirrors:
  docker.io:
    endpoint: ["mirror.local:5000", "https://mirror2.local/v2/"]
  "*":
    endpoint: ["http://any.local"]
configs:
  "mirror.local:5000":
    auth: {username: u, password: p}
    tls: {insecure_skip_verify: true}
  "registry.example":
    auth: {auth: dTI6cDI=}
"#;
        let r: Registries = serde_yaml_ng::from_str(yaml).unwrap();
        let hub = r.endpoints("docker.io");
        let bases: Vec<&str> = hub.iter().map(|e| e.base.as_str()).collect();
        assert_eq!(bases, ["https://mirror.local:5000", "https://mirror2.local", "https://registry-1.docker.io"]);
        assert_eq!(hub[0].config.auth.as_ref().unwrap().basic(), Some(("u".into(), "p".into())));
        assert!(hub[0].config.tls.as_ref().unwrap().insecure_skip_verify);
        assert!(hub[1].config.auth.is_none());
        let other = r.endpoints("registry.example");
        let bases: Vec<&str> = other.iter().map(|e| e.base.as_str()).collect();
        assert_eq!(bases, ["http://any.local", "https://registry.example"]);
        assert_eq!(other[1].config.auth.as_ref().unwrap().basic(), Some(("u2".into(), "p2".into())));
    }

    #[test]
    fn a_missing_file_is_no_mirrors_and_a_bad_one_is_one_line() {
        let d = tempfile::tempdir().unwrap();
        assert!(Registries::load(&d.path().join("none.yaml")).unwrap().mirrors.is_empty());
        let bad = d.path().join("bad.yaml");
        std::fs::write(&bad, "mirrors: [1, 2\n  x").unwrap();
        let e = Registries::load(&bad).unwrap_err();
        assert!(e.starts_with(&bad.display().to_string()) && !e.contains('\n'), "{e}");
        // The parser would quote the value that does not fit: a password must not reach the log.
        std::fs::write(
            &bad,
            "configs:\n  h:\n    auth: {username: u, password: hunter2}\n    tls: {insecure_skip_verify: hunter2}\n",
        )
        .unwrap();
        let e = Registries::load(&bad).unwrap_err();
        assert!(!e.contains("hunter2") && e.contains("line 4"), "{e}");
    }
}
