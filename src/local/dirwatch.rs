//! Change notification for the plan directory: inotify on the directory and every directory below
//! it that the scan walks (root's, not writable by group or others: another user's directories get
//! no watch; SECURITY.md, "Local mode"), delivered on the runtime (no thread of its own), with a mask of changes only. Opens and
//! reads are not watched, so the agent's own rescans never wake it, and the agent's own `.pos`
//! writes (and dot-files such as their temp files) are not reported.

use futures::StreamExt;
use inotify::{EventMask, Inotify, WatchMask, Watches};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokio::sync::mpsc::UnboundedSender;

fn mask() -> WatchMask {
    WatchMask::CREATE
        | WatchMask::DELETE
        | WatchMask::CLOSE_WRITE
        | WatchMask::ATTRIB
        | WatchMask::MOVED_FROM
        | WatchMask::MOVED_TO
        | WatchMask::DELETE_SELF
        | WatchMask::MOVE_SELF
}

/// Watch `dir` and the directories below it that the scan walks: only directories that pass
/// [`super::trust::dir`] (another user's directory gets no watch, so it can neither use up root's
/// `max_user_watches` nor wake the agent), within the scan's bounds.
fn add_tree(watches: &mut Watches, dirs: &mut HashMap<inotify::WatchDescriptor, PathBuf>, dir: &Path) {
    let trusted = |m: &std::fs::Metadata| m.is_dir() && super::trust::dir(m).is_ok();
    if !std::fs::metadata(dir).is_ok_and(|m| trusted(&m)) {
        return;
    }
    let mut budget = super::scan::MAX_ENTRIES;
    let mut stack = vec![(dir.to_path_buf(), 0)];
    while let Some((d, depth)) = stack.pop() {
        match watches.add(&d, mask() | WatchMask::ONLYDIR) {
            Ok(wd) => {
                dirs.insert(wd, d.clone());
            }
            Err(e) => {
                tracing::debug!("cannot watch {}: {e}", d.display());
                continue;
            }
        }
        if depth >= super::scan::MAX_DEPTH {
            continue;
        }
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            if budget == 0 {
                return;
            }
            budget -= 1;
            // DirEntry's metadata does not follow a link.
            let dot = e.file_name().as_encoded_bytes().starts_with(b".");
            if !dot && e.metadata().is_ok_and(|m| trusted(&m)) {
                stack.push((e.path(), depth + 1));
            }
        }
    }
}

/// Start watching `dir`; every changed path (not `.pos` files, not dot-files) is sent on `tx`.
/// The task ends when `dir` itself goes away.
pub fn start(dir: &Path, tx: UnboundedSender<PathBuf>) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let inotify = Inotify::init()?;
    let mut watches = inotify.watches();
    let mut dirs = HashMap::new();
    let root_wd = watches.add(dir, mask() | WatchMask::ONLYDIR)?;
    add_tree(&mut watches, &mut dirs, dir);
    let mut events = inotify.into_event_stream([0u8; 4096])?;
    let root = dir.to_path_buf();
    Ok(tokio::spawn(async move {
        while let Some(ev) = events.next().await {
            let ev = match ev {
                Ok(ev) => ev,
                Err(e) => {
                    tracing::warn!("watching {}: {e}; relying on the periodic rescan", root.display());
                    return;
                }
            };
            if ev.mask.contains(EventMask::Q_OVERFLOW) {
                // Events were lost: let the loop rescan everything.
                let _ = tx.send(root.clone());
                continue;
            }
            if ev.mask.contains(EventMask::IGNORED) {
                dirs.remove(&ev.wd);
                if ev.wd == root_wd {
                    // The plan directory itself was removed or moved: end, so that the agent
                    // watches it again once it exists (and rescan meanwhile).
                    let _ = tx.send(root.clone());
                    return;
                }
                continue;
            }
            let Some(base) = dirs.get(&ev.wd).cloned() else { continue };
            let path = match &ev.name {
                Some(n) => base.join(n),
                None => base.clone(),
            };
            if ev.mask.contains(EventMask::ISDIR) && ev.mask.intersects(EventMask::CREATE | EventMask::MOVED_TO) {
                add_tree(&mut watches, &mut dirs, &path);
            }
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            if name.ends_with(".pos") || name.starts_with('.') {
                continue;
            }
            if tx.send(path).is_err() {
                return;
            }
        }
    }))
}
