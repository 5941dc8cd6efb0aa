//! What a process belongs to ([`Owner`]): kept in its PID record, which recovery reads back to
//! tell whose leftover a record is, and naming an owner's lock ([`super::owner_lock`]).

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// Who starts processes: a plan source, or `nodeplan supervise`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// The local agent; plans are identified by their path.
    Local,
    /// The remote agent; plans are identified by their checksum.
    Remote,
    /// `nodeplan apply`; plans are identified by their checksum.
    Apply,
    /// `nodeplan supervise`; services are identified by their name, and have no slots.
    Supervise,
    /// The NodePlan agent; plans are identified by `namespace/name`.
    NodePlan,
}

impl Source {
    const ALL: [Source; 5] = [Source::Local, Source::Remote, Source::Apply, Source::Supervise, Source::NodePlan];

    /// The owner prefix: `local`, `remote`, `apply` or `supervise`.
    pub fn prefix(self) -> &'static str {
        match self {
            Source::Local => "local",
            Source::Remote => "remote",
            Source::Apply => "apply",
            Source::Supervise => "supervise",
            Source::NodePlan => "nodeplan",
        }
    }

    /// Its processes run instructions of plans (and their owners carry a [`Slot`]).
    fn runs_plans(self) -> bool {
        self != Source::Supervise
    }

    /// Whether `id` can be read back from an owner string of this source.
    fn valid_id(self, id: &str) -> bool {
        match self {
            Source::Local => !id.is_empty(),
            Source::Remote | Source::Apply | Source::NodePlan => !id.is_empty() && !id.contains(':'),
            Source::Supervise => true,
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.prefix())
    }
}

/// Which instruction of a plan a process runs: `3` (one-time instruction 3) or `p3` (periodic
/// instruction 3), both counted from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Slot {
    OneTime(usize),
    Periodic(usize),
}

impl Slot {
    pub fn new(index: usize, periodic: bool) -> Slot {
        if periodic { Slot::Periodic(index) } else { Slot::OneTime(index) }
    }
}

impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Slot::OneTime(i) => write!(f, "{i}"),
            Slot::Periodic(i) => write!(f, "p{i}"),
        }
    }
}

impl FromStr for Slot {
    type Err = ();

    /// The canonical form only (`0`, `12`, `p3`; not `03` or `+3`), so that it displays back as
    /// it was read.
    fn from_str(s: &str) -> Result<Slot, ()> {
        let (digits, periodic) = match s.strip_prefix('p') {
            Some(d) => (d, true),
            None => (s, false),
        };
        let canonical = !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
            && (digits == "0" || !digits.starts_with('0'));
        if !canonical {
            return Err(());
        }
        digits.parse().map(|i| Slot::new(i, periodic)).map_err(drop)
    }
}

/// What a process belongs to: a source, the plan (or service) it runs for, and for an
/// instruction of a plan its [`Slot`].
///
/// On disk an owner is one string, `<source>:<id>`, then `:<slot>` for an instruction of a plan:
///
/// | owner                                     | written by                                          |
/// |-------------------------------------------|-----------------------------------------------------|
/// | `local:/var/lib/…/plans/a.plan:0`         | the local agent: plan path, one-time instruction 0  |
/// | `remote:<checksum>:p1`                    | the remote agent: plan checksum, periodic instruction 1 |
/// | `apply:<checksum>:3`, lock `apply:<checksum>` | `nodeplan apply`                                |
/// | `supervise:<name>` (record and lock)      | `nodeplan supervise`                                |
///
/// `Display` writes exactly these strings and `FromStr` reads them back, so the records of earlier
/// builds are recovered. A plan's id never ends in something that reads as a slot (checksums hold
/// no `:`, local plan paths end in `.plan`), and a service's name is never split. Text that is no
/// such owner (a foreign or hand-edited record) is kept verbatim as an *unknown* owner: it belongs
/// to the source its prefix names, if any, but to no plan of it, so a caller holds that whole
/// source, as for any record it cannot place. Reading never fails.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Owner(Repr);

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Repr {
    Known {
        source: Source,
        id: String,
        slot: Option<Slot>,
    },
    /// Text that is no owner this build writes, kept verbatim.
    Unknown(String),
}

