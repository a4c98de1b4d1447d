//! How large and how deep a JSON document is, measured the way the blast-radius rule of DESIGN.md
//! §8 needs: the walk stops as soon as either bound is passed, and it keeps its place with an explicit
//! stack, never recursion, so neither a huge nor a deeply nested document can exhaust memory or the
//! thread's stack while it is being measured.

use std::fmt::{self, Write};

use serde_json::Value;

/// The largest install config stackd renders, serialized as compact JSON.
pub(crate) const MAX_CONFIG_BYTES: usize = 1 << 20;
/// The deepest nesting of lists and mappings in an install config stackd renders (a real one nests
/// fewer than ten levels). `serde_json::Value`'s clone, drop and serialization recurse, so a
/// document must never get far past this.
pub(crate) const MAX_CONFIG_DEPTH: usize = 64;

/// The bounds a document is held to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bounds {
    pub(crate) max_bytes: usize,
    pub(crate) max_depth: usize,
}

/// The install config's bounds.
pub(crate) const INSTALL_CONFIG: Bounds = Bounds {
    max_bytes: MAX_CONFIG_BYTES,
    max_depth: MAX_CONFIG_DEPTH,
};

/// Which bound a document passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Exceeded {
    #[error("it would be larger than {} serialized, the most stackd renders", show_bytes(*max_bytes))]
    Size { max_bytes: usize },
    #[error("it would nest lists and mappings deeper than {max_depth} levels, the most stackd renders")]
    Depth { max_depth: usize },
}

/// `1 MiB` for 1048576, else the bytes.
fn show_bytes(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} bytes")
    }
}

/// What a document within its bounds measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Measured {
    /// Its length as compact JSON (`serde_json::to_string`).
    pub(crate) bytes: usize,
    /// Levels of lists and mappings: 0 for a scalar, 1 for `{"a": 1}`.
    pub(crate) depth: usize,
}

/// Where the walk is inside one list or mapping.
enum Frame<'a> {
    List(std::slice::Iter<'a, Value>),
    Mapping(serde_json::map::Iter<'a>),
}

/// Measures `value`, stopping at the first bound it passes. The work done is bounded by
/// `bounds.max_bytes` (every node adds at least one byte) and the memory by `bounds.max_depth`.
pub(crate) fn measure(value: &Value, bounds: Bounds) -> Result<Measured, Exceeded> {
    let mut walk = Walk {
        bounds,
        bytes: 0,
        depth: 0,
        stack: Vec::new(),
    };
    walk.enter(value)?;
    while let Some(frame) = walk.stack.last_mut() {
        let next = match frame {
            Frame::List(items) => items.next(),
            Frame::Mapping(entries) => entries.next().map(|(key, value)| {
                // The key, quoted, and its colon.
                walk.bytes = walk.bytes.saturating_add(string_length(key) + 1);
                value
            }),
        };
        match next {
            Some(child) => walk.enter(child)?,
            None => {
                walk.stack.pop();
            }
        }
    }
    Ok(Measured {
        bytes: walk.bytes,
        depth: walk.depth,
    })
}

struct Walk<'a> {
    bounds: Bounds,
    bytes: usize,
    depth: usize,
    stack: Vec<Frame<'a>>,
}

impl<'a> Walk<'a> {
    /// Counts `value`'s own bytes (brackets and separators for a list or mapping, whose items come
    /// later) and steps into it.
    fn enter(&mut self, value: &'a Value) -> Result<(), Exceeded> {
        let own = match value {
            Value::Null | Value::Bool(true) => 4,
            Value::Bool(false) => 5,
            Value::Number(number) => display_length(number),
            Value::String(text) => string_length(text),
            Value::Array(items) => {
                self.stack.push(Frame::List(items.iter()));
                2 + items.len().saturating_sub(1)
            }
            Value::Object(entries) => {
                self.stack.push(Frame::Mapping(entries.iter()));
                2 + entries.len().saturating_sub(1)
            }
        };
        self.depth = self.depth.max(self.stack.len());
        if self.stack.len() > self.bounds.max_depth {
            return Err(Exceeded::Depth {
                max_depth: self.bounds.max_depth,
            });
        }
        self.bytes = self.bytes.saturating_add(own);
        if self.bytes > self.bounds.max_bytes {
            return Err(Exceeded::Size {
                max_bytes: self.bounds.max_bytes,
            });
        }
        Ok(())
    }
}

