//! Scalar keywords as the caller wrote them (`scale=`, `causal=`,
//! `window=`, `seed=`, `device=`, ...), checked here rather than coerced
//! by the bindings: `float("0.5")` would accept a string, `bool("False")`
//! is true, `int(1.5)` rounds. Each check takes exactly the kinds of value
//! the keyword means and names the keyword otherwise.

use crate::error::{Error, Result};

/// What kind of value the caller gave, as the bindings classify it.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    None,
    /// Python's or NumPy's bool.
    Bool(bool),
    /// An integer (Python's or NumPy's); `None` when it is beyond `i128`.
    Int(Option<i128>),
    /// A float (Python's or NumPy's).
    Float(f64),
    Str(String),
    /// Anything else, by its type's name (`set`, `ndarray`, `Tensor`).
    Other(String),
}

/// One scalar argument: its kind and how the caller would write it (its
/// `repr`), for messages.
#[derive(Debug, Clone, PartialEq)]
pub struct Given {
    pub kind: Kind,
    pub repr: String,
}

impl Given {
    pub fn new(kind: Kind, repr: impl Into<String>) -> Self {
        Given {
            kind,
            repr: repr.into(),
        }
    }

    fn described(&self) -> String {
        match &self.kind {
            Kind::None => "None".to_string(),
            Kind::Bool(_) => "a bool".to_string(),
            Kind::Int(_) => "an int".to_string(),
            Kind::Float(_) => "a float".to_string(),
            Kind::Str(_) => "a string".to_string(),
            Kind::Other(type_name) => format!("a value of type {type_name}"),
        }
    }

    fn error(&self, argument: &str, expected: &str) -> Error {
        Error::Value {
            argument: argument.to_string(),
            value: self.repr.clone(),
            reason: format!("expected {expected}, got {}", self.described()),
        }
    }
}

/// A flag (`causal`, `return_lse`): `True` or `False`, never a value
/// whose truth Python would guess (`"False"` is true, an array ambiguous).
pub fn flag(argument: &str, given: &Given) -> Result<bool> {
    match given.kind {
        Kind::Bool(b) => Ok(b),
        _ => Err(given.error(argument, "True or False")),
    }
}

/// A real number (`dropout_p`). An int is exact enough; a bool is not a
/// number here.
pub fn real(argument: &str, given: &Given) -> Result<f64> {
    number(argument, given, "a number")
}

/// A real number or `None` (`scale`, `softcap`).
pub fn optional_real(argument: &str, given: &Given) -> Result<Option<f64>> {
    match given.kind {
        Kind::None => Ok(None),
        _ => number(argument, given, "a number or None").map(Some),
    }
}

fn number(argument: &str, given: &Given, expected: &str) -> Result<f64> {
    match given.kind {
        Kind::Float(x) => Ok(x),
        Kind::Int(Some(i)) => Ok(i as f64),
        Kind::Int(None) => Err(Error::Value {
            argument: argument.to_string(),
            value: given.repr.clone(),
            reason: "the integer is out of range".to_string(),
        }),
        _ => Err(given.error(argument, expected)),
    }
}

/// An integer (`seed`, `q_offset`), or `None`. Floats are refused even
/// when whole: a position or a seed is never rounded. The problem's
/// validation checks the range of what fits `i128`.
pub fn integer(argument: &str, given: &Given) -> Result<Option<i128>> {
    match given.kind {
        Kind::None => Ok(None),
        Kind::Int(Some(i)) => Ok(Some(i)),
        Kind::Int(None) => Err(Error::Value {
            argument: argument.to_string(),
            value: given.repr.clone(),
            reason: "the integer is out of range".to_string(),
        }),
        _ => Err(given.error(argument, "an integer or None")),
    }
}