impl Default for Repr {
    fn default() -> Repr {
        Repr::Unknown(String::new())
    }
}

impl Owner {
    /// The plan (or service) `id` of `source`, without a slot. `id` is kept as given: a caller
    /// passes what the source identifies its plans by (see [`Source`]).
    pub fn new(source: Source, id: impl Into<String>) -> Owner {
        Owner(Repr::Known { source, id: id.into(), slot: None })
    }

    /// A local plan, by its path (as `Path::display` shows it).
    pub fn local(plan: &Path) -> Owner {
        Owner::new(Source::Local, plan.display().to_string())
    }

    /// A remote plan, by its checksum.
    pub fn remote(checksum: &str) -> Owner {
        Owner::new(Source::Remote, checksum)
    }

    /// A plan run by `nodeplan apply`, by its checksum.
    pub fn apply(checksum: &str) -> Owner {
        Owner::new(Source::Apply, checksum)
    }

    /// A service run by `nodeplan supervise`, by its name.
    pub fn supervise(name: &str) -> Owner {
        Owner::new(Source::Supervise, name)
    }

    /// The owner of one instruction of this plan (what the applyinator gives each process). An
    /// unknown owner gets `:<slot>` appended to its text.
    pub fn with_slot(&self, slot: Slot) -> Owner {
        match &self.0 {
            Repr::Known { source, id, .. } => Owner(Repr::Known { source: *source, id: id.clone(), slot: Some(slot) }),
            Repr::Unknown(raw) => Owner(Repr::Unknown(format!("{raw}:{slot}"))),
        }
    }

    /// The source, also for an unknown owner whose text starts with a source's prefix and `:`.
    pub fn source(&self) -> Option<Source> {
        match &self.0 {
            Repr::Known { source, .. } => Some(*source),
            Repr::Unknown(raw) => {
                let prefix = raw.split_once(':')?.0;
                Source::ALL.into_iter().find(|s| s.prefix() == prefix)
            }
        }
    }

    /// The plan's id (a local plan's path as text, a checksum) or the service's name; `None` for
    /// an unknown owner, whose plan cannot be told.
    pub fn id(&self) -> Option<&str> {
        match &self.0 {
            Repr::Known { id, .. } => Some(id),
            Repr::Unknown(_) => None,
        }
    }

    /// The instruction, for the owner of one.
    pub fn slot(&self) -> Option<Slot> {
        match &self.0 {
            Repr::Known { slot, .. } => *slot,
            Repr::Unknown(_) => None,
        }
    }

    /// Whether it was read as an owner this build writes (not an unknown one).
    pub fn is_known(&self) -> bool {
        matches!(self.0, Repr::Known { .. })
    }

    /// Whether it belongs to `source` (an unknown owner too, when its prefix names `source`).
    pub fn belongs_to(&self, source: Source) -> bool {
        self.source() == Some(source)
    }

    /// Whether it belongs to the plan (or service) `plan` names: same source and id, whatever
    /// either's slot. Never for an unknown owner.
    pub fn belongs_to_plan(&self, plan: &Owner) -> bool {
        match (&self.0, &plan.0) {
            (Repr::Known { source: a, id: x, .. }, Repr::Known { source: b, id: y, .. }) => a == b && x == y,
            _ => false,
        }
    }

    /// The local plan it belongs to; `None` for any other source and for an unknown owner.
    pub fn local_plan(&self) -> Option<PathBuf> {
        match &self.0 {
            Repr::Known { source: Source::Local, id, .. } => Some(PathBuf::from(id)),
            _ => None,
        }
    }

