//! What made a plan fail, as an operator reads it: the failing one-time instruction (its number,
//! name and outcome: exit status, signal, timeout) or the files, and the last lines of what it
//! printed, bounded and masked. One value, stored by every source beside its plan state (the `.pos`
//! field `lastFailure`, the Secret key `failure`, the NodePlan's `status.failure`) and shown by
//! `plan status`, `plan logs`, the Event's note, the NodePlan's condition, the fleet table and
//! rollouts. Pure: it reads and formats, it writes nothing.
//!
//! Masking: the values of the instruction's own `env` (of [`MASK_MIN`] characters or more) are
//! replaced by `***` wherever they appear, and so is the password of a `user:password@` in a URL;
//! control characters are escaped where a line is shown ([`shown_line`]). A command that prints a
//! secret of its own making on failure still shows it (SECURITY.md).

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
        let secrets: Vec<&str> = env.iter().filter_map(|e| e.split_once('=')).map(|(_, v)| v).collect();
        Failure {
            checksum: checksum.to_string(),
            instruction: Some(index + 1),
            total,
            name: name.to_string(),
            outcome,
            last_lines: tail(output, LINES).iter().map(|l| mask(l, &secrets)).collect(),
        }
    }

    /// The plan's files could not be written.
    pub fn files(checksum: &str, total: usize, error: &str) -> Failure {
        Failure {
            checksum: checksum.to_string(),
            instruction: None,
            total,
            name: String::new(),
            outcome: mask(error, &[]),
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

/// The last `n` lines of `output` (a final newline ends the last line, it does not start an empty
/// one), each cut to [`LINE_CHARS`] characters.
pub fn tail(output: &[u8], n: usize) -> Vec<String> {
    let text = String::from_utf8_lossy(output);
    let text = text.strip_suffix('\n').unwrap_or(&text);
    if text.is_empty() {
        return Vec::new();
    }
    let mut lines: Vec<String> =
        text.rsplit('\n').take(n).map(|l| cut(l.strip_suffix('\r').unwrap_or(l), LINE_CHARS)).collect();
    lines.reverse();
    lines
}

/// `line` with every value of `secrets` ([`MASK_MIN`] characters or more) and every URL's
/// `user:password@` replaced by `***`.
pub fn mask(line: &str, secrets: &[&str]) -> String {
    let mut out = line.to_string();
    for s in secrets.iter().filter(|s| s.chars().count() >= MASK_MIN) {
        out = out.replace(s, "***");
    }
    if !out.contains('@') {
        return out;
    }
    out.split(' ').map(crate::redact_userinfo).collect::<Vec<_>>().join(" ")
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
            assert_eq!(tail(out, n), want, "{:?}", String::from_utf8_lossy(out));
        }
    }
}
