//! `-o table|wide|json|yaml|name`, as kubectl reads it, for every command that lists or shows
//! objects (`plan status` of one plan, `--node` and `--selector`; `rollout status`): one choice of
//! words and one shape of documents, so a script written against one command works on the next.
//!
//! - `table` is the command's own columns, `wide` adds the columns that do not fit a terminal.
//! - `json` and `yaml` print one document: the object itself when one object was named, else a
//!   `List` (`{"apiVersion": "v1", "kind": "List", "items": [...]}`), empty or not. A watch prints
//!   one JSON object per line per change (YAML: one document per change, `---` between).
//! - `name` prints one `KIND/NAME` line per object (`secret/node-a`,
//!   `nodeplan.agent.cattle.io/web`, a plan file's path), for `xargs`.

use serde::Serialize;

/// How a command prints what it lists or shows.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Output {
    /// The command's own columns (or lines).
    #[default]
    Table,
    /// The table with the columns that do not fit a terminal.
    Wide,
    /// One JSON document: the object, or a `List` of several.
    Json,
    /// The same document in YAML.
    Yaml,
    /// `KIND/NAME` of each object, one per line.
    Name,
}

impl Output {
    /// Whether this is the command's own text (`table` or `wide`), not documents or names.
    pub fn text(self) -> bool {
        matches!(self, Output::Table | Output::Wide)
    }
}

/// kubectl's list of several objects.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct List<'a, T> {
    api_version: &'static str,
    kind: &'static str,
    items: &'a [T],
}

/// `items` as one JSON or YAML document (`format` is [`Output::Json`] or [`Output::Yaml`]): the
/// object itself for one object named on the command line (`one`), else a `List`.
pub fn document<T: Serialize>(items: &[T], one: bool, format: Output) -> String {
    let value = match items {
        [item] if one => serde_json::to_value(item),
        _ => serde_json::to_value(List { api_version: "v1", kind: "List", items }),
    }
    .unwrap_or_default();
    encode(&value, format)
}

fn encode<T: Serialize>(value: &T, format: Output) -> String {
    if format == Output::Yaml {
        serde_yaml_ng::to_string(value).unwrap_or_default().trim_end().to_string()
    } else {
        serde_json::to_string_pretty(value).unwrap_or_default()
    }
}

/// One change of a watch: a JSON line, or a YAML document after `---`.
pub fn change<T: Serialize>(value: &T, format: Output) -> String {
    if format == Output::Yaml {
        format!("---\n{}", encode(value, format))
    } else {
        serde_json::to_string(value).unwrap_or_default()
    }
}

/// Print `items` as `format` says (not the table: the caller's), one `name` line each.
pub fn print<T: Serialize>(items: &[T], one: bool, format: Output, name: impl Fn(&T) -> String) {
    match format {
        Output::Json | Output::Yaml => crate::cli::out!("{}", document(items, one, format)),
        Output::Name => {
            for i in items {
                crate::cli::out!("{}", name(i));
            }
        }
        Output::Table | Output::Wide => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Item {
        name: &'static str,
    }

    #[test]
    fn one_object_named_is_itself_anything_else_a_list() {
        let one = [Item { name: "a" }];
        let v: serde_json::Value = serde_json::from_str(&document(&one, true, Output::Json)).unwrap();
        assert_eq!(v, serde_json::json!({"name": "a"}));
        // Listed (a selector, a node's plans): a List even of one, and of none.
        let v: serde_json::Value = serde_json::from_str(&document(&one, false, Output::Json)).unwrap();
        assert_eq!(v, serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [{"name": "a"}]}));
        let none: [Item; 0] = [];
        let v: serde_json::Value = serde_json::from_str(&document(&none, false, Output::Json)).unwrap();
        assert_eq!(v["items"], serde_json::json!([]));
        let two = [Item { name: "a" }, Item { name: "b" }];
        let y: serde_json::Value = serde_yaml_ng::from_str(&document(&two, false, Output::Yaml)).unwrap();
        assert_eq!(y["kind"], "List");
        assert_eq!(y["items"][1]["name"], "b");
    }
}
