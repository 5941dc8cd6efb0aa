//! Pulling from one registry endpoint with the distribution API: the manifest (through an image
//! index for this platform), then every layer, each verified against its sha256 digest before it
//! is extracted. Authentication: anonymous, Basic, or a Bearer token from the registry's token
//! service (with the configured credentials).

use super::reference::{ImageRef, is_sha256_digest, redact_userinfo};
use super::registries::Endpoint;
use crate::error_line as chain;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::path::Path;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

const ACCEPT_MANIFESTS: &str = "application/vnd.oci.image.index.v1+json, \
    application/vnd.docker.distribution.manifest.list.v2+json, \
    application/vnd.oci.image.manifest.v1+json, \
    application/vnd.docker.distribution.manifest.v2+json";
/// A manifest larger than this is not a manifest.
const MAX_MANIFEST: usize = 4 << 20;

#[derive(Debug, Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
    /// Bytes; a blob may not be larger (0 = not given).
    #[serde(default)]
    size: u64,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Debug, Deserialize)]
struct Platform {
    #[serde(default)]
    os: String,
    #[serde(default)]
    architecture: String,
}

#[derive(Debug, Deserialize)]
struct Index {
    manifests: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
struct Manifest {
    #[serde(default)]
    layers: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
struct Token {
    #[serde(default)]
    token: String,
    #[serde(default)]
    access_token: String,
}

/// The architecture as registries name it.
pub fn platform_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

fn client(ep: &Endpoint) -> Result<reqwest::Client, String> {
    let mut b = reqwest::Client::builder()
        .user_agent(concat!("nodeplan/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(Duration::from_secs(30))
        .read_timeout(Duration::from_secs(60));
    if let Some(tls) = &ep.config.tls {
        b = b.danger_accept_invalid_certs(tls.insecure_skip_verify);
        if !tls.ca_file.is_empty() {
            let pem = std::fs::read(&tls.ca_file).map_err(|e| format!("cannot read ca_file {}: {e}", tls.ca_file))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| format!("ca_file {}: {}", tls.ca_file, chain(&e)))?;
            for c in certs {
                b = b.add_root_certificate(c);
            }
        }
        if !tls.cert_file.is_empty() {
            let mut pem =
                std::fs::read(&tls.cert_file).map_err(|e| format!("cannot read cert_file {}: {e}", tls.cert_file))?;
            pem.extend(
                std::fs::read(&tls.key_file).map_err(|e| format!("cannot read key_file {}: {e}", tls.key_file))?,
            );
            let id = reqwest::Identity::from_pem(&pem)
                .map_err(|e| format!("cert_file {} / key_file {}: {}", tls.cert_file, tls.key_file, chain(&e)))?;
            b = b.identity(id);
        }
    }
    b.build().map_err(|e| format!("cannot build the HTTP client: {}", chain(&e)))
}

/// `Bearer realm="…",service="…"` → ("bearer", {realm, service}).
fn parse_challenge(h: &str) -> (String, Vec<(String, String)>) {
    let (scheme, rest) = h.trim().split_once(' ').unwrap_or((h.trim(), ""));
    let mut params = Vec::new();
    let mut rest = rest.trim();
    while !rest.is_empty() {
        let Some((k, after)) = rest.split_once('=') else { break };
        let (v, after) = match after.strip_prefix('"') {
            Some(q) => match q.split_once('"') {
                Some((v, a)) => (v, a),
                None => (q, ""),
            },
            None => after.split_once(',').map_or((after, ""), |(v, a)| (v, a)),
        };
        params.push((k.trim().to_ascii_lowercase(), v.to_string()));
        rest = after.trim_start_matches([',', ' ']);
    }
    (scheme.to_ascii_lowercase(), params)
}

/// Whether the registry's credentials may go to the token service at `realm`, or why not.
///
/// The rule: only to the endpoint's own host and port, to a host the registries file names
/// (`configs` keys, mirror endpoints; `host` means the scheme's default port), or to Docker Hub's
/// own token service for Docker Hub; and never over plain http when the endpoint is https. A
/// registry (or whoever answers for it) otherwise picks where a `WWW-Authenticate` realm points,
/// so a realm on another host, even another port of the same host (a local user can listen
/// there), gets no password.
fn may_send_credentials(base: &str, realm: &reqwest::Url, named: &[String]) -> Result<(), &'static str> {
    let base = reqwest::Url::parse(base).map_err(|_| "the endpoint is not a URL")?;
    if base.scheme() == "https" && realm.scheme() != "https" {
        return Err("the realm is plain http while the registry endpoint is https");
    }
    let host = |u: &reqwest::Url| u.host_str().unwrap_or_default().to_ascii_lowercase();
    let (realm_host, realm_port) = (host(realm), realm.port_or_known_default());
    if realm_host == host(&base) && realm_port == base.port_or_known_default() {
        return Ok(());
    }
    if host(&base) == "registry-1.docker.io" && realm_host == "auth.docker.io" && realm.scheme() == "https" {
        return Ok(());
    }
    let named_ok = named.iter().any(|n| {
        let parsed = reqwest::Url::parse(&format!("{}://{n}", realm.scheme()));
        parsed.is_ok_and(|u| host(&u) == realm_host && u.port() == realm.port())
    });
    if named_ok {
        return Ok(());
    }
    Err("its host is neither the registry endpoint's nor one the registries file names")
}

/// The whole body, refused once it passes `cap` bytes.
async fn body_capped(mut resp: reqwest::Response, cap: usize, what: &str) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| format!("{what}: {}", chain(&e)))? {
        if body.len() + chunk.len() > cap {
            return Err(format!("{what}: larger than {cap} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

struct Session<'a> {
    client: reqwest::Client,
    ep: &'a Endpoint,
    repo: &'a str,
    basic: Option<(String, String)>,
    use_basic: bool,
    bearer: Option<String>,
}

impl Session<'_> {
    async fn get(&mut self, url: &str, accept: Option<&str>) -> Result<reqwest::Response, String> {
        for attempt in 0..2 {
            let mut req = self.client.get(url);
            if let Some(a) = accept {
                req = req.header(reqwest::header::ACCEPT, a);
            }
            if let Some(t) = &self.bearer {
                req = req.bearer_auth(t);
            } else if let (true, Some((u, p))) = (self.use_basic, &self.basic) {
                req = req.basic_auth(u, Some(p));
            }
            let resp = req.send().await.map_err(|e| chain(&e))?;
            if resp.status() == reqwest::StatusCode::UNAUTHORIZED && attempt == 0 {
                let challenge = resp
                    .headers()
                    .get(reqwest::header::WWW_AUTHENTICATE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string();
                self.authenticate(&challenge).await?;
                continue;
            }
            if !resp.status().is_success() {
                return Err(format!("GET {}: HTTP {}", redact_userinfo(url), resp.status()));
            }
            return Ok(resp);
        }
        Err(format!("GET {}: still unauthorized after authenticating", redact_userinfo(url)))
    }

    async fn authenticate(&mut self, challenge: &str) -> Result<(), String> {
        let (scheme, params) = parse_challenge(challenge);
        let param = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        match scheme.as_str() {
            "basic" if self.basic.is_some() => {
                self.use_basic = true;
                Ok(())
            }
            "basic" => Err(format!("{} wants credentials; none are configured for it", self.ep.shown())),
            "bearer" => {
                let realm = param("realm").ok_or("a Bearer challenge without a realm")?;
                let realm_url =
                    reqwest::Url::parse(&realm).map_err(|_| format!("the token realm {realm:?} is not a URL"))?;
                let scope = param("scope").unwrap_or_else(|| format!("repository:{}:pull", self.repo));
                let mut req = self.client.get(realm_url.clone()).query(&[("scope", scope.as_str())]);
                if let Some(service) = param("service") {
                    req = req.query(&[("service", service.as_str())]);
                }
                // A realm that fails the rule gets an anonymous token request rather than an error:
                // public images still pull (as from a registry without credentials), and a private
                // one fails with the realm's own answer, after this warning says why.
                if let Some((u, p)) = &self.basic {
                    match may_send_credentials(&self.ep.base, &realm_url, &self.ep.named_hosts) {
                        Ok(()) => req = req.basic_auth(u, Some(p)),
                        Err(why) => tracing::warn!(
                            "{}: not sending its credentials to the token realm {realm}: {why}; asking for a token \
                             anonymously (name the realm's host in the registries file's configs to trust it)",
                            self.ep.shown()
                        ),
                    }
                }
                let resp = req.send().await.map_err(|e| format!("token from {realm}: {}", chain(&e)))?;
                if !resp.status().is_success() {
                    return Err(format!("token from {realm}: HTTP {}", resp.status()));
                }
                let body = body_capped(resp, MAX_MANIFEST, &format!("token from {realm}")).await?;
                let t: Token = serde_json::from_slice(&body).map_err(|e| {
                    format!("token from {realm}: not a token answer ({})", crate::config::json_location(&e))
                })?;
                let token = if t.token.is_empty() { t.access_token } else { t.token };
                if token.is_empty() {
                    return Err(format!("token from {realm}: no token in the answer"));
                }
                self.bearer = Some(token);
                Ok(())
            }
            _ => Err(format!("unsupported authentication challenge {challenge:?}")),
        }
    }

    async fn manifest(&mut self, reference: &str) -> Result<Vec<u8>, String> {
        let url = format!("{}/v2/{}/manifests/{reference}", self.ep.base, self.repo);
        let resp = self.get(&url, Some(ACCEPT_MANIFESTS)).await?;
        let body = body_capped(resp, MAX_MANIFEST, &redact_userinfo(&url)).await?;
        if is_sha256_digest(reference) {
            let got = format!("sha256:{:x}", Sha256::digest(&body));
            if got != reference {
                return Err(format!("manifest {reference}: the registry sent content with digest {got}"));
            }
        }
        Ok(body.to_vec())
    }

    /// Download a blob into `file` (an empty scratch file), verifying its digest (and its size,
    /// when the manifest gives one, as it arrives: a registry cannot fill the disk).
    /// Without a size in the manifest, the download stops at the image's byte cap.
    async fn blob(
        &mut self,
        digest: &str,
        size: u64,
        file: &std::fs::File,
        limits: &super::Limits,
    ) -> Result<(), String> {
        let url = format!("{}/v2/{}/blobs/{digest}", self.ep.base, self.repo);
        let mut resp = self.get(&url, None).await?;
        let scratch = || format!("the scratch file for layer {digest}");
        let mut out = tokio::fs::File::from_std(file.try_clone().map_err(|e| format!("writing {}: {e}", scratch()))?);
        let mut hash = Sha256::new();
        let mut got_bytes = 0u64;
        while let Some(chunk) = resp.chunk().await.map_err(|e| format!("layer {digest}: {}", chain(&e)))? {
            got_bytes += chunk.len() as u64;
            crate::metrics::image_pull_bytes(chunk.len());
            if size > 0 && got_bytes > size {
                return Err(format!("layer {digest}: the registry sent more than the {size} bytes the manifest gives"));
            }
            if size == 0 && got_bytes > limits.max_bytes {
                return Err(format!(
                    "layer {digest}: the manifest gives no size and the registry sent {}",
                    limits.bytes_breach()
                ));
            }
            hash.update(&chunk);
            out.write_all(&chunk).await.map_err(|e| format!("writing {}: {e}", scratch()))?;
        }
        out.flush().await.map_err(|e| format!("writing {}: {e}", scratch()))?;
        let got = format!("sha256:{:x}", hash.finalize());
        if got != digest {
            return Err(format!("layer {digest}: the registry sent content with digest {got}"));
        }
        Ok(())
    }
}

/// Pull `image` from `ep` and extract its layers into `dest`, one at a time through a scratch
/// file in `scratch_dir` (see [`super::scratch_file`]).
pub async fn pull(
    ep: &Endpoint,
    image: &ImageRef,
    dest: &Path,
    scratch_dir: &Path,
    cancel: &std::sync::Arc<std::sync::atomic::AtomicBool>,
    limits: super::Limits,
) -> Result<(), String> {
    let mut s = Session {
        client: client(ep)?,
        ep,
        repo: &image.repository,
        basic: ep.config.auth.as_ref().and_then(|a| a.basic()),
        use_basic: false,
        bearer: None,
    };
    let mut body = s.manifest(image.reference()).await?;
    let v: serde_json::Value = serde_json::from_slice(&body).map_err(|e| format!("the manifest is not JSON: {e}"))?;
    if v.get("manifests").is_some() {
        let index: Index = serde_json::from_value(v).map_err(|e| format!("bad image index: {e}"))?;
        let arch = platform_arch();
        let chosen = index
            .manifests
            .iter()
            .find(|d| d.platform.as_ref().is_some_and(|p| p.os == "linux" && p.architecture == arch))
            .ok_or_else(|| format!("no linux/{arch} image in the index"))?;
        if !is_sha256_digest(&chosen.digest) {
            return Err(format!("bad manifest digest {:?} in the index", chosen.digest));
        }
        let digest = chosen.digest.clone();
        body = s.manifest(&digest).await?;
    }
    let m: Manifest = serde_json::from_slice(&body).map_err(|e| format!("bad image manifest: {e}"))?;
    if m.layers.is_empty() {
        return Err("the image manifest lists no layers (schema 1 manifests are not supported)".into());
    }
    let mut budget = super::Budget::new(limits);
    for layer in &m.layers {
        if !is_sha256_digest(&layer.digest) {
            return Err(format!("bad layer digest {:?}", layer.digest));
        }
        if layer.media_type.contains("zstd") {
            return Err(format!("layer {}: zstd-compressed layers are not supported", layer.digest));
        }
        if layer.size > limits.max_bytes {
            return Err(format!("layer {} is {} bytes, {}", layer.digest, layer.size, limits.bytes_breach()));
        }
        let file = super::scratch_file(scratch_dir)
            .map_err(|e| format!("cannot create a scratch file in {}: {e}", scratch_dir.display()))?;
        s.blob(&layer.digest, layer.size, &file, &limits).await?;
        let (to, cancel) = (dest.to_path_buf(), cancel.clone());
        let (done, used) = tokio::task::spawn_blocking(move || {
            let done = super::layers::extract(&file, &to, &cancel, &mut budget);
            (done, budget)
        })
        .await
        .map_err(|e| e.to_string())?;
        budget = used;
        done.map_err(|e| format!("extracting layer {}: {}", layer.digest, chain(&e)))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_are_parsed() {
        let (s, p) = parse_challenge(
            r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/ubuntu:pull""#,
        );
        assert_eq!(s, "bearer");
        assert_eq!(
            p,
            vec![
                ("realm".into(), "https://auth.docker.io/token".into()),
                ("service".into(), "registry.docker.io".into()),
                ("scope".into(), "repository:library/ubuntu:pull".into())
            ]
        );
        assert_eq!(parse_challenge(r#"Basic realm="x""#).0, "basic");
    }

    #[test]
    fn credentials_go_only_to_the_registry_or_named_hosts_and_never_downgraded() {
        let url = |u: &str| reqwest::Url::parse(u).unwrap();
        let named = ["auth.example".to_string(), "127.0.0.1:5001".to_string()];
        let ok = |base: &str, realm: &str| may_send_credentials(base, &url(realm), &named).is_ok();
        assert!(ok("https://reg.example", "https://reg.example/token"));
        assert!(ok("https://reg.example", "https://REG.example:443/token"));
        assert!(ok("http://127.0.0.1:5000", "http://127.0.0.1:5000/token"));
        assert!(ok("https://reg.example", "https://auth.example/token"), "named in the file");
        assert!(ok("http://127.0.0.1:5000", "http://127.0.0.1:5001/token"), "named with its port");
        assert!(ok("https://registry-1.docker.io", "https://auth.docker.io/token"));
        assert!(!ok("https://reg.example", "http://reg.example/token"), "https → http");
        assert!(!ok("https://reg.example", "http://auth.example/token"), "https → http, even named");
        assert!(!ok("https://reg.example", "https://evil.example/token"));
        assert!(!ok("https://reg.example", "https://reg.example:8443/token"), "another port");
        assert!(!ok("http://127.0.0.1:5000", "http://127.0.0.1:5002/token"));
        assert!(!ok("https://reg.example", "https://auth.example:444/token"), "named without that port");
        assert!(!ok("https://mirror.example", "https://auth.docker.io/token"), "Docker Hub's only");
    }
}
