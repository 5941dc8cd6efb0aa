//! The release artifacts `tools/package.sh` builds into `target/package/`: the stripped binary and
//! its split debug file, the `.deb` and the `.rpm`. `tools/test.sh` runs `tools/package.sh` once
//! before the tests (a release build takes minutes, so the tests only read what it made); without
//! the artifacts a test skips loudly, and fails when `NODEPLAN_CI` is set.
//!
//! Everything is checked with the tools a distribution would use (`dpkg-deb`, `lintian`, `rpm`,
//! `readelf`, `addr2line`, `systemd-analyze`), and whatever the packages hold that the binary
//! generates (completions, man page, `--version`) is compared with what the packaged binary
//! generates itself.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The files both packages install besides the packager's own (copyright, changelog, licence)
/// and their modes, with the zsh completion's directory left to each distribution.
fn shipped(zsh_dir: &str) -> Vec<(String, u32)> {
    [
        ("/usr/bin/nodeplan", 0o755),
        ("/usr/lib/systemd/system/nodeplan.service", 0o644),
        ("/usr/lib/systemd/system/nodeplan.service.d/10-packaged-binary.conf", 0o644),
        ("/usr/share/bash-completion/completions/nodeplan", 0o644),
        (&format!("{zsh_dir}/_nodeplan"), 0o644),
        ("/usr/share/fish/vendor_completions.d/nodeplan.fish", 0o644),
        ("/usr/share/man/man1/nodeplan.1.gz", 0o644),
    ]
    .into_iter()
    .map(|(p, m)| (p.to_string(), m))
    .collect()
}

const DEB_ZSH: &str = "/usr/share/zsh/vendor-completions";
const RPM_ZSH: &str = "/usr/share/zsh/site-functions";

/// What `tools/package.sh` left in `target/package/`.
struct Artifacts {
    dir: PathBuf,
    deb: PathBuf,
    rpm: PathBuf,
}

/// The artifacts, or `None` (a loud skip) outside CI when they have not been built.
fn artifacts() -> Option<Artifacts> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/package");
    let find = |ext: &str| -> Option<PathBuf> {
        let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == ext))
            .collect();
        assert!(found.len() <= 1, "more than one .{ext} in {}: {found:?}", dir.display());
        found.pop()
    };
    let (deb, rpm) = (find("deb"), find("rpm"));
    let built =
        deb.is_some() && rpm.is_some() && dir.join("nodeplan").is_file() && dir.join("nodeplan.debug").is_file();
    if !common::require(built, "the packages of tools/package.sh in target/package (run tools/package.sh)") {
        return None;
    }
    Some(Artifacts { deb: deb?, rpm: rpm?, dir })
}

/// Runs a tool that must succeed and returns its stdout.
fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?}: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn run_bytes(cmd: &Path, args: &[&str]) -> Vec<u8> {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{}: {e}", cmd.display()));
    assert!(out.status.success(), "{} {args:?}: {}", cmd.display(), String::from_utf8_lossy(&out.stderr));
    out.stdout
}

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// The `.deb` unpacked into a fresh temporary directory.
fn unpack_deb(a: &Artifacts) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    run("dpkg-deb", &["-x", s(&a.deb), s(root.path())]);
    root
}

/// Every regular file of the `.deb` with its mode (from `dpkg-deb -c`).
fn deb_files(a: &Artifacts) -> BTreeMap<String, u32> {
    run("dpkg-deb", &["-c", s(&a.deb)])
        .lines()
        .filter(|l| l.starts_with('-'))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let path = f.last().unwrap().trim_start_matches('.').to_string();
            (path, mode_of(f[0]))
        })
        .collect()
}

/// `-rwxr-xr-x` → 0o755.
fn mode_of(perm: &str) -> u32 {
    perm.chars().skip(1).take(9).fold(0, |m, c| (m << 1) | u32::from(c != '-'))
}

/// Every file of the `.rpm` from `rpm -qp --dump`: path → (mode bits, SHA-256).
fn rpm_files(a: &Artifacts) -> BTreeMap<String, (u32, String)> {
    run("rpm", &["-qp", "--dump", s(&a.rpm)])
        .lines()
        .map(|l| {
            // path size mtime digest mode owner group isconfig isdoc rdev symlink
            let f: Vec<&str> = l.split_whitespace().collect();
            let mode = u32::from_str_radix(f[4], 8).unwrap_or_else(|e| panic!("{l}: {e}"));
            (f[0].to_string(), (mode & 0o7777, f[3].to_string()))
        })
        .collect()
}

