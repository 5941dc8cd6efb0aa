//! Everything nodeplan writes to stderr: the one writer every log line, progress line and bar
//! frame goes through, colour choice, and the JSON line format.
//!
//! Writes never block the caller and never panic. Lines go into a bounded queue that one thread
//! writes out; the runtime thread (which also delivers signals) only ever queues. When stderr is a
//! full pipe nobody reads, the queue fills and further lines are dropped and counted (one line
//! says how many, once stderr moves again); when stderr is closed or broken, the thread stops
//! writing and lines are discarded. Either way SIGTERM and Ctrl-C keep working and the exit code
//! is the command's. [`flush`] gives the queue a bounded time to drain before the process exits.

use serde_json::{Map, Value};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// Chunks (lines, bar frames) that may wait for stderr before new ones are dropped.
const QUEUE_CHUNKS: usize = 8192;

struct Queue {
    tx: SyncSender<Vec<u8>>,
    /// Chunks dropped because the queue was full, not yet reported.
    dropped: AtomicU64,
    /// Chunks queued and chunks written (or discarded), for [`flush`].
    queued: AtomicU64,
    done: Mutex<u64>,
    progress: Condvar,
}

static QUEUE: OnceLock<Queue> = OnceLock::new();
static JSON: AtomicBool = AtomicBool::new(false);

fn queue() -> &'static Queue {
    QUEUE.get_or_init(|| {
        let (tx, rx) = sync_channel(QUEUE_CHUNKS);
        let q = Queue {
            tx,
            dropped: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            done: Mutex::new(0),
            progress: Condvar::new(),
        };
        // Without the thread (cannot happen in practice) nothing is written, which is still no
        // panic and no block.
        let _ = std::thread::Builder::new().name("stderr".into()).spawn(move || writer(rx));
        q
    })
}

/// Write all of `buf` to fd 2 (not through `std::io::stderr()`, whose lock a blocked write would
/// hold against everyone else). False once stderr is closed or broken.
#[cfg(unix)]
fn write_fd2(mut buf: &[u8]) -> bool {
    while !buf.is_empty() {
        // SAFETY: writes from a valid buffer to fd 2, which ensure_std_fds keeps open.
        let n = unsafe { libc::write(2, buf.as_ptr().cast(), buf.len()) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return false;
        }
        buf = buf.get(n as usize..).unwrap_or_default();
    }
    true
}

/// On Windows: standard error's handle, written by this thread alone (see [`queue`]).
#[cfg(windows)]
fn write_fd2(buf: &[u8]) -> bool {
    use std::io::Write as _;
    let mut e = std::io::stderr();
    e.write_all(buf).and_then(|()| e.flush()).is_ok()
}

fn writer(rx: Receiver<Vec<u8>>) {
    let mut ok = true;
    for chunk in rx {
        let q = queue();
        if ok {
            let dropped = q.dropped.swap(0, Ordering::Relaxed);
            if dropped > 0 {
                let note = format!("nodeplan: {dropped} log lines dropped: stderr was not being read\n");
                ok = write_fd2(note.as_bytes());
            }
            ok = ok && write_fd2(&chunk);
        }
        if let Ok(mut done) = q.done.lock() {
            *done += 1;
            q.progress.notify_all();
        }
    }
}

/// Queue bytes for stderr; never blocks, never fails.
pub(crate) fn write(bytes: &[u8]) {
    let q = queue();
    match q.tx.try_send(bytes.to_vec()) {
        Ok(()) => {
            q.queued.fetch_add(1, Ordering::Relaxed);
        }
        Err(TrySendError::Full(_)) => {
            q.dropped.fetch_add(1, Ordering::Relaxed);
        }
        Err(TrySendError::Disconnected(_)) => {}
    }
}

/// Wait up to `limit` for what was queued to be written out (before the process exits).
pub(crate) fn flush(limit: Duration) {
    let Some(q) = QUEUE.get() else { return };
    let target = q.queued.load(Ordering::Relaxed);
    let deadline = Instant::now() + limit;
    let Ok(mut done) = q.done.lock() else { return };
    while *done < target {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        match q.progress.wait_timeout(done, left) {
            Ok((d, _)) => done = d,
            Err(_) => return,
        }
    }
}

