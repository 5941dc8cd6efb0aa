//! What made a plan fail, as an operator reads it: the failing one-time instruction (its number,
//! name and outcome: exit status, signal, timeout) or the files, and the last lines of what it
//! printed, bounded and masked. One value, stored by every source beside its plan state (the `.pos`
//! field `lastFailure`, the Secret key `failure`, the NodePlan's `status.failure`) and shown by
//! `plan status`, `plan logs`, the Event's note, the NodePlan's condition, the fleet table and
//! rollouts. Pure: it reads and formats, it writes nothing.
//!
//! Masking ([`Mask`], the one function every place that shows instruction output uses): the values
//! of the instruction's own `env` (of [`MASK_MIN`] characters or more), and each line of a value
//! of several lines, are replaced by `***` wherever they appear, overlapping ones as one, and so is
//! the password of a `user:password@` in a URL. Output is masked whole before it is split into
//! lines or cut, so neither a cut nor a line break lets part of a value through. Control
//! characters are escaped where a line is shown ([`shown_line`]). A command that prints a secret
//! of its own making on failure still shows it (SECURITY.md).

use serde::{Deserialize, Serialize};

/// Lines of a failed instruction's output kept with its failure.
pub const LINES: usize = 10;
/// Characters of one such line kept, at most (the rest is cut with `…`).
pub const LINE_CHARS: usize = 512;
/// Lines of output in a one-line note (an Event, a condition, a table cell).
const NOTE_LINES: usize = 3;
/// Characters of a one-line note, at most.
const NOTE_CHARS: usize = 600;
/// Env values shorter than this are not masked (they would mask every `1` or `yes` in the output).
pub const MASK_MIN: usize = 4;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Failure {
    /// The plan (its checksum) that failed: a reader shows a failure only for that plan.
    pub checksum: String,
    /// The failing one-time instruction, numbered from 1; `None` when the plan's files could not
    /// be written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instruction: Option<usize>,
    /// One-time instructions in the plan.
    #[serde(default)]
    pub total: usize,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// How it ended: `exit status 3`, `signal 9 (SIGKILL)`, `timed out after 10s: …`, or the
    /// files' error.
    pub outcome: String,
    /// The last lines of its output, masked, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub last_lines: Vec<String>,
}

impl Failure {
    /// A one-time instruction (`index` from 0) that failed with `outcome` after printing `output`;
    /// `env` is the instruction's own (`KEY=VALUE`), whose values are masked.
    pub fn instruction(
        checksum: &str,
        index: usize,
        total: usize,
        name: &str,
        outcome: String,
        output: &[u8],
        env: &[String],
    ) -> Failure {
        Failure {
            checksum: checksum.to_string(),
            instruction: Some(index + 1),
            total,
            name: name.to_string(),
            outcome,
            last_lines: Mask::of_env(env).tail(output, LINES),
        }
    }

    /// The plan's files could not be written.
    pub fn files(checksum: &str, total: usize, error: &str) -> Failure {
        Failure {
            checksum: checksum.to_string(),
            instruction: None,
            total,
            name: String::new(),
            outcome: Mask::default().text(error),
            last_lines: Vec::new(),
        }
    }

    /// A failure read back from a place others may write (a Secret, a NodePlan's status, a
    /// `.pos` file): cut to what this module writes, so a forged one cannot flood a terminal.
    pub fn bounded(mut self) -> Failure {
        let extra = self.last_lines.len().saturating_sub(LINES);
        self.last_lines.drain(..extra);
        for l in &mut self.last_lines {
            *l = cut(l, LINE_CHARS);
        }
        self.name = cut(&self.name, 253);
        self.outcome = cut(&self.outcome, LINE_CHARS);
        self
    }

    /// `instruction 2/3 install: exit status 3`, or `files: …`; one line, escaped.
    pub fn summary(&self) -> String {
        let s = match self.instruction {
            Some(n) => {
                let name = if self.name.is_empty() { "unnamed" } else { &self.name };
                format!("instruction {n}/{} {name}: {}", self.total, self.outcome)
            }
            None => format!("files: {}", self.outcome),
        };
        shown_line(&s)
    }

    /// [`summary`](Self::summary) and the last few lines of output, on one bounded line: the note
    /// of an Event, a NodePlan condition, a fleet table's cell.
    pub fn note(&self) -> String {
        let mut s = self.summary();
        let start = self.last_lines.len().saturating_sub(NOTE_LINES);
        let lines: Vec<String> = self.last_lines[start..].iter().map(|l| shown_line(l)).collect();
        if !lines.is_empty() {
            s.push_str("; last output: ");
            s.push_str(&lines.join(" | "));
        }
        cut(&s, NOTE_CHARS)
    }

    /// What `plan status` prints of it, aligned as its other lines: the summary, then the output
    /// lines, each after `| `.
    pub fn status_lines(&self) -> Vec<String> {
        let mut out = vec![format!("{:<12}{}", "failure:", self.summary())];
        out.extend(self.last_lines.iter().map(|l| format!("{:<12}| {}", "", shown_line(l))));
        out
    }
}