fn sha256(path: &Path) -> String {
    run("sha256sum", &[s(path)]).split_whitespace().next().unwrap().to_string()
}

fn gunzip(path: &Path) -> Vec<u8> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap()).read_to_end(&mut out).unwrap();
    out
}

/// The commit this checkout is at, as `nodeplan --version` shows it; `None` outside git.
fn head_commit() -> Option<String> {
    let out = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
fn deb_holds_the_binary_unit_drop_in_completions_man_page_and_copyright() {
    let Some(a) = artifacts() else { return };
    let files = deb_files(&a);
    let mut want: BTreeMap<String, u32> = shipped(DEB_ZSH).into_iter().collect();
    for doc in ["copyright", "changelog.Debian.gz"] {
        want.insert(format!("/usr/share/doc/nodeplan/{doc}"), 0o644);
    }
    want.insert("/usr/share/lintian/overrides/nodeplan".into(), 0o644);
    assert_eq!(files, want, "dpkg-deb -c {}", a.deb.display());

    let info = run("dpkg-deb", &["-I", s(&a.deb)]);
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.trim_start().strip_prefix(&format!("{name}: ")).map(str::to_string))
            .unwrap_or_else(|| panic!("no {name} in dpkg-deb -I:\n{info}"))
    };
    assert_eq!(field("Package"), "nodeplan");
    assert_eq!(field("Version"), format!("{}-1", env!("CARGO_PKG_VERSION")));
    assert_eq!(field("Section"), "admin");
    assert_eq!(field("Priority"), "optional");
    assert!(field("Depends").contains("libc6"), "Depends: {}", field("Depends"));
    assert!(field("Description").starts_with("Node agent that applies plans"), "{info}");
    // The unit is installed, never enabled or started: the agent has no config yet.
    assert!(!info.contains("conffiles"), "nothing of the package is a conffile:\n{info}");
    let root = tempfile::tempdir().unwrap();
    run("dpkg-deb", &["-e", s(&a.deb), s(root.path())]);
    for script in ["postinst", "postrm"] {
        let text = std::fs::read_to_string(root.path().join(script)).unwrap();
        let code: String = text.lines().filter(|l| !l.trim_start().starts_with('#')).collect::<Vec<_>>().join("\n");
        assert!(code.contains("systemctl --system daemon-reload"), "{script}:\n{text}");
        for verb in ["enable", "start", "restart", "deb-systemd-invoke"] {
            assert!(!code.contains(verb), "{script} must not {verb} the agent:\n{text}");
        }
    }
    assert!(!root.path().join("preinst").exists() && !root.path().join("prerm").exists());

    // The copyright file names the licence and where Debian keeps its text.
    let unpacked = unpack_deb(&a);
    let copyright = std::fs::read_to_string(unpacked.path().join("usr/share/doc/nodeplan/copyright")).unwrap();
    assert!(copyright.contains("License: Apache-2.0"), "{copyright}");
    assert!(copyright.contains("/usr/share/common-licenses/Apache-2.0"), "{copyright}");
}

#[test]
fn lintian_finds_no_error_in_the_deb() {
    let Some(a) = artifacts() else { return };
    // The verdict without --show-overrides (with it, lintian fails on overridden errors too).
    let out = Command::new("lintian")
        .args(["--display-info", "--fail-on", "error", s(&a.deb)])
        .output()
        .expect("lintian (Debian package lintian; tools/test.sh installs it)");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("lintian:\n{text}{}", String::from_utf8_lossy(&out.stderr));
    let errors: Vec<&str> = text.lines().filter(|l| l.starts_with("E: ")).collect();
    assert!(errors.is_empty() && out.status.success(), "lintian errors ({}):\n{}", out.status, errors.join("\n"));
    // Every override the package ships is used, and matches what it overrides.
    for tag in ["unused-override", "mismatched-override"] {
        assert!(!text.contains(tag), "{tag}: update packaging/lintian-overrides\n{text}");
    }
    // The overrides shipped are the justified ones in the repository, each with its reason.
    let shipped = std::fs::read_to_string(unpack_deb(&a).path().join("usr/share/lintian/overrides/nodeplan")).unwrap();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/lintian-overrides");
    assert_eq!(shipped, std::fs::read_to_string(repo).unwrap());
    let lines: Vec<&str> = shipped.lines().collect();
    for (i, line) in lines.iter().enumerate().filter(|(_, l)| l.starts_with("nodeplan:")) {
        assert!(i > 0 && lines[i - 1].starts_with('#'), "override without a comment above saying why: {line}");
    }
}

