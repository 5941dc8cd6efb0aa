//! Image references as container runtimes read them: `[registry/]repository[:tag][@digest]`, with
//! Docker Hub's defaults (`docker.io`, `library/`, `latest`).

/// A parsed image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// `docker.io`, `registry.example:5000`, `127.0.0.1:5000`…
    pub registry: String,
    /// `library/ubuntu`, `rancher/system-agent-installer-rke2`…
    pub repository: String,
    pub tag: Option<String>,
    /// `sha256:<64 hex>`.
    pub digest: Option<String>,
}

pub const DOCKER_HUB: &str = "docker.io";

pub use crate::redact_userinfo;

impl ImageRef {
    pub fn parse(raw: &str) -> Result<ImageRef, String> {
        let bad = |why: &str| format!("invalid image reference {:?}: {why}", redact_userinfo(raw));
        if raw.is_empty() || raw.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("empty or contains whitespace"));
        }
        let (rest, digest) = match raw.split_once('@') {
            Some((r, d)) => {
                if !is_sha256_digest(d) {
                    return Err(bad("the digest must be sha256:<64 lowercase hex digits>"));
                }
                (r, Some(d.to_string()))
            }
            None => (raw, None),
        };
        let last_slash = rest.rfind('/');
        let (name, tag) = match rest.rfind(':') {
            Some(i) if last_slash.is_none_or(|s| i > s) => (&rest[..i], Some(&rest[i + 1..])),
            _ => (rest, None),
        };
        if let Some(t) = tag
            && (t.is_empty()
                || t.len() > 128
                || t.starts_with(['.', '-'])
                || !t.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
        {
            return Err(bad("bad tag"));
        }
        let (registry, repository) = match name.split_once('/') {
            Some((first, path)) if first.contains(['.', ':']) || first == "localhost" => (first.to_string(), path),
            _ => (DOCKER_HUB.to_string(), name),
        };
        let registry = if registry == "index.docker.io" { DOCKER_HUB.to_string() } else { registry };
        let valid_component = |c: &str| {
            !c.is_empty()
                && c.chars().all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || matches!(ch, '.' | '_' | '-'))
                && c.starts_with(|ch: char| ch.is_ascii_alphanumeric())
        };
        if !repository.split('/').all(valid_component) {
            return Err(bad("the repository must be lowercase letters, digits and . _ - between slashes"));
        }
        let repository = if registry == DOCKER_HUB && !repository.contains('/') {
            format!("library/{repository}")
        } else {
            repository.to_string()
        };
        let tag = match (tag, &digest) {
            (Some(t), _) => Some(t.to_string()),
            (None, None) => Some("latest".to_string()),
            (None, Some(_)) => None,
        };
        Ok(ImageRef { registry, repository, tag, digest })
    }

    /// What to ask the registry for: the digest when there is one, else the tag.
    pub fn reference(&self) -> &str {
        self.digest.as_deref().or(self.tag.as_deref()).unwrap_or("latest")
    }

    /// The same image, named the same way (for matching the tags stored in image tarballs).
    pub fn same_image(&self, other: &ImageRef) -> bool {
        self.registry == other.registry
            && self.repository == other.repository
            && match (&self.digest, &other.digest) {
                (Some(a), Some(b)) => a == b,
                _ => self.tag == other.tag,
            }
    }
}

impl std::fmt::Display for ImageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

pub fn is_sha256_digest(d: &str) -> bool {
    d.strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_get_docker_hub_defaults() {
        let digest = format!("sha256:{}", "a".repeat(64));
        type Row<'a> = (&'a str, &'a str, &'a str, Option<&'a str>, Option<&'a str>);
        let rows: &[Row] = &[
            ("ubuntu", "docker.io", "library/ubuntu", Some("latest"), None),
            ("ubuntu:22.04", "docker.io", "library/ubuntu", Some("22.04"), None),
            (
                "rancher/system-agent-installer-rke2:v1.30.1-rke2r1",
                "docker.io",
                "rancher/system-agent-installer-rke2",
                Some("v1.30.1-rke2r1"),
                None,
            ),
            ("index.docker.io/rancher/x:1", "docker.io", "rancher/x", Some("1"), None),
            ("registry.example:5000/team/app", "registry.example:5000", "team/app", Some("latest"), None),
            ("localhost/app:dev", "localhost", "app", Some("dev"), None),
            ("127.0.0.1:5000/a/b:c", "127.0.0.1:5000", "a/b", Some("c"), None),
        ];
        for (raw, reg, repo, tag, dig) in rows {
            let r = ImageRef::parse(raw).unwrap();
            assert_eq!(
                (r.registry.as_str(), r.repository.as_str(), r.tag.as_deref(), r.digest.as_deref()),
                (*reg, *repo, *tag, *dig),
                "{raw}"
            );
        }
        let r = ImageRef::parse(&format!("quay.io/a/b@{digest}")).unwrap();
        assert_eq!((r.tag.as_deref(), r.reference()), (None, digest.as_str()));
        let r = ImageRef::parse(&format!("quay.io/a/b:1@{digest}")).unwrap();
        assert_eq!((r.tag.as_deref(), r.reference()), (Some("1"), digest.as_str()));
        assert!(ImageRef::parse("rancher/x:1").unwrap().same_image(&ImageRef::parse("docker.io/rancher/x:1").unwrap()));
        assert!(!ImageRef::parse("rancher/x:1").unwrap().same_image(&ImageRef::parse("rancher/x:2").unwrap()));
    }

    #[test]
    fn bad_references_name_the_problem() {
        for raw in ["", "Ubuntu", "a b", "x:", "x@sha256:zz", "reg.io//x", "x:-1", "reg.io/a/B:1"] {
            let e = ImageRef::parse(raw).unwrap_err();
            assert!(e.starts_with("invalid image reference"), "{raw}: {e}");
        }
    }

    #[test]
    fn a_password_in_a_reference_or_endpoint_is_never_shown() {
        let e = ImageRef::parse("puller:hunter2@reg.io/a/b:1").unwrap_err();
        assert!(!e.contains("hunter2") && e.contains("***@reg.io/a/b:1"), "{e}");
        assert_eq!(redact_userinfo("https://u:hunter2@mirror:5000/v2"), "https://***@mirror:5000/v2");
        let pinned = format!("busybox@sha256:{}", "a".repeat(64));
        assert_eq!(redact_userinfo(&pinned), pinned);
        assert_eq!(redact_userinfo("reg.io/a:1"), "reg.io/a:1");
    }
}
