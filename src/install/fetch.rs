//! The exchange with the Rancher server that yields the connection info, as system-agent's
//! installer does it:
//!
//! 1. With `CATTLE_CA_CHECKSUM`: `GET /cacerts` without verifying the server (nothing secret is
//!    sent: no token, no header), and the body's SHA-256, over the bytes as served, must equal the
//!    checksum. From then on that CA is the only one trusted. Without a checksum the system's
//!    roots are trusted.
//! 2. `GET /v3/connect/agent` with `Authorization: Bearer <token>` and the `X-Cattle-*` headers;
//!    the answer must be the connection info (`kubeConfig`, `namespace`, `secretName`), checked as
//!    `nodeplan validate-connection` checks a file.
//!
//! Any answer but 200 (and any transport error) is retried, a bounded number of times with a
//! fixed interval, each retry logged with its reason. A CA that does not match is not retried,
//! and neither is a redirect: no redirect is ever followed (a 3xx is an error naming its
//! `Location`; nothing is sent there). The kubeconfig's credential plugins are refused, never run.
//! URLs in messages have their userinfo masked ([`shown_url`]).
//!
//! Owns the HTTP side only; it must not write anything.

use super::settings::{Rancher, shown_url};
use crate::config::ConnectionInfo;
pub use crate::remote::client::Plugins;
use std::time::Duration;

/// Answers larger than this are refused (a connection info is a few KiB).
pub const MAX_ANSWER: usize = crate::config::MAX_FILE_BYTES as usize;

/// How the exchange is bounded.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Retries after the first attempt.
    pub retries: u32,
    pub interval: Duration,
    /// Each request's time limit.
    pub timeout: Duration,
}

/// Whether the CA served (`body`, as served) hashes to `want` (lowercase hex).
pub fn check_ca(body: &[u8], want: &str) -> Result<(), String> {
    let got = super::sha256_hex(body);
    if got == want {
        Ok(())
    } else {
        Err(format!(
            "the server's /cacerts has SHA-256 {got}, but CATTLE_CA_CHECKSUM is {want}: refusing to trust it (nothing was sent to the server)"
        ))
    }
}

/// The headers of `/v3/connect/agent`, in order (the token first).
pub fn connect_headers(r: &Rancher, id: &str, node_name: Option<&str>) -> Vec<(&'static str, String)> {
    let mut h = vec![
        ("Authorization", format!("Bearer {}", r.token)),
        ("X-Cattle-Id", id.to_string()),
        ("X-Cattle-Role-Etcd", r.roles.etcd.to_string()),
        ("X-Cattle-Role-Control-Plane", r.roles.control_plane.to_string()),
        ("X-Cattle-Role-Worker", r.roles.worker.to_string()),
        ("X-Cattle-Labels", r.labels.clone()),
        ("X-Cattle-Taints", r.taints.clone()),
    ];
    if let Some(n) = node_name {
        h.push(("X-Cattle-Node-Name", n.to_string()));
    }
    if !r.address.is_empty() {
        h.push(("X-Cattle-Address", r.address.clone()));
    }
    if !r.internal_address.is_empty() {
        h.push(("X-Cattle-Internal-Address", r.internal_address.clone()));
    }
    h
}

/// The connection info in an answer: JSON with the three keys non-empty and a kubeconfig that
/// parses. Never quotes the answer (it holds credentials).
pub fn parse_connection(body: &[u8]) -> Result<ConnectionInfo, String> {
    let c: ConnectionInfo = serde_json::from_slice(body)
        .map_err(|e| format!("the answer is not connection info JSON ({})", crate::config::json_location(&e)))?;
    for (k, v) in [("kubeConfig", &c.kube_config), ("namespace", &c.namespace), ("secretName", &c.secret_name)] {
        if v.is_empty() {
            return Err(format!("the answer's {k} is missing or empty"));
        }
    }
    if let Err(e) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(&c.kube_config) {
        return Err(format!("the answer's kubeConfig is not YAML ({})", crate::config::yaml_location(&e)));
    }
    Ok(c)
}