#[test]
fn rpm_holds_the_same_files_with_the_same_content_as_the_deb() {
    let Some(a) = artifacts() else { return };
    let files = rpm_files(&a);
    let listed: Vec<String> = run("rpm", &["-qlp", s(&a.rpm)]).lines().map(str::to_string).collect();
    assert_eq!(listed, files.keys().cloned().collect::<Vec<_>>(), "rpm -qlp and rpm -qp --dump agree");

    let mut want: BTreeMap<String, u32> = shipped(RPM_ZSH).into_iter().collect();
    want.insert("/usr/share/licenses/nodeplan/LICENSE".into(), 0o644);
    let modes: BTreeMap<String, u32> = files.iter().map(|(p, (m, _))| (p.clone(), *m)).collect();
    assert_eq!(modes, want, "rpm -qp --dump {}", a.rpm.display());

    // Byte for byte what the .deb holds (the same binary, unit and generated files).
    let deb = unpack_deb(&a);
    for (path, _) in shipped(RPM_ZSH) {
        let in_deb = deb.path().join(path.trim_start_matches('/').replace(&RPM_ZSH[1..], &DEB_ZSH[1..]));
        assert_eq!(files[&path].1, sha256(&in_deb), "{path} differs between the .rpm and the .deb");
    }
    let license = Path::new(env!("CARGO_MANIFEST_DIR")).join("LICENSE");
    assert_eq!(files["/usr/share/licenses/nodeplan/LICENSE"].1, sha256(&license));

    let info = run("rpm", &["-qip", s(&a.rpm)]);
    for want in [
        "Name        : nodeplan".to_string(),
        format!("Version     : {}", env!("CARGO_PKG_VERSION")),
        "Release     : 1".to_string(),
        "License     : Apache-2.0".to_string(),
        "URL         : https://github.com/nodeplan/nodeplan".to_string(),
    ] {
        assert!(info.lines().any(|l| l.trim_end() == want), "no {want:?} in rpm -qip:\n{info}");
    }
    let requires = run("rpm", &["-qp", "--requires", s(&a.rpm)]);
    assert!(requires.lines().any(|l| l.starts_with("libc.so.6")), "rpm -qp --requires:\n{requires}");
    let docs = run("rpm", &["-qdp", s(&a.rpm)]);
    assert!(docs.contains("/usr/share/man/man1/nodeplan.1.gz"), "the man page is documentation:\n{docs}");
    assert!(run("rpm", &["-qcp", s(&a.rpm)]).trim().is_empty(), "nothing of the package is a config file");
    let scripts = run("rpm", &["-qp", "--scripts", s(&a.rpm)]);
    assert!(scripts.contains("postinstall scriptlet") && scripts.contains("postuninstall scriptlet"), "{scripts}");
    assert_eq!(scripts.matches("systemctl daemon-reload").count(), 2, "{scripts}");
    for verb in ["enable", "start", "preset"] {
        assert!(!scripts.contains(verb), "the scriptlets must not {verb} the agent:\n{scripts}");
    }
}

