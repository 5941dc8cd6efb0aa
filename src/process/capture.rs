//! Bounded output capture (head + tail with a marker line) and the line reader that feeds both the
//! capture and the caller's line sink.

use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncReadExt};

/// Which pipe a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// Where output lines go besides the capture (usually the log, with the caller's prefix).
pub trait LineSink: Send + Sync {
    fn line(&self, stream: Stream, line: &[u8]);
    /// When false the reader skips line splitting for the sink (the capture is still fed).
    fn enabled(&self) -> bool {
        true
    }
}

/// Logs every line at `level` as `[<prefix>:stdout]: <line>`, like system-agent (which logs at
/// info). The agent logs instruction output at debug; `nodeplan supervise` and `nodeplan apply`,
/// whose output is what their operator watches, at info.
pub struct LogSink {
    pub prefix: String,
    pub level: tracing::Level,
    /// What must not reach the log (the instruction's `env` values), line by line.
    pub mask: crate::plan::failure::Mask,
}

impl LineSink for LogSink {
    fn line(&self, stream: Stream, line: &[u8]) {
        let (prefix, stream) = (&self.prefix, stream.as_str());
        let line = self.mask.text(&String::from_utf8_lossy(line));
        match self.level {
            tracing::Level::ERROR => tracing::error!("[{prefix}:{stream}]: {line}"),
            tracing::Level::WARN => tracing::warn!("[{prefix}:{stream}]: {line}"),
            tracing::Level::INFO => tracing::info!("[{prefix}:{stream}]: {line}"),
            tracing::Level::DEBUG => tracing::debug!("[{prefix}:{stream}]: {line}"),
            _ => tracing::trace!("[{prefix}:{stream}]: {line}"),
        }
    }
    fn enabled(&self) -> bool {
        match self.level {
            tracing::Level::ERROR => tracing::enabled!(tracing::Level::ERROR),
            tracing::Level::WARN => tracing::enabled!(tracing::Level::WARN),
            tracing::Level::INFO => tracing::enabled!(tracing::Level::INFO),
            tracing::Level::DEBUG => tracing::enabled!(tracing::Level::DEBUG),
            _ => tracing::enabled!(tracing::Level::TRACE),
        }
    }
}

/// A sink that drops lines.
pub struct NullSink;

impl LineSink for NullSink {
    fn line(&self, _: Stream, _: &[u8]) {}
    fn enabled(&self) -> bool {
        false
    }
}

/// Keeps at most `limit` bytes: the first half and the last half of what was pushed; what was
/// dropped in between is replaced by one marker line saying how many bytes.
#[derive(Debug, Clone)]
pub struct Capture {
    head_cap: usize,
    tail_cap: usize,
    head: Vec<u8>,
    tail: Vec<u8>,
    total: u64,
}

impl Capture {
    pub fn new(limit: usize) -> Capture {
        let head_cap = limit / 2;
        Capture { head_cap, tail_cap: limit - head_cap, head: Vec::new(), tail: Vec::new(), total: 0 }
    }

    pub fn push(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.head.len() < self.head_cap {
            let n = (self.head_cap - self.head.len()).min(data.len());
            self.head.extend_from_slice(&data[..n]);
            data = &data[n..];
        }
        if data.is_empty() || self.tail_cap == 0 {
            return;
        }
        if data.len() >= self.tail_cap {
            self.tail.clear();
            self.tail.extend_from_slice(&data[data.len() - self.tail_cap..]);
            return;
        }
        self.tail.extend_from_slice(data);
        if self.tail.len() >= 2 * self.tail_cap {
            let excess = self.tail.len() - self.tail_cap;
            self.tail.drain(..excess);
        }
    }

    /// Total bytes pushed, kept or not.
    pub fn total(&self) -> u64 {
        self.total
    }

    pub fn finish(mut self) -> Vec<u8> {
        if self.tail.len() > self.tail_cap {
            let excess = self.tail.len() - self.tail_cap;
            self.tail.drain(..excess);
        }
        let kept = (self.head.len() + self.tail.len()) as u64;
        let dropped = self.total - kept;
        let mut out = self.head;
        if dropped > 0 {
            if out.last().is_some_and(|b| *b != b'\n') {
                out.push(b'\n');
            }
            out.extend_from_slice(format!("[nodeplan: {dropped} bytes of output dropped]\n").as_bytes());
        }
        out.extend_from_slice(&self.tail);
        out
    }
}

/// What a run produced on its pipes, each capped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Output {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// stdout and stderr interleaved line by line, as the process wrote them.
    pub combined: Vec<u8>,
}

/// The captures one run's two readers share.
pub(crate) struct Captures {
    pub stdout: Mutex<Capture>,
    pub stderr: Mutex<Capture>,
    pub combined: Mutex<Capture>,
}

impl Captures {
    pub fn new(limit: usize) -> Arc<Captures> {
        Arc::new(Captures {
            stdout: Mutex::new(Capture::new(limit)),
            stderr: Mutex::new(Capture::new(limit)),
            combined: Mutex::new(Capture::new(limit)),
        })
    }