/// A required integer naming a size or a layer (`num_blocks`, `layer`):
/// an int, never a bool or a float (`layers=True` or `layer=1.0` is a
/// mistake, not a 1). One beyond `i64` is refused here, with the value as
/// the caller wrote it (it used to saturate, and the caller's check then
/// quoted 9223372036854775807): too large, or out of range below.
pub fn index(argument: &str, given: &Given) -> Result<i64> {
    match given.kind {
        Kind::Int(Some(i)) => i64::try_from(i).map_err(|_| {
            if i > 0 {
                Error::TooLarge(format!(
                    "{argument}={} is larger than any size or index flashport takes (they \
                     fit in int64)",
                    given.repr
                ))
            } else {
                Error::Value {
                    argument: argument.to_string(),
                    value: given.repr.clone(),
                    reason: "the integer is out of range (below int64)".to_string(),
                }
            }
        }),
        Kind::Int(None) => Err(Error::Value {
            argument: argument.to_string(),
            value: given.repr.clone(),
            reason: "the integer is out of range".to_string(),
        }),
        _ => Err(given.error(argument, "an integer")),
    }
}

/// A sequence id (`sid`, an item of `seq_ids`): an [`index`], except that
/// one beyond `i64` names no sequence (as any other unknown id), quoted as
/// the caller wrote it.
pub fn seq_id(argument: &str, given: &Given) -> Result<i64> {
    match given.kind {
        Kind::Int(Some(i)) if i64::try_from(i).is_err() => Err(Error::UnknownSequence {
            argument: argument.to_string(),
            value: given.repr.clone(),
            reason: "no such sequence (sequence ids fit in int64)".to_string(),
        }),
        _ => index(argument, given),
    }
}

/// The entries of an unsigned 64-bit integer array of `shape` (row-major)
/// as i64, or an error naming the first one beyond int64 by its index and
/// its value as passed (`block_table[1, 3]=18446744073709551615`). They
/// saturated before: messages quoted 9223372036854775807, and two token
/// ids above 2^63 became the same token.
pub fn int64_entries(
    argument: &str,
    shape: &[usize],
    entries: impl IntoIterator<Item = u64>,
) -> Result<Vec<i64>> {
    entries
        .into_iter()
        .enumerate()
        .map(|(flat, value)| {
            i64::try_from(value).map_err(|_| {
                let mut index = Vec::with_capacity(shape.len());
                let mut rest = flat;
                for &n in shape.iter().rev() {
                    index.push(rest % n.max(1));
                    rest /= n.max(1);
                }
                index.reverse();
                let index: Vec<String> = index.iter().map(usize::to_string).collect();
                Error::Value {
                    argument: format!("{argument}[{}]", index.join(", ")),
                    value: value.to_string(),
                    reason: "beyond int64, the largest integer flashport takes".to_string(),
                }
            })
        })
        .collect()
}

/// A list of indices as given (`seq_ids=`): its items, or something that
/// is not a list of them (an int, a string, a non-iterable).
#[derive(Debug, Clone, PartialEq)]
pub enum IndicesGiven {
    Items(Vec<Given>),
    Other(Given),
}

/// `seq_ids=[...]`: each item an [`index`], named `argument[i]`; a bare
/// id is refused (`seq_ids=0` where `[0]` was meant).
pub fn indices(argument: &str, given: &IndicesGiven) -> Result<Vec<i64>> {
    match given {
        IndicesGiven::Items(items) => items
            .iter()
            .enumerate()
            // The item's name is written only for a message (formatting
            // it for every id of every call showed in a decode step's
            // profile); the check is pure, so it fails the same way again.
            .map(|(i, item)| {
                seq_id(argument, item).or_else(|_| seq_id(&format!("{argument}[{i}]"), item))
            })
            .collect(),
        IndicesGiven::Other(g) => Err(g.error(argument, "a sequence of sequence ids (e.g. [sid])")),
    }
}