#[test]
fn packaged_binary_names_the_commit_and_generates_what_the_package_holds() {
    let Some(a) = artifacts() else { return };
    let root = unpack_deb(&a);
    let bin = root.path().join("usr/bin/nodeplan");
    let version = String::from_utf8(run_bytes(&bin, &["--version"])).unwrap();
    let built = version
        .trim_end()
        .strip_prefix(&format!("nodeplan {} (commit ", env!("CARGO_PKG_VERSION")))
        .and_then(|r| r.split_once(", "))
        .map(|(c, _)| c.trim_end_matches("-dirty").to_string())
        .unwrap_or_else(|| panic!("packaged --version: {version}"));
    // In CI tools/package.sh has just built them from this checkout; a developer's may be older.
    if let Some(head) = head_commit() {
        let what =
            format!("packages built from this commit ({head}; target/package has {built}: run tools/package.sh)");
        if built != head && !common::in_ci() {
            eprintln!("\n*** NOT CHECKED: {what} ***\n");
        } else {
            assert_eq!(built, head, "{what}");
        }
    }
    // The Debian changelog names the same commit.
    let changelog = gunzip(&root.path().join("usr/share/doc/nodeplan/changelog.Debian.gz"));
    assert!(String::from_utf8_lossy(&changelog).contains(&format!("built from commit {built}")));

    for (shell, file) in [
        ("bash", "usr/share/bash-completion/completions/nodeplan"),
        ("zsh", "usr/share/zsh/vendor-completions/_nodeplan"),
        ("fish", "usr/share/fish/vendor_completions.d/nodeplan.fish"),
    ] {
        let packaged = std::fs::read(root.path().join(file)).unwrap();
        assert!(!packaged.is_empty(), "{file} is empty");
        assert!(
            packaged == run_bytes(&bin, &["completions", shell]),
            "{file} is not what `nodeplan completions {shell}` prints"
        );
    }
    let man = gunzip(&root.path().join("usr/share/man/man1/nodeplan.1.gz"));
    assert!(man == run_bytes(&bin, &["man"]), "the packaged man page is not what `nodeplan man` prints");
    let rendered =
        run("man", &["--warnings", "-l", "-Tutf8", s(&root.path().join("usr/share/man/man1/nodeplan.1.gz"))]);
    assert!(rendered.contains("nodeplan") && rendered.contains("supervise"), "{rendered}");
}

#[test]
fn the_binary_is_stripped_and_its_debug_file_symbolizes_it() {
    let Some(a) = artifacts() else { return };
    let bin = a.dir.join("nodeplan");
    let debug = a.dir.join("nodeplan.debug");
    // The packaged binary is this one.
    let deb = unpack_deb(&a);
    assert_eq!(sha256(&deb.path().join("usr/bin/nodeplan")), sha256(&bin));

    let sections = run("readelf", &["-S", "-W", s(&bin)]);
    for gone in [".debug_info", ".debug_line", ".symtab", ".strtab"] {
        assert!(!sections.contains(&format!(" {gone} ")), "{gone} left in the stripped binary:\n{sections}");
    }
    let link = run("readelf", &["-p", ".gnu_debuglink", s(&bin)]);
    assert!(link.contains("nodeplan.debug"), "no .gnu_debuglink to nodeplan.debug:\n{link}");
    let debug_sections = run("readelf", &["-S", "-W", s(&debug)]);
    for kept in [".debug_line", ".symtab"] {
        assert!(debug_sections.contains(&format!(" {kept} ")), "{kept} missing from nodeplan.debug");
    }
    // Both carry the same build id (how debuginfod and /usr/lib/debug/.build-id find the file).
    let build_id = |p: &Path| {
        run("readelf", &["-n", s(p)])
            .lines()
            .find_map(|l| l.trim().strip_prefix("Build ID: ").map(str::to_string))
            .unwrap_or_else(|| panic!("no build id in {}", p.display()))
    };
    assert_eq!(build_id(&bin), build_id(&debug));

    // An address in `main.rs`'s `main`, from the debug file's symbol table, resolves to a file and
    // line when addr2line is given only the stripped binary: it follows .gnu_debuglink beside it.
    let symbols = run("nm", &["--defined-only", "-C", s(&debug)]);
    let addr = symbols
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            let (addr, kind, name) = (f.next()?, f.next()?, f.collect::<Vec<_>>().join(" "));
            (matches!(kind, "t" | "T") && name.starts_with("nodeplan::main")).then(|| addr.to_string())
        })
        .unwrap_or_else(|| panic!("no nodeplan::main in the debug file's symbols"));
    let stripped_alone = tempfile::tempdir().unwrap();
    std::fs::copy(&bin, stripped_alone.path().join("nodeplan")).unwrap();
    let lonely = run("addr2line", &["-e", s(&stripped_alone.path().join("nodeplan")), &format!("0x{addr}")]);
    assert!(lonely.starts_with("??"), "without the debug file nothing resolves: {lonely}");
    let line = run("addr2line", &["-f", "-C", "-e", s(&bin), &format!("0x{addr}")]);
    assert!(line.contains("src/main.rs:"), "0x{addr} did not resolve through nodeplan.debug: {line}");
}

