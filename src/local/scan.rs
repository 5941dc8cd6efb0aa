//! Which files of the plan directory are plans: `*.plan`, recursively, sorted by full path; dot
//! files are skipped, and so is any plan whose basename has a `<basename>.skip` anywhere in the tree.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

pub fn scan(dir: &Path) -> Vec<PathBuf> {
    let mut all = Vec::new();
    walk(dir, &mut all);
    all.sort();
    let skips: HashSet<String> =
        all.iter().filter_map(|p| p.file_name()?.to_str()?.strip_suffix(".skip").map(str::to_string)).collect();
    all.into_iter()
        .filter(|p| {
            let Some(name) = p.file_name().and_then(|n| n.to_str()) else { return false };
            name.ends_with(".plan") && !name.starts_with('.') && !skips.contains(name)
        })
        .collect()
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let path = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => walk(&path, out),
            Ok(t) if t.is_file() => out.push(path),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_plans_recursively_sorted_skipping_dot_files_and_skips() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path();
        std::fs::create_dir_all(p.join("b/c")).unwrap();
        for f in [
            "z.plan",
            "a.plan",
            ".hidden.plan",
            "b/c/deep.plan",
            "b/skipme.plan",
            "b/c/skipme.plan.skip",
            "notes.txt",
            "a.pos",
        ] {
            std::fs::write(p.join(f), b"{}").unwrap();
        }
        let got: Vec<String> =
            scan(p).iter().map(|x| x.strip_prefix(p).unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(got, ["a.plan", "b/c/deep.plan", "z.plan"]);
        assert!(scan(&p.join("missing")).is_empty());
    }
}