/// One line for a person, through the queue. In JSON mode it becomes an event at `level`, so
/// JSON output stays JSON.
pub(crate) fn line(level: tracing::Level, text: &str) {
    if JSON.load(Ordering::Relaxed) {
        match level {
            tracing::Level::ERROR => tracing::error!("{text}"),
            tracing::Level::WARN => tracing::warn!("{text}"),
            _ => tracing::info!("{text}"),
        }
    } else {
        let mut b = Vec::with_capacity(text.len() + 1);
        b.extend_from_slice(text.as_bytes());
        b.push(b'\n');
        around_progress(|| write(&b));
    }
}

/// Runs `f` with the progress bar (if any) cleared, so what `f` writes does not tear it.
fn around_progress(f: impl FnOnce()) {
    match super::PROGRESS.get() {
        Some(pb) => pb.suspend(f),
        None => f(),
    }
}

pub(crate) fn set_json(json: bool) {
    JSON.store(json, Ordering::Relaxed);
}

pub(crate) fn is_json() -> bool {
    JSON.load(Ordering::Relaxed)
}

/// stderr is a terminal.
pub(crate) fn stderr_is_terminal() -> bool {
    use std::io::IsTerminal as _;
    std::io::stderr().is_terminal()
}

/// `--color`.
#[derive(Copy, Clone, Debug, clap::ValueEnum, PartialEq, Eq)]
pub enum ColorChoice {
    /// Colour when stderr is a terminal and NO_COLOR is unset or empty.
    Auto,
    /// Always colour (even with NO_COLOR).
    Always,
    /// Never colour.
    Never,
}

/// Whether log lines get ANSI colour codes.
pub(crate) fn use_color(choice: ColorChoice, terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    match choice {
        ColorChoice::Always => true,
        ColorChoice::Never => false,
        ColorChoice::Auto => terminal && no_color.is_none_or(|v| v.is_empty()),
    }
}

/// The tracing writer: each formatted event is one queued chunk, written around the bar, and
/// stays one line: text from the outside world (a file name, a path, a value) may hold line
/// breaks, which would otherwise forge whole log lines, so every `\n` and `\r` but the line's own
/// end is written escaped (`\n`, `\r`), as are other control characters but ESC (which the
/// formatter already escapes in messages and uses for colour) and tab. JSON lines are escaped by
/// JSON itself.
pub(crate) struct LogWriter;

/// `buf` with every control character but tab, ESC and a final newline escaped.
pub(crate) fn one_line(buf: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let body = buf.strip_suffix(b"\n").unwrap_or(buf);
    let bad = |b: u8| (b < 0x20 && b != b'\t' && b != 0x1b) || b == 0x7f;
    if !body.iter().copied().any(bad) {
        return std::borrow::Cow::Borrowed(buf);
    }
    let mut out = Vec::with_capacity(buf.len() + 16);
    for &b in body {
        match b {
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b if bad(b) => out.extend_from_slice(format!("\\x{b:02x}").as_bytes()),
            b => out.push(b),
        }
    }
    if body.len() < buf.len() {
        out.push(b'\n');
    }
    std::borrow::Cow::Owned(out)
}

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let line = one_line(buf);
        around_progress(|| write(&line));
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The progress bar's terminal: the same queue, so bar frames and log lines stay in order.
#[derive(Debug)]
pub(crate) struct QueuedTerm;

/// Move the cursor `n` cells (`A` up, `B` down, `C` right, `D` left).
fn cursor(n: usize, direction: char) -> std::io::Result<()> {
    if n > 0 {
        write(format!("\x1b[{n}{direction}").as_bytes());
    }
    Ok(())
}