/// `2.28` → (2, 28); anything unreadable sorts above every real version.
fn version(v: &str) -> (u32, u32) {
    let mut n = v.trim().split('.').map(|x| x.parse::<u32>().unwrap_or(u32::MAX));
    (n.next().unwrap_or(u32::MAX), n.next().unwrap_or(0))
}

#[test]
fn the_packaged_binary_runs_on_glibc_2_28() {
    let Some(a) = artifacts() else { return };
    // RHEL 8 has glibc 2.28 and SLES 15 2.31: the binary may need nothing newer.
    let table = run("objdump", &["-T", s(&a.dir.join("nodeplan"))]);
    let needed: std::collections::BTreeSet<(u32, u32)> = table
        .split(|c: char| c.is_whitespace() || c == '(' || c == ')')
        .filter_map(|w| w.strip_prefix("GLIBC_"))
        .filter(|v| *v != "PRIVATE")
        .map(version)
        .collect();
    let newest = needed.last().copied().expect("glibc symbol versions in objdump -T: a dynamic binary");
    assert!(newest <= (2, 28), "the binary needs GLIBC_{}.{} ({needed:?})", newest.0, newest.1);
    // The packages' dependencies say the same.
    let requires = run("rpm", &["-qp", "--requires", s(&a.rpm)]);
    for line in requires.lines().filter_map(|l| l.strip_prefix("libc.so.6(GLIBC_")) {
        assert!(version(line.trim_end_matches(")(64bit)")) <= (2, 28), "the .rpm requires GLIBC_{line}");
    }
    let depends = run("dpkg-deb", &["-f", s(&a.deb), "Depends"]);
    let libc = depends
        .split(',')
        .map(str::trim)
        .find_map(|d| d.strip_prefix("libc6 (>= "))
        .unwrap_or_else(|| panic!("no versioned libc6 in Depends: {depends}"));
    assert!(version(libc.trim_end_matches(')')) <= (2, 28), "the .deb depends on libc6 (>= {libc}");
}

#[test]
fn the_packaged_unit_and_drop_in_start_the_packaged_binary() {
    let Some(a) = artifacts() else { return };
    let root = unpack_deb(&a);
    // The unit shipped is the repository's, unchanged.
    let unit = root.path().join("usr/lib/systemd/system/nodeplan.service");
    let repo_unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/nodeplan.service");
    assert_eq!(std::fs::read(&unit).unwrap(), std::fs::read(repo_unit).unwrap());
    // systemd's own parser on the unpacked package, given the host's targets the unit names:
    // the unit and its drop-in load, and the binary the service would start exists inside the
    // package (without the drop-in it would be /usr/local/bin/nodeplan, which is not there).
    let units = root.path().join("usr/lib/systemd/system");
    let host_units = ["/usr/lib/systemd/system", "/lib/systemd/system"]
        .into_iter()
        .find(|d| Path::new(d).join("multi-user.target").exists())
        .expect("systemd's units (Debian package systemd; tools/test.sh installs it)");
    for e in std::fs::read_dir(host_units).unwrap().filter_map(Result::ok) {
        if e.path().extension().is_some_and(|x| x == "target") {
            std::fs::copy(e.path(), units.join(e.file_name())).unwrap();
        }
    }
    let out = Command::new("systemd-analyze")
        .args(["verify", &format!("--root={}", s(root.path())), "nodeplan.service"])
        .output()
        .expect("systemd-analyze (Debian package systemd; tools/test.sh installs it)");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && said.trim().is_empty(), "systemd-analyze verify: {}\n{said}", out.status);
    let cat = run(
        "systemd-analyze",
        &["cat-config", &format!("--root={}", s(root.path())), "systemd/system/nodeplan.service"],
    );
    assert!(cat.contains("nodeplan.service.d/10-packaged-binary.conf"), "{cat}");
    // The drop-in comes last, clears the unit's ExecStart and sets its own.
    let exec: Vec<&str> = cat.lines().filter(|l| l.starts_with("ExecStart=")).collect();
    assert!(exec.ends_with(&["ExecStart=", "ExecStart=/usr/bin/nodeplan agent"]), "{cat}");
}