    /// For a log line: every plan checksum in it (64 hex digits, as in `apply:<checksum>:0`) cut
    /// to the 12-digit id people see everywhere else.
    pub fn short(&self) -> String {
        short_ids(&self.to_string())
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Repr::Known { source, id, slot: None } => write!(f, "{source}:{id}"),
            Repr::Known { source, id, slot: Some(slot) } => write!(f, "{source}:{id}:{slot}"),
            Repr::Unknown(raw) => f.write_str(raw),
        }
    }
}

impl FromStr for Owner {
    type Err = std::convert::Infallible;

    /// Never fails: text that is no owner this build writes is an unknown owner.
    fn from_str(s: &str) -> Result<Owner, Self::Err> {
        Ok(parse(s).unwrap_or_else(|| Owner(Repr::Unknown(s.to_string()))))
    }
}

fn parse(s: &str) -> Option<Owner> {
    let (prefix, rest) = s.split_once(':')?;
    let source = Source::ALL.into_iter().find(|src| src.prefix() == prefix)?;
    let (id, slot) = match rest.rsplit_once(':') {
        Some((id, slot)) if source.runs_plans() => match slot.parse::<Slot>() {
            Ok(slot) => (id, Some(slot)),
            Err(()) => (rest, None),
        },
        _ => (rest, None),
    };
    source.valid_id(id).then(|| Owner(Repr::Known { source, id: id.to_string(), slot }))
}