/// The length of `text` as a JSON string, quotes and escapes included (as serde_json writes it).
fn string_length(text: &str) -> usize {
    let escapes: usize = text
        .bytes()
        .map(|byte| match byte {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 1,
            0x00..=0x1f => 5,
            _ => 0,
        })
        .sum();
    text.len() + escapes + 2
}

/// The length of `shown`'s text, without allocating it.
fn display_length(shown: &impl fmt::Display) -> usize {
    struct Count(usize);
    impl Write for Count {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            self.0 += s.len();
            Ok(())
        }
    }
    let mut count = Count(0);
    let _ = write!(count, "{shown}");
    count.0
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const WIDE: Bounds = Bounds {
        max_bytes: usize::MAX,
        max_depth: 1000,
    };

    #[test]
    fn the_size_is_the_compact_json_length() {
        for value in [
            json!(null),
            json!(false),
            json!(-12.5e300),
            json!(18446744073709551615u64),
            json!("plain"),
            json!("quote \" backslash \\ newline \n bell \u{7} tab \t é"),
            json!([]),
            json!({}),
            json!([1, [2, [3]], {"a": [], "b\"": {"c": null}}]),
            json!({"apiVersion": "v1", "metadata": {"name": "x"}, "list": [true, "on", 1e3]}),
        ] {
            let measured = measure(&value, WIDE).unwrap();
            assert_eq!(measured.bytes, serde_json::to_string(&value).unwrap().len(), "{value}");
        }
    }

    #[test]
    fn depth_counts_levels_of_lists_and_mappings() {
        assert_eq!(measure(&json!("x"), WIDE).unwrap().depth, 0);
        assert_eq!(measure(&json!({"a": 1}), WIDE).unwrap().depth, 1);
        assert_eq!(measure(&json!({"a": [[{}]], "b": []}), WIDE).unwrap().depth, 4);
    }

    #[test]
    fn a_document_past_a_bound_says_which() {
        let tight = Bounds {
            max_bytes: 10,
            max_depth: 2,
        };
        assert_eq!(
            measure(&json!({"a": "0123456789"}), tight),
            Err(Exceeded::Size { max_bytes: 10 })
        );
        assert_eq!(measure(&json!([[[]]]), tight), Err(Exceeded::Depth { max_depth: 2 }));
        assert_eq!(measure(&json!([[1]]), tight).unwrap().depth, 2);
        let message = Exceeded::Size {
            max_bytes: MAX_CONFIG_BYTES,
        }
        .to_string();
        assert!(message.contains("larger than 1 MiB serialized"), "{message}");
    }

    #[test]
    fn a_huge_document_is_measured_only_up_to_the_bound() {
        // A million elements: the walk stops after about a hundred of them.
        let huge = Value::Array(vec![json!(0); 1_000_000]);
        let bounds = Bounds {
            max_bytes: 200,
            max_depth: 4,
        };
        assert_eq!(measure(&huge, bounds), Err(Exceeded::Size { max_bytes: 200 }));
    }

    #[test]
    fn a_deep_document_is_measured_without_recursion() {
        // Built and torn down iteratively: Value's own drop would recurse 100000 levels.
        let mut deep = json!(0);
        for _ in 0..100_000 {
            deep = Value::Array(vec![deep]);
        }
        assert_eq!(
            measure(&deep, INSTALL_CONFIG),
            Err(Exceeded::Depth {
                max_depth: MAX_CONFIG_DEPTH
            })
        );
        let mut rest = deep;
        while let Value::Array(mut items) = rest {
            rest = items.pop().unwrap_or(Value::Null);
        }
    }
}