/// The connection info checked the way `nodeplan validate-connection` checks a file: besides
/// [`parse_connection`]'s checks, the kubeconfig must make a client (contexts, credentials, TLS),
/// and nothing in it is run. A user with an `exec` or `auth-provider` plugin is refused with
/// [`Plugins::Refuse`] (the answer of a server), left unrun with [`Plugins::NotRun`].
pub async fn check_client(c: &ConnectionInfo, plugins: Plugins) -> Result<Option<String>, String> {
    crate::remote::client::check_kubeconfig_yaml(&c.kube_config, plugins)
        .await
        .map_err(|e| format!("the answer's kubeConfig: {e}"))
}

/// Fetch the connection info from the Rancher server.
pub async fn connection_info(
    r: &Rancher,
    id: &str,
    node_name: Option<&str>,
    b: Bounds,
) -> Result<ConnectionInfo, String> {
    // No redirect is followed: a 3xx is an error naming where it pointed, and nothing (the token
    // least of all) is sent there.
    let builder = || {
        reqwest::Client::builder()
            .timeout(b.timeout)
            .connect_timeout(b.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .https_only(true)
    };
    let client = match &r.ca_checksum {
        Some(want) => {
            let insecure = builder()
                .danger_accept_invalid_certs(true)
                .build()
                .map_err(|e| format!("cannot make an HTTP client: {}", crate::error_line(&e)))?;
            let url = format!("{}/cacerts", r.server);
            let ca = get(&insecure, &url, &[], b).await?;
            check_ca(&ca, want)?;
            let certs = reqwest::Certificate::from_pem_bundle(&ca)
                .map_err(|e| format!("the server's /cacerts is not PEM: {}", crate::error_line(&e)))?;
            if certs.is_empty() {
                return Err("the server's /cacerts holds no certificate".into());
            }
            let mut only = builder().tls_built_in_root_certs(false);
            for c in certs {
                only = only.add_root_certificate(c);
            }
            only.build().map_err(|e| format!("cannot make an HTTP client: {}", crate::error_line(&e)))?
        }
        None => builder().build().map_err(|e| format!("cannot make an HTTP client: {}", crate::error_line(&e)))?,
    };
    let url = format!("{}/v3/connect/agent", r.server);
    let headers = connect_headers(r, id, node_name);
    let body = get(&client, &url, &headers, b).await.map_err(|e| match &r.ca_checksum {
        // Rancher's own CA is in no system store: its registration command passes its checksum.
        None if e.contains("UnknownIssuer") || e.contains("invalid peer certificate") => format!(
            "{e}: the server's certificate is not signed by a CA this machine trusts; set CATTLE_CA_CHECKSUM \
             to the SHA-256 of the server's /cacerts (Rancher's registration command has it)"
        ),
        _ => e,
    })?;
    let shown = shown_url(&url);
    let c = parse_connection(&body).map_err(|e| format!("GET {shown}: {e}"))?;
    check_client(&c, Plugins::Refuse).await.map_err(|e| format!("GET {shown}: {e}"))?;
    Ok(c)
}

/// GET `url` until it answers 200 (at most `b.retries` retries), returning the body.
async fn get(client: &reqwest::Client, url: &str, headers: &[(&str, String)], b: Bounds) -> Result<Vec<u8>, String> {
    let shown = shown_url(url);
    let mut attempt = 0u32;
    loop {
        let why = match once(client, url, headers).await {
            Ok(body) => return Ok(body),
            Err(Fail::Final(why)) => return Err(format!("GET {shown}: {why}")),
            Err(Fail::Retry(why)) => why,
        };
        if attempt >= b.retries {
            return Err(format!("GET {shown}: {why} (gave up after {})", crate::count(attempt as usize + 1, "attempt")));
        }
        attempt += 1;
        tracing::warn!("GET {shown}: {why}; retry {attempt}/{} in {}", b.retries, crate::duration::show(b.interval));
        tokio::time::sleep(b.interval).await;
    }
}

/// Why one request failed: worth another attempt, or not (a redirect stays one).
enum Fail {
    Retry(String),
    Final(String),
}

async fn once(client: &reqwest::Client, url: &str, headers: &[(&str, String)]) -> Result<Vec<u8>, Fail> {
    let mut req = client.get(url);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    // The URL is left out of reqwest's message: it may hold CATTLE_SERVER's userinfo.
    let mut resp = req.send().await.map_err(|e| Fail::Retry(crate::error_line(&e.without_url())))?;
    let status = resp.status();
    if status.is_redirection() {
        let to = match resp.headers().get(reqwest::header::LOCATION).map(|l| l.to_str()) {
            Some(Ok(l)) => shown_url(l),
            Some(Err(_)) => "a Location that is not text".to_string(),
            None => "no Location".to_string(),
        };
        return Err(Fail::Final(format!(
            "answered HTTP {status} to {}: redirects are not followed (nothing was sent there); \
             set CATTLE_SERVER to the server's own https:// address",
            crate::quoted(&to)
        )));
    }
    if status != reqwest::StatusCode::OK {
        let hint = match status.as_u16() {
            401 | 403 => " (is CATTLE_TOKEN right?)",
            _ => "",
        };
        return Err(Fail::Retry(format!("answered HTTP {status}{hint}")));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| Fail::Retry(crate::error_line(&e.without_url())))? {
        if body.len() + chunk.len() > MAX_ANSWER {
            return Err(Fail::Retry(format!("the answer is larger than {MAX_ANSWER} bytes")));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::super::settings::Roles;
    use super::*;

    #[test]
    fn ca_check() {
        let pem = b"-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----\n";
        let sum = crate::install::sha256_hex(pem);
        assert!(check_ca(pem, &sum).is_ok());
        let e = check_ca(b"other", &sum).unwrap_err();
        assert!(e.contains(&sum) && e.contains("refusing"), "{e}");
    }

    #[test]
    fn headers_carry_every_setting() {
        let r = Rancher {
            server: "https://r".into(),
            token: "tok".into(),
            ca_checksum: None,
            id: None,
            roles: Roles { etcd: true, control_plane: false, worker: true },
            labels: "a=b".into(),
            taints: "t=v:NoSchedule".into(),
            address: String::new(),
            internal_address: "10.0.0.1".into(),
        };
        let h = connect_headers(&r, "ID", Some("node1"));
        let get = |k: &str| h.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("Authorization"), Some("Bearer tok"));
        assert_eq!(get("X-Cattle-Id"), Some("ID"));
        assert_eq!(get("X-Cattle-Role-Etcd"), Some("true"));
        assert_eq!(get("X-Cattle-Role-Control-Plane"), Some("false"));
        assert_eq!(get("X-Cattle-Role-Worker"), Some("true"));
        assert_eq!(get("X-Cattle-Labels"), Some("a=b"));
        assert_eq!(get("X-Cattle-Taints"), Some("t=v:NoSchedule"));
        assert_eq!(get("X-Cattle-Node-Name"), Some("node1"));
        assert_eq!(get("X-Cattle-Address"), None);
        assert_eq!(get("X-Cattle-Internal-Address"), Some("10.0.0.1"));
    }

    #[test]
    fn connection_answers() {
        let ok = br#"{"kubeConfig":"apiVersion: v1\nkind: Config\n","namespace":"fleet","secretName":"s","extra":1}"#;
        let c = parse_connection(ok).unwrap();
        assert_eq!((c.namespace.as_str(), c.secret_name.as_str()), ("fleet", "s"));
        let bad: &[(&[u8], &str)] = &[
            (b"<html>secret-token</html>", "not connection info JSON"),
            (br#"{"kubeConfig":"","namespace":"n","secretName":"s"}"#, "kubeConfig is missing"),
            (br#"{"kubeConfig":"a: [","namespace":"n","secretName":"s"}"#, "not YAML"),
            (br#"{"kubeConfig":"a: b","namespace":"n"}"#, "not connection info JSON"),
        ];
        for (body, want) in bad {
            let e = parse_connection(body).unwrap_err();
            assert!(e.contains(want) && !e.contains("secret-token"), "{e}");
        }
    }
}