/// What must not be shown of what an instruction printed: the values of its own `env`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mask {
    /// Each value and each line of a value of several lines, of [`MASK_MIN`] characters or more,
    /// longest first.
    values: Vec<String>,
}

impl Mask {
    /// The mask of an instruction's `env` (`KEY=VALUE`).
    pub fn of_env(env: &[String]) -> Mask {
        Mask::of_values(env.iter().filter_map(|e| e.split_once('=')).map(|(_, v)| v))
    }

    pub fn of_values<'a>(values: impl IntoIterator<Item = &'a str>) -> Mask {
        let mut all: Vec<String> = Vec::new();
        for v in values {
            all.push(v.to_string());
            if v.contains('\n') {
                all.extend(v.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l).to_string()));
            }
        }
        all.retain(|v| v.chars().count() >= MASK_MIN);
        all.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        all.dedup();
        Mask { values: all }
    }

    /// `text` with every occurrence of a value replaced by `***` (occurrences that overlap or touch
    /// as one), and every URL's `user:password@` by `***@`.
    pub fn text(&self, text: &str) -> String {
        let mut spans: Vec<(usize, usize)> = Vec::new();
        for v in &self.values {
            let mut from = 0;
            while let Some(i) = text[from..].find(v.as_str()) {
                let at = from + i;
                spans.push((at, at + v.len()));
                // Overlapping occurrences too: the next search starts one character on.
                from = at + text[at..].chars().next().map_or(1, char::len_utf8);
            }
        }
        spans.sort_unstable();
        let mut out = String::with_capacity(text.len());
        let (mut pos, mut i) = (0, 0);
        while i < spans.len() {
            let (start, mut end) = spans[i];
            i += 1;
            while i < spans.len() && spans[i].0 <= end {
                end = end.max(spans[i].1);
                i += 1;
            }
            out.push_str(&text[pos..start]);
            out.push_str("***");
            pos = end;
        }
        out.push_str(&text[pos..]);
        if !out.contains('@') {
            return out;
        }
        let line = |l: &str| l.split(' ').map(crate::redact_userinfo).collect::<Vec<_>>().join(" ");
        out.split('\n').map(line).collect::<Vec<_>>().join("\n")
    }

    /// The last `n` lines of `output` (a final newline ends the last line, it does not start an
    /// empty one), masked as a whole, then each cut to [`LINE_CHARS`] characters.
    pub fn tail(&self, output: &[u8], n: usize) -> Vec<String> {
        let text = String::from_utf8_lossy(output);
        let text = text.strip_suffix('\n').unwrap_or(&text);
        if text.is_empty() || n == 0 {
            return Vec::new();
        }
        // The last n lines, whole: where the (n+1)th newline from the end is.
        let start = text.rmatch_indices('\n').nth(n - 1).map_or(0, |(i, _)| i + 1);
        let masked = self.text(&text[start..]);
        masked.split('\n').map(|l| cut(l.strip_suffix('\r').unwrap_or(l), LINE_CHARS)).collect()
    }

    /// `output` as lines, masked as a whole (nothing cut): what `plan logs` shows of it.
    pub fn lines(&self, output: &[u8]) -> Vec<String> {
        let text = String::from_utf8_lossy(output);
        let text = text.strip_suffix('\n').unwrap_or(&text);
        if text.is_empty() {
            return Vec::new();
        }
        self.text(text).split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l).to_string()).collect()
    }
}

/// A line as a terminal or a one-line note shows it: control characters escaped.
pub fn shown_line(line: &str) -> String {
    shown(line, usize::MAX)
}