impl indicatif::TermLike for QueuedTerm {
    #[cfg(windows)]
    fn width(&self) -> u16 {
        80
    }
    #[cfg(unix)]
    fn width(&self) -> u16 {
        let mut ws = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
        // SAFETY: TIOCGWINSZ fills a winsize; fd 2 is open (ensure_std_fds).
        let ok = unsafe { libc::ioctl(2, libc::TIOCGWINSZ, &mut ws) } == 0;
        if ok && ws.ws_col > 0 { ws.ws_col } else { 80 }
    }
    fn move_cursor_up(&self, n: usize) -> std::io::Result<()> {
        cursor(n, 'A')
    }
    fn move_cursor_down(&self, n: usize) -> std::io::Result<()> {
        cursor(n, 'B')
    }
    fn move_cursor_right(&self, n: usize) -> std::io::Result<()> {
        cursor(n, 'C')
    }
    fn move_cursor_left(&self, n: usize) -> std::io::Result<()> {
        cursor(n, 'D')
    }
    fn write_line(&self, s: &str) -> std::io::Result<()> {
        write(format!("{s}\n").as_bytes());
        Ok(())
    }
    fn write_str(&self, s: &str) -> std::io::Result<()> {
        write(s.as_bytes());
        Ok(())
    }
    fn clear_line(&self) -> std::io::Result<()> {
        write(b"\r\x1b[2K");
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `--log-format text`: `TIMESTAMP LEVEL [plan] message fields`, one short prefix: the plan's
/// 12-character id when the line is about one (`--log-format json` has its source and the
/// instruction too), never the enclosing spans' names and fields (they made each line about 120
/// characters longer than what it says). The level is coloured when the writer takes colour.
pub(crate) struct TextLines;

impl<S, N> FormatEvent<S, N> for TextLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        let level = *event.metadata().level();
        let colour = match level {
            tracing::Level::ERROR => "31",
            tracing::Level::WARN => "33",
            tracing::Level::INFO => "32",
            tracing::Level::DEBUG => "34",
            tracing::Level::TRACE => "35",
        };
        if w.has_ansi_escapes() {
            write!(w, "{now} \x1b[{colour}m{:>5}\x1b[0m ", level.as_str())?;
        } else {
            write!(w, "{now} {:>5} ", level.as_str())?;
        }
        let plan = ctx.event_scope().and_then(|scope| {
            scope.from_root().find(|s| s.name() == "plan").and_then(|s| {
                let ext = s.extensions();
                let fields = ext.get::<FormattedFields<N>>()?;
                let id = fields.split_whitespace().find_map(|f| f.strip_prefix("id="))?;
                Some(id.trim_matches('"').to_string())
            })
        });
        if let Some(id) = plan {
            write!(w, "[{id}] ")?;
        }
        ctx.format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// `--log-format json`: one JSON object per line, built as a map so no key can appear twice:
/// `timestamp`, `level`, `message`, the event's own fields, and `span`, an object with one
/// object per enclosing span by span name (`{"plan": {"id": …, "source": …}, "instruction":
/// {"i": 1, "n": 3, "name": …}}`). An event field named like a reserved key is kept as
/// `field.<name>`.
pub(crate) struct JsonLines;

const RESERVED: [&str; 3] = ["timestamp", "level", "span"];

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let mut obj = Map::new();
        obj.insert("timestamp".into(), chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true).into());
        obj.insert("level".into(), event.metadata().level().as_str().into());
        let mut fields = FieldMap(Map::new());
        event.record(&mut fields);
        for (k, v) in fields.0 {
            let key = if RESERVED.contains(&k.as_str()) { format!("field.{k}") } else { k };
            obj.insert(key, v);
        }
        if let Some(scope) = ctx.event_scope() {
            let mut spans = Map::new();
            for span in scope.from_root() {
                let ext = span.extensions();
                let v = ext
                    .get::<FormattedFields<N>>()
                    .and_then(|f| serde_json::from_str::<Value>(f).ok())
                    .filter(Value::is_object)
                    .unwrap_or_else(|| Value::Object(Map::new()));
                spans.insert(span.name().to_string(), v);
            }
            if !spans.is_empty() {
                obj.insert("span".into(), Value::Object(spans));
            }
        }
        writeln!(w, "{}", Value::Object(obj))
    }
}

/// An event's fields as JSON values.
struct FieldMap(Map<String, Value>);

impl Visit for FieldMap {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().into(), format!("{value:?}").into());
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0.insert(field.name().into(), crate::error_line(value).into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_line_stays_one_line() {
        assert_eq!(&*one_line(b"plain \x1b[1mbold\tok\n"), b"plain \x1b[1mbold\tok\n");
        assert_eq!(&*one_line(b"a\nFORGED\r\x07\n"), b"a\\nFORGED\\r\\x07\n");
        assert_eq!(&*one_line(b"no end\nhere"), b"no end\\nhere");
    }

    #[test]
    fn colour_choice() {
        let set = Some(std::ffi::OsStr::new("1"));
        let empty = Some(std::ffi::OsStr::new(""));
        assert!(use_color(ColorChoice::Auto, true, None));
        assert!(use_color(ColorChoice::Auto, true, empty), "an empty NO_COLOR is unset");
        assert!(!use_color(ColorChoice::Auto, true, set));
        assert!(!use_color(ColorChoice::Auto, false, None));
        assert!(use_color(ColorChoice::Always, false, set));
        assert!(!use_color(ColorChoice::Never, true, None));
    }
}