/// `device=`: a name, or `None` for the default.
pub fn name(argument: &str, given: &Given) -> Result<Option<String>> {
    match &given.kind {
        Kind::None => Ok(None),
        Kind::Str(s) => Ok(Some(s.clone())),
        _ => Err(given.error(argument, "\"cpu\", \"gpu\", \"gpu:N\", \"auto\" or None")),
    }
}

/// `window=` as given: nothing, a pair (a tuple or list of two), or
/// something else.
#[derive(Debug, Clone, PartialEq)]
pub enum WindowGiven {
    None,
    Pair(Given, Given),
    Other(Given),
}

/// `window=(left, right)`: each side an int (checked for range by the
/// problem's validation) or `None` for unbounded, given as -1.
pub fn window(given: &WindowGiven) -> Result<Option<(i64, i64)>> {
    const PAIR: &str = "a pair (left, right), each an int >= 0, or None / -1 for unbounded";
    let shown = |l: &Given, r: &Given| format!("({}, {})", l.repr, r.repr);
    match given {
        WindowGiven::None => Ok(None),
        WindowGiven::Pair(left, right) => {
            let side = |s: &Given, which: &str| match s.kind {
                Kind::None => Ok(-1),
                Kind::Int(Some(i)) if i64::try_from(i).is_ok() => Ok(i as i64),
                Kind::Int(_) => Err(Error::Value {
                    argument: "window".to_string(),
                    value: shown(left, right),
                    reason: format!("the {which} extent is out of range; expected {PAIR}"),
                }),
                _ => Err(Error::Value {
                    argument: "window".to_string(),
                    value: shown(left, right),
                    reason: format!("expected {PAIR}; the {which} side is {}", s.described()),
                }),
            };
            Ok(Some((side(left, "left")?, side(right, "right")?)))
        }
        WindowGiven::Other(g) => Err(g.error("window", PAIR)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn given(kind: Kind) -> Given {
        let repr = format!("{kind:?}");
        Given::new(kind, repr)
    }

    fn argument_of(e: Error) -> String {
        match e {
            Error::Value { argument, .. } => argument,
            other => panic!("not a value error: {other:?}"),
        }
    }

    #[test]
    fn flags_are_bools_only() {
        assert_eq!(flag("causal", &given(Kind::Bool(true))), Ok(true));
        for kind in [
            Kind::Str("False".into()),
            Kind::Int(Some(1)),
            Kind::None,
            Kind::Other("ndarray".into()),
        ] {
            let e = flag("causal", &given(kind)).unwrap_err();
            assert_eq!(argument_of(e), "causal");
        }
    }

    #[test]
    fn reals_take_ints_and_floats_not_bools_or_strings() {
        assert_eq!(
            optional_real("scale", &given(Kind::Float(0.5))),
            Ok(Some(0.5))
        );
        assert_eq!(
            optional_real("scale", &given(Kind::Int(Some(2)))),
            Ok(Some(2.0))
        );
        assert_eq!(optional_real("scale", &given(Kind::None)), Ok(None));
        assert_eq!(real("dropout_p", &given(Kind::Int(Some(0)))), Ok(0.0));
        assert!(real("dropout_p", &given(Kind::None)).is_err());
        for kind in [
            Kind::Bool(true),
            Kind::Str("0.5".into()),
            Kind::Other("set".into()),
        ] {
            let e = optional_real("scale", &given(kind)).unwrap_err();
            assert_eq!(argument_of(e), "scale");
        }
    }

    #[test]
    fn integers_are_never_rounded() {
        assert_eq!(integer("seed", &given(Kind::Int(Some(-3)))), Ok(Some(-3)));
        for kind in [
            Kind::Float(1.0),
            Kind::Bool(false),
            Kind::Str("1".into()),
            Kind::Int(None),
        ] {
            let e = integer("seed", &given(kind)).unwrap_err();
            assert_eq!(argument_of(e), "seed");
        }
    }

    #[test]
    fn windows() {
        let pair = |l, r| WindowGiven::Pair(given(l), given(r));
        assert_eq!(window(&WindowGiven::None), Ok(None));
        assert_eq!(
            window(&pair(Kind::Int(Some(3)), Kind::None)),
            Ok(Some((3, -1)))
        );
        for bad in [
            pair(Kind::Float(1.5), Kind::Int(Some(2))),
            pair(Kind::Bool(true), Kind::Bool(false)),
            pair(Kind::Int(Some(1 << 63)), Kind::Int(Some(0))),
            pair(Kind::Int(None), Kind::Int(Some(0))),
            WindowGiven::Other(given(Kind::Other("set".into()))),
            WindowGiven::Other(given(Kind::Int(Some(3)))),
        ] {
            assert_eq!(argument_of(window(&bad).unwrap_err()), "window", "{bad:?}");
        }
    }

    #[test]
    fn unsigned_entries_beyond_int64_are_named_by_index() {
        assert_eq!(
            int64_entries("t", &[2, 2], [1u64, 2, 3, 4]),
            Ok(vec![1, 2, 3, 4])
        );
        let Err(Error::Value {
            argument, value, ..
        }) = int64_entries("block_table", &[2, 3], [0, 0, 0, 0, u64::MAX, 0])
        else {
            panic!("an entry beyond int64 is refused");
        };
        assert_eq!(
            (argument.as_str(), value.as_str()),
            ("block_table[1, 1]", "18446744073709551615")
        );
    }

    #[test]
    fn indices_are_ints_in_int64_never_bools_or_floats() {
        assert_eq!(index("layer", &given(Kind::Int(Some(2)))), Ok(2));
        assert_eq!(index("sid", &given(Kind::Int(Some(-3)))), Ok(-3));
        let big = Given::new(Kind::Int(Some(1 << 80)), "1208925819614629174706176");
        let Err(Error::TooLarge(message)) = index("num_blocks", &big) else {
            panic!("a size beyond int64 is too large");
        };
        assert!(message.starts_with("num_blocks=1208925819614629174706176 "));
        let Err(Error::UnknownSequence { value, .. }) = seq_id("sid", &big) else {
            panic!("an id beyond int64 is no sequence");
        };
        assert_eq!(value, "1208925819614629174706176");
        let low = Given::new(Kind::Int(Some(-(1 << 80))), "-1208925819614629174706176");
        assert!(matches!(index("layer", &low), Err(Error::Value { .. })));
        assert!(matches!(
            seq_id("sid", &low),
            Err(Error::UnknownSequence { .. })
        ));
        for kind in [
            Kind::Float(1.0),
            Kind::Bool(true),
            Kind::None,
            Kind::Str("1".into()),
            Kind::Int(None),
        ] {
            assert_eq!(
                argument_of(index("layer", &given(kind)).unwrap_err()),
                "layer"
            );
        }
        let items = |kinds: Vec<Kind>| IndicesGiven::Items(kinds.into_iter().map(given).collect());
        assert_eq!(
            indices(
                "seq_ids",
                &items(vec![Kind::Int(Some(3)), Kind::Int(Some(0))])
            ),
            Ok(vec![3, 0])
        );
        let e = indices(
            "seq_ids",
            &items(vec![Kind::Int(Some(3)), Kind::Float(0.0)]),
        );
        assert_eq!(argument_of(e.unwrap_err()), "seq_ids[1]");
        let bare = IndicesGiven::Other(given(Kind::Int(Some(0))));
        assert_eq!(
            argument_of(indices("seq_ids", &bare).unwrap_err()),
            "seq_ids"
        );
    }

    #[test]
    fn names() {
        assert_eq!(name("device", &given(Kind::None)), Ok(None));
        assert_eq!(
            name("device", &given(Kind::Str("gpu".into()))),
            Ok(Some("gpu".into()))
        );
        assert!(name("device", &given(Kind::Int(Some(1)))).is_err());
    }
}