/// `s` on one line for a terminal: control characters escaped, cut to `max` characters (`…`
/// marks the cut). For text others wrote (an object's values, a process's output).
pub fn shown(s: &str, max: usize) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == max {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// An instruction's name as people read it: `unnamed` when it has none.
pub fn display_name(name: &str) -> &str {
    if name.is_empty() { "unnamed" } else { name }
}

/// `s` cut to `max` characters, with `…` when cut.
fn cut(s: &str, max: usize) -> String {
    if s.chars().count() > max { s.chars().take(max).chain(std::iter::once('…')).collect() } else { s.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boom(output: &str, env: &[&str]) -> Failure {
        let env: Vec<String> = env.iter().map(|s| s.to_string()).collect();
        Failure::instruction("c0ffee", 1, 3, "boom", "exit status 3".into(), output.as_bytes(), &env)
    }

    #[test]
    fn the_failing_instruction_is_named_with_its_outcome_and_last_lines() {
        let f = boom("one\ntwo\nthree\nfour\n", &[]);
        assert_eq!(f.summary(), "instruction 2/3 boom: exit status 3");
        assert_eq!(f.last_lines, ["one", "two", "three", "four"]);
        assert_eq!(f.note(), "instruction 2/3 boom: exit status 3; last output: two | three | four");
        let quiet = boom("", &[]);
        assert_eq!(quiet.note(), "instruction 2/3 boom: exit status 3");
        let files = Failure::files("c0ffee", 2, "/etc/x: permission denied");
        assert_eq!(files.summary(), "files: /etc/x: permission denied");
        assert_eq!(
            boom("a\nb\n", &[]).status_lines(),
            ["failure:    instruction 2/3 boom: exit status 3", "            | a", "            | b"]
        );
    }

    #[test]
    fn output_is_bounded_to_the_last_lines_each_cut() {
        let many: String = (1..=30).map(|i| format!("line {i}\n")).collect();
        let f = boom(&many, &[]);
        assert_eq!(f.last_lines.len(), LINES);
        assert_eq!(f.last_lines[0], "line 21");
        assert_eq!(f.last_lines[LINES - 1], "line 30");
        let long = "x".repeat(LINE_CHARS + 10);
        let f = boom(&long, &[]);
        assert_eq!(f.last_lines[0].chars().count(), LINE_CHARS + 1);
        assert!(f.last_lines[0].ends_with('…'));
        assert!(boom(&"y\n".repeat(5000), &[]).note().chars().count() <= NOTE_CHARS + 1);
    }

    #[test]
    fn env_values_and_url_passwords_are_masked_control_characters_escaped() {
        let f = boom(
            "token s3cr3t-value rejected\nfetch https://admin:hunter22@reg.example/x failed\nok=1\n\x1b[31mred\n",
            &["TOKEN=s3cr3t-value", "FLAG=1"],
        );
        assert_eq!(f.last_lines[0], "token *** rejected");
        assert_eq!(f.last_lines[1], "fetch https://***@reg.example/x failed");
        assert_eq!(f.last_lines[2], "ok=1", "values shorter than MASK_MIN are left alone");
        assert!(f.note().contains("\\u{1b}[31mred"), "{}", f.note());
        assert!(!f.note().contains('\x1b'));
        let forged =
            Failure { last_lines: vec!["z".repeat(5000); 100], name: "n\nx".into(), ..boom("", &[]) }.bounded();
        assert_eq!(forged.last_lines.len(), LINES);
        assert!(forged.last_lines.iter().all(|l| l.chars().count() <= LINE_CHARS + 1));
        assert_eq!(forged.summary(), "instruction 2/3 n\\nx: exit status 3");
    }

    #[test]
    fn a_value_is_masked_whole_longest_first_before_the_output_is_cut_and_line_by_line() {
        // A short value inside a longer one: the longer is masked whole.
        let f = boom("login failed: password Zk5432Lm9Qw on 5432\n", &["PGPORT=5432", "PW=Zk5432Lm9Qw"]);
        assert_eq!(f.last_lines, ["login failed: password *** on ***"]);
        // A long token after a long prefix: masked before the line is cut.
        let token = "T0K3N".repeat(120);
        let f = boom(&format!("{}{token}\n", "x".repeat(500)), &[&format!("TOKEN={token}")]);
        assert_eq!(f.last_lines, [format!("{}***", "x".repeat(500))]);
        // A value of several lines: the whole, and each of its lines wherever it shows.
        let key = "-----BEGIN K-----\nAAAABBBBCCCC\nDDDDEEEE\n-----END K-----";
        let f = boom(&format!("{key}\nonly DDDDEEEE here\n"), &[&format!("KEY={key}")]);
        assert_eq!(f.last_lines, ["***", "only *** here"]);
        // Values that overlap are masked as one.
        let m = Mask::of_values(["abcdef1234", "1234xyzabc"]);
        assert_eq!(m.text("<abcdef1234xyzabc>"), "<***>");
        // A value masked across the last lines kept, and an overlapping occurrence of itself.
        assert_eq!(Mask::of_values(["aaaa"]).text("aaaaa b"), "*** b");
        assert_eq!(Mask::of_values(["secret-1"]).tail(b"one\nsecret-1\ntwo\n", 2), ["***", "two"]);
        assert_eq!(Mask::default().tail(b"a\nb\n", 0), Vec::<String>::new());
    }

    #[test]
    fn the_wire_form_is_camel_case_and_omits_what_is_empty() {
        let f = boom("out\n", &[]);
        let v = serde_json::to_value(&f).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"checksum": "c0ffee", "instruction": 2, "total": 3, "name": "boom",
                "outcome": "exit status 3", "lastLines": ["out"]})
        );
        let files: Failure = serde_json::from_value(serde_json::json!({"checksum": "c", "outcome": "e"})).unwrap();
        assert_eq!(files.instruction, None);
        assert_eq!(serde_json::from_value::<Failure>(v).unwrap(), f);
    }

    #[test]
    fn a_failures_output_tail_is_its_last_lines() {
        let long = "x".repeat(600);
        let cases: [(&[u8], usize, Vec<String>); 6] = [
            (b"", 10, vec![]),
            (b"\n", 10, vec![]),
            (b"a\nb\nc\n", 2, vec!["b".into(), "c".into()]),
            (b"a\r\nb", 10, vec!["a".into(), "b".into()]),
            (b"only", 10, vec!["only".into()]),
            (long.as_bytes(), 1, vec![format!("{}…", "x".repeat(512))]),
        ];
        for (out, n, want) in cases {
            assert_eq!(Mask::default().tail(out, n), want, "{:?}", String::from_utf8_lossy(out));
        }
    }
}