impl serde::Serialize for Owner {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Owner {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Owner, D::Error> {
        let Ok(owner) = String::deserialize(d)?.parse();
        Ok(owner)
    }
}

/// `owner` with every run of exactly 64 lowercase hex digits cut to its first 12.
fn short_ids(owner: &str) -> String {
    let mut out = String::with_capacity(owner.len());
    let mut run = String::new();
    let flush = |run: &mut String, out: &mut String| {
        out.push_str(if run.len() == 64 { &run[..12] } else { run });
        run.clear();
    };
    for c in owner.chars() {
        if c.is_ascii_hexdigit() && !c.is_ascii_uppercase() {
            run.push(c);
        } else {
            flush(&mut run, &mut out);
            out.push(c);
        }
    }
    flush(&mut run, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CS: &str = "440b2eb0b6bdd3b7eea28188e7b15ae147842a7d65359938a4d1961952971213";

    /// The exact strings the build before the typed owner wrote (records and locks): each reads
    /// as the owner the callers now build, and displays back byte for byte.
    #[test]
    fn owners_written_by_earlier_builds_read_back_as_typed_owners() {
        let plan = Path::new("/var/lib/rancher/agent/plans/a.plan");
        let colon = Path::new("/plans/with:colon/b:1.plan");
        let cases = [
            ("local:/var/lib/rancher/agent/plans/a.plan:0", Owner::local(plan).with_slot(Slot::OneTime(0))),
            ("local:/var/lib/rancher/agent/plans/a.plan:p2", Owner::local(plan).with_slot(Slot::Periodic(2))),
            ("local:/plans/with:colon/b:1.plan:10", Owner::local(colon).with_slot(Slot::OneTime(10))),
            ("local:/var/lib/rancher/agent/plans/a.plan", Owner::local(plan)),
            (&format!("remote:{CS}:3"), Owner::remote(CS).with_slot(Slot::OneTime(3))),
            (&format!("remote:{CS}:p0"), Owner::remote(CS).with_slot(Slot::Periodic(0))),
            (&format!("apply:{CS}:0"), Owner::apply(CS).with_slot(Slot::OneTime(0))),
            (&format!("apply:{CS}"), Owner::apply(CS)),
            ("supervise:web", Owner::supervise("web")),
            ("supervise:web:3", Owner::supervise("web:3")),
            ("supervise:web/../x", Owner::supervise("web/../x")),
            ("supervise:", Owner::supervise("")),
        ];
        for (text, owner) in cases {
            assert_eq!(owner.to_string(), text);
            let read: Owner = text.parse().unwrap();
            assert_eq!(read, owner, "{text}");
            assert!(read.is_known(), "{text}");
            assert_eq!(read.to_string(), text);
        }
        let rec: Owner = "local:/var/lib/rancher/agent/plans/a.plan:p2".parse().unwrap();
        assert_eq!(rec.local_plan().as_deref(), Some(plan));
        assert!(rec.belongs_to(Source::Local) && rec.belongs_to_plan(&Owner::local(plan)));
        assert!(!rec.belongs_to_plan(&Owner::local(Path::new("/var/lib/rancher/agent/plans/b.plan"))));
        let rec: Owner = format!("apply:{CS}:1").parse().unwrap();
        assert!(rec.belongs_to_plan(&Owner::apply(CS)) && !rec.belongs_to_plan(&Owner::remote(CS)));
        assert_eq!((rec.source(), rec.id(), rec.slot()), (Some(Source::Apply), Some(CS), Some(Slot::OneTime(1))));
        assert_eq!(rec.local_plan(), None);
    }

    /// Text that is no such owner is kept as it is: it belongs to the source its prefix names (so
    /// that source holds everything, as for a plan it cannot place) and to no plan.
    #[test]
    fn garbled_owners_are_kept_verbatim_and_belong_to_no_plan() {
        let cases = [
            ("", None),
            ("test", None),
            ("plan:abc:0", None),
            ("local", None),
            ("local:", Some(Source::Local)),
            ("local::0", Some(Source::Local)),
            ("remote:", Some(Source::Remote)),
            ("remote:abc:def:0", Some(Source::Remote)),
            (&format!("remote:{CS}:zz"), Some(Source::Remote)),
            (&format!("apply:{CS}:03"), Some(Source::Apply)),
            ("apply::1", Some(Source::Apply)),
            ("Local:/a.plan:0", None),
        ];
        for (text, source) in cases {
            let read: Owner = text.parse().unwrap();
            assert!(!read.is_known(), "{text}");
            assert_eq!(read.to_string(), text);
            assert_eq!(read.source(), source, "{text}");
            assert_eq!((read.id(), read.slot(), read.local_plan()), (None, None, None), "{text}");
            for s in Source::ALL {
                assert_eq!(read.belongs_to(s), source == Some(s), "{text}");
            }
            assert!(!read.belongs_to_plan(&read));
            assert!(!read.belongs_to_plan(&Owner::apply(CS)) && !read.belongs_to_plan(&Owner::remote(CS)));
        }
        assert_eq!(Owner::default().to_string(), "");
        assert_eq!("test".parse::<Owner>().unwrap().with_slot(Slot::Periodic(1)).to_string(), "test:p1");
    }

    #[test]
    fn records_keep_the_owner_as_a_json_string() {
        let o = Owner::remote(CS).with_slot(Slot::Periodic(4));
        let json = serde_json::to_string(&o).unwrap();
        assert_eq!(json, format!("\"remote:{CS}:p4\""));
        assert_eq!(serde_json::from_str::<Owner>(&json).unwrap(), o);
        assert_eq!(serde_json::from_str::<Owner>("\"x:y\"").unwrap().to_string(), "x:y");
        assert!(serde_json::from_str::<Owner>("3").is_err());
    }

    #[test]
    fn plan_checksums_are_cut_to_their_short_id() {
        assert_eq!(Owner::apply(CS).with_slot(Slot::Periodic(3)).short(), "apply:440b2eb0b6bd:p3");
        assert_eq!(
            Owner::local(Path::new("/plans/a.plan")).with_slot(Slot::OneTime(0)).short(),
            "local:/plans/a.plan:0"
        );
        assert_eq!(Owner::supervise("abc").short(), "supervise:abc");
    }
}