    fn push(&self, stream: Stream, data: &[u8]) {
        let own = match stream {
            Stream::Stdout => &self.stdout,
            Stream::Stderr => &self.stderr,
        };
        if let Ok(mut c) = own.lock() {
            c.push(data);
        }
        if let Ok(mut c) = self.combined.lock() {
            c.push(data);
        }
    }

    pub fn take(&self) -> Output {
        let take = |m: &Mutex<Capture>| {
            m.lock().map(|mut c| std::mem::replace(&mut *c, Capture::new(0)).finish()).unwrap_or_default()
        };
        Output { stdout: take(&self.stdout), stderr: take(&self.stderr), combined: take(&self.combined) }
    }
}

/// Longest line handed to the sink in one piece; longer lines are split.
const MAX_LINE: usize = 64 * 1024;

/// Read a pipe to EOF, feeding whole lines to the captures and the sink. Lines (not raw chunks) are
/// the unit pushed to the combined capture, so stdout and stderr interleave line by line.
pub(crate) async fn read_lines<R: AsyncRead + Unpin>(
    mut pipe: R,
    stream: Stream,
    captures: Arc<Captures>,
    sink: Arc<dyn LineSink>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut pending: Vec<u8> = Vec::new();
    let sink_on = sink.enabled();
    loop {
        let n = match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &buf[..n];
        let Some(last_nl) = chunk.iter().rposition(|b| *b == b'\n') else {
            pending.extend_from_slice(chunk);
            if pending.len() >= MAX_LINE {
                flush(&mut pending, stream, &captures, &*sink, sink_on);
            }
            continue;
        };
        let (complete, rest) = chunk.split_at(last_nl + 1);
        if pending.is_empty() {
            captures.push(stream, complete);
            if sink_on {
                for line in complete[..complete.len() - 1].split(|b| *b == b'\n') {
                    sink.line(stream, line);
                }
            }
        } else {
            pending.extend_from_slice(complete);
            captures.push(stream, &pending);
            if sink_on {
                for line in pending[..pending.len() - 1].split(|b| *b == b'\n') {
                    sink.line(stream, line);
                }
            }
            pending.clear();
        }
        pending.extend_from_slice(rest);
    }
    flush(&mut pending, stream, &captures, &*sink, sink_on);
}

fn flush(pending: &mut Vec<u8>, stream: Stream, captures: &Captures, sink: &dyn LineSink, sink_on: bool) {
    if pending.is_empty() {
        return;
    }
    captures.push(stream, pending);
    if sink_on {
        sink.line(stream, pending);
    }
    pending.clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_output_is_kept_whole() {
        let mut c = Capture::new(16);
        c.push(b"hello\n");
        assert_eq!(c.finish(), b"hello\n");
    }

    #[test]
    fn large_output_keeps_head_and_tail_with_a_marker() {
        let mut c = Capture::new(10);
        for chunk in [&b"0123456789"[..], b"abcdefghij", b"KLMNOPQRST"] {
            c.push(chunk);
        }
        assert_eq!(c.total(), 30);
        assert_eq!(c.finish(), b"01234\n[nodeplan: 20 bytes of output dropped]\nPQRST".to_vec());
    }

    #[test]
    fn tail_is_exact_across_many_small_pushes() {
        let mut c = Capture::new(8);
        let data: Vec<u8> = (0..1000u32).map(|i| b'a' + (i % 26) as u8).collect();
        for b in &data {
            c.push(std::slice::from_ref(b));
        }
        let out = c.finish();
        assert!(out.starts_with(&data[..4]));
        assert!(out.ends_with(&data[996..]));
        assert!(String::from_utf8_lossy(&out).contains("992 bytes of output dropped"));
    }

    struct Lines(Mutex<Vec<(Stream, String)>>);
    impl LineSink for Lines {
        fn line(&self, s: Stream, l: &[u8]) {
            self.0.lock().unwrap().push((s, String::from_utf8_lossy(l).into_owned()));
        }
    }

    #[tokio::test]
    async fn reader_splits_lines_across_chunks_and_flushes_the_last_partial_line() {
        let (mut w, r) = tokio::io::duplex(8);
        let caps = Captures::new(1024);
        let sink = Arc::new(Lines(Mutex::new(Vec::new())));
        let task = tokio::spawn(read_lines(r, Stream::Stderr, caps.clone(), sink.clone()));
        use tokio::io::AsyncWriteExt;
        w.write_all(b"one\ntw").await.unwrap();
        w.write_all(b"o\nthree").await.unwrap();
        drop(w);
        task.await.unwrap();
        let lines: Vec<String> = sink.0.lock().unwrap().iter().map(|(_, l)| l.clone()).collect();
        assert_eq!(lines, ["one", "two", "three"]);
        let out = caps.take();
        assert_eq!(out.stderr, b"one\ntwo\nthree");
        assert_eq!(out.combined, b"one\ntwo\nthree");
        assert!(out.stdout.is_empty());
    }
}
