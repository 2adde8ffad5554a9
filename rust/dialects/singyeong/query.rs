//! Queries (spec §7, decisions 3-6): both forms parsed into one predicate tree, and the
//! matcher that runs it over a client's metadata. The one implementation: Python's
//! `query.parse` and the fast path's reading of a SEND both end here.
//!
//! ```text
//! seed form    {"region": {"$eq": "eu"}}     {"load": {"$and": [{"$gt": 1}, {"$lt": 5}]}}
//!              {"$or": [{"a": {"$eq": 1}}, {"b": {"$eq": 2}}]}     ("/a/b/0" keys are paths)
//! path form    {"path": "/a/b/0", "op": "$eq", "to": {"value": V}}
//!              {"path": "/a", "op": "$gt", "to": {"path": "/b", "default": 0}}
//!              {"op": "$and" | "$or" | "$nor", "with": [...]}
//! ```
//!
//! Semantics (decision 4): a path walks maps by key and lists by index (a segment indexes only
//! where the value is a list); version semantics apply to a top-level key of type `version`.
//! A client missing the path matches `$ne` and `$nin` only. `$eq`/`$ne` compare values of one
//! kind (1 == 1.0; booleans are not numbers); `$gt $gte $lt $lte` order numbers, strings and
//! versions, false across kinds. `$in`/`$nin`: the value is (not) one of a list.
//! `$contains`/`$ncontains`: the operand is (not) an element of the client's list or a key of
//! its map; false on other kinds. Anything malformed, or beyond the [`Limits`] a stranger's
//! query is held to (issue 33), is a [`QueryError`] whose text the sender gets in op 3.

use std::cmp::Ordering;
use std::collections::HashMap;

use super::value::{equal, order, repr, Value};

/// What one query may cost: operators nested, conditions in all, values in one `$in`/`$nin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_depth: usize,
    pub max_ops: usize,
    pub max_list: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_depth: 32,
            max_ops: 1024,
            max_list: 1024,
        }
    }
}

/// Which bound a refused query broke (the `limit` label of the refusal metric).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    Depth,
    Ops,
    List,
}

impl Bound {
    pub fn name(self) -> &'static str {
        match self {
            Bound::Depth => "depth",
            Bound::Ops => "ops",
            Bound::List => "list",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct QueryError {
    pub message: String,
    /// Some: the query is well-formed but over a bound
    pub bound: Option<Bound>,
}

fn fail<T>(message: impl Into<String>) -> Result<T, QueryError> {
    Err(QueryError {
        message: message.into(),
        bound: None,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Eq,
    Ne,
    Gt,
    Gte,
    Lt,
    Lte,
    In,
    Nin,
    Contains,
    Ncontains,
}

fn comparison(op: &[u8]) -> Option<Op> {
    Some(match op {
        b"$eq" => Op::Eq,
        b"$ne" => Op::Ne,
        b"$gt" => Op::Gt,
        b"$gte" => Op::Gte,
        b"$lt" => Op::Lt,
        b"$lte" => Op::Lte,
        b"$in" => Op::In,
        b"$nin" => Op::Nin,
        b"$contains" => Op::Contains,
        b"$ncontains" => Op::Ncontains,
        _ => return None,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logic {
    And,
    Or,
    Nor,
}

fn logical(op: &[u8]) -> Option<Logic> {
    Some(match op {
        b"$and" => Logic::And,
        b"$or" => Logic::Or,
        b"$nor" => Logic::Nor,
        _ => return None,
    })
}

pub type Path = Vec<Box<[u8]>>;
/// What a query's `selector` asks for: the kind, and the top-level metadata key.
pub type Selection = (Selector, Box<[u8]>);

#[derive(Debug, Clone, PartialEq)]
pub enum Operand {
    Value(Value),
    /// another path of the same client's metadata, `default` where it is missing
    Path(Path, Value),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Pred {
    Cmp(Op, Path, Operand),
    All(Logic, Vec<Pred>),
}

/// One metadata entry: its value and whether its type is `version`.
pub type Metadata = HashMap<Box<[u8]>, (Value, bool)>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selector {
    Min,
    Max,
    Avg,
}

/// A numeric interval on a top-level key that every match falls in (for the range index).
#[derive(Debug, Clone, PartialEq)]
pub struct Range {
    pub key: Box<[u8]>,
    pub low: Option<(Value, bool)>,
    pub high: Option<(Value, bool)>,
}

/// A parsed query.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Query {
    pub application: Option<Box<[u8]>>,
    pub restricted: bool,
    pub key: Option<Box<[u8]>>,
    pub droppable: bool,
    pub optional: bool,
    pub predicate: Option<Pred>,
    /// top-level `$eq`/`$in` on one key: (key, acceptable values), for the hash index
    pub hints: Vec<(Box<[u8]>, Vec<Value>)>,
    pub ranges: Vec<Range>,
    pub selector: Option<Selection>,
    /// the predicate is one top-level `$eq` on an indexable value: the hash index's bucket
    /// for it holds exactly its matches, so the predicate is skipped on its members
    pub exact: bool,
}

impl Query {
    /// `optional`: the same query without ops and selector (decision 5).
    pub fn fallback(&self) -> Query {
        Query {
            application: self.application.clone(),
            restricted: self.restricted,
            key: self.key.clone(),
            droppable: self.droppable,
            ..Query::default()
        }
    }

    /// Whether a client of `app` (restricted or not) with `metadata` matches.
    pub fn matches(&self, app: &[u8], restricted: bool, metadata: &Metadata) -> bool {
        if self.application.as_deref().is_some_and(|a| a != app) {
            return false;
        }
        if restricted && !self.restricted {
            return false;
        }
        self.predicate.as_ref().is_none_or(|p| holds(p, metadata))
    }
}

fn resolve<'m>(metadata: &'m Metadata, path: &[Box<[u8]>]) -> Option<&'m Value> {
    let (first, rest) = path.split_first()?;
    let mut value = &metadata.get(first)?.0;
    for segment in rest {
        value = match value {
            Value::Map(_) => value.get(segment)?,
            Value::List(items) => {
                if segment.is_empty() || !segment.iter().all(u8::is_ascii_digit) {
                    return None;
                }
                let at: usize = std::str::from_utf8(segment).ok()?.parse().ok()?;
                items.get(at)?
            }
            _ => return None,
        };
    }
    Some(value)
}

/// Whether `pred` holds for a client's metadata.
pub fn holds(pred: &Pred, metadata: &Metadata) -> bool {
    let (op, path, operand) = match pred {
        Pred::All(Logic::And, parts) => return parts.iter().all(|p| holds(p, metadata)),
        Pred::All(Logic::Or, parts) => return parts.iter().any(|p| holds(p, metadata)),
        Pred::All(Logic::Nor, parts) => return !parts.iter().any(|p| holds(p, metadata)),
        Pred::Cmp(op, path, operand) => (*op, path, operand),
    };
    let version = path.len() == 1 && metadata.get(&path[0]).is_some_and(|e| e.1);
    let value = resolve(metadata, path);
    let default;
    let wanted = match operand {
        Operand::Value(v) => v,
        Operand::Path(other, d) => match resolve(metadata, other) {
            Some(v) => v,
            None => {
                default = d.clone();
                &default
            }
        },
    };
    let Some(value) = value else {
        return matches!(op, Op::Ne | Op::Nin);
    };
    match op {
        Op::Eq => equal(value, wanted, version),
        Op::Ne => !equal(value, wanted, version),
        Op::Gt => order(value, wanted, version) == Some(Ordering::Greater),
        Op::Gte => matches!(
            order(value, wanted, version),
            Some(Ordering::Greater | Ordering::Equal)
        ),
        Op::Lt => order(value, wanted, version) == Some(Ordering::Less),
        Op::Lte => matches!(
            order(value, wanted, version),
            Some(Ordering::Less | Ordering::Equal)
        ),
        Op::In | Op::Nin => match wanted {
            Value::List(options) => {
                options.iter().any(|o| equal(value, o, version)) != (op == Op::Nin)
            }
            _ => false,
        },
        Op::Contains | Op::Ncontains => {
            let negate = op == Op::Ncontains;
            match value {
                Value::List(items) => items.iter().any(|i| equal(i, wanted, false)) != negate,
                Value::Map(_) => {
                    let key = wanted.as_str();
                    key.is_some_and(|k| value.get(k).is_some()) != negate
                }
                _ => false,
            }
        }
    }
}

/// `repr` cut to 80 characters, as error texts quote values.
fn short(value: &Value) -> String {
    let text = repr(value);
    if text.chars().count() <= 80 {
        return text;
    }
    let cut: String = text.chars().take(77).collect();
    cut + "..."
}

fn text(key: &[u8]) -> String {
    String::from_utf8_lossy(key).into_owned()
}

pub fn parse_path(path: Option<&Value>) -> Result<Path, QueryError> {
    match path {
        Some(Value::Str(p)) if p.len() >= 2 && p[0] == b'/' => {
            Ok(p[1..].split(|c| *c == b'/').map(Box::from).collect())
        }
        other => fail(format!(
            "path must be a non-empty string starting with '/', got {}",
            repr(other.unwrap_or(&Value::Null))
        )),
    }
}

fn indexable(value: &Value) -> bool {
    match value {
        Value::Bool(_) | Value::Str(_) | Value::Int(_) | Value::Big(_) => true,
        Value::Float(f) => !f.is_nan(),
        _ => false,
    }
}

fn numeric(value: &Value) -> bool {
    value.number().is_some() && !value.is_nan()
}

struct Compiler {
    limits: Limits,
    count: usize,
    eq_hints: usize,
    hints: Vec<(Box<[u8]>, Vec<Value>)>,
    ranges: Vec<Range>,
}

impl Compiler {
    fn bump(&mut self, depth: usize) -> Result<(), QueryError> {
        self.count += 1;
        if self.count > self.limits.max_ops {
            return Err(QueryError {
                message: format!(
                    "more than {} conditions (the gateway's --sg-query-max-ops)",
                    self.limits.max_ops
                ),
                bound: Some(Bound::Ops),
            });
        }
        if depth > self.limits.max_depth {
            return Err(QueryError {
                message: format!(
                    "logical operators nested deeper than {} (the gateway's --sg-query-max-depth)",
                    self.limits.max_depth
                ),
                bound: Some(Bound::Depth),
            });
        }
        Ok(())
    }

    fn bound(&mut self, key: &[u8], op: Op, value: &Value) {
        let at = match self.ranges.iter().position(|r| &*r.key == key) {
            Some(at) => at,
            None => {
                self.ranges.push(Range {
                    key: key.into(),
                    low: None,
                    high: None,
                });
                self.ranges.len() - 1
            }
        };
        let range = &mut self.ranges[at];
        let (slot, inclusive, tighter) = match op {
            Op::Gt | Op::Gte => (&mut range.low, op == Op::Gte, Ordering::Greater),
            _ => (&mut range.high, op == Op::Lte, Ordering::Less),
        };
        let replace = match slot {
            None => true,
            Some((old, old_in)) => {
                let o = order(value, old, false);
                o == Some(tighter) || (o == Some(Ordering::Equal) && *old_in && !inclusive)
            }
        };
        if replace {
            *slot = Some((value.clone(), inclusive));
        }
    }

    fn condition(&mut self, entry: &Value, depth: usize, top: bool) -> Result<Pred, QueryError> {
        let Value::Map(members) = entry else {
            return fail(format!(
                "a condition must be a non-empty object, got {}",
                short(entry)
            ));
        };
        if members.is_empty() {
            return fail(format!(
                "a condition must be a non-empty object, got {}",
                short(entry)
            ));
        }
        if let Some(Value::Str(op)) = entry.get(b"op") {
            if op.starts_with(b"$") {
                return self.path_form(entry, op, depth, top);
            }
        }
        let mut parts = Vec::with_capacity(members.len());
        for (key, spec) in members {
            let key = key.as_str().unwrap_or(b"$");
            if let Some(logic) = logical(key) {
                parts.push(self.logical(logic, key, Some(spec), depth, false)?);
            } else if key.starts_with(b"$") {
                return fail(format!("unknown operator '{}'", text(key)));
            } else {
                let path = if key.starts_with(b"/") {
                    parse_path(Some(&Value::Str(key.into())))?
                } else {
                    vec![key.into()]
                };
                parts.push(self.seed_key(&path, spec, depth, top && members.len() == 1)?);
            }
        }
        Ok(one_or_all(parts))
    }

    fn logical(
        &mut self,
        logic: Logic,
        name: &[u8],
        items: Option<&Value>,
        depth: usize,
        top: bool,
    ) -> Result<Pred, QueryError> {
        self.bump(depth)?;
        let Some(Value::List(items)) =
            items.filter(|v| !matches!(v, Value::List(l) if l.is_empty()))
        else {
            return fail(format!(
                "{} takes a non-empty list of conditions",
                text(name)
            ));
        };
        let parts = items
            .iter()
            .map(|item| self.condition(item, depth + 1, top && logic == Logic::And))
            .collect::<Result<_, _>>()?;
        Ok(Pred::All(logic, parts))
    }

    fn seed_key(
        &mut self,
        path: &Path,
        spec: &Value,
        depth: usize,
        top: bool,
    ) -> Result<Pred, QueryError> {
        let members = match spec {
            Value::Map(m) if !m.is_empty() => m,
            _ => {
                let joined: Vec<String> = path.iter().map(|s| text(s)).collect();
                return fail(format!(
                    "{}: expected {{\"$op\": value}}, got {}",
                    joined.join("/"),
                    short(spec)
                ));
            }
        };
        let mut parts = Vec::with_capacity(members.len());
        for (op, value) in members {
            let name = op.as_str().unwrap_or(b"");
            if let Some(logic) = logical(name) {
                self.bump(depth)?;
                let Value::List(items) = value else {
                    return fail(format!(
                        "{} takes a non-empty list of conditions",
                        text(name)
                    ));
                };
                if items.is_empty() {
                    return fail(format!(
                        "{} takes a non-empty list of conditions",
                        text(name)
                    ));
                }
                let inner = items
                    .iter()
                    .map(|item| self.seed_key(path, item, depth + 1, false))
                    .collect::<Result<_, _>>()?;
                parts.push(Pred::All(logic, inner));
            } else {
                parts.push(self.compare(op, path, value, depth, top)?);
            }
        }
        Ok(one_or_all(parts))
    }

    fn compare(
        &mut self,
        op: &Value,
        path: &Path,
        value: &Value,
        depth: usize,
        top: bool,
    ) -> Result<Pred, QueryError> {
        self.bump(depth)?;
        let Some(which) = op.as_str().and_then(comparison) else {
            return fail(format!("unknown operator {}", repr(op)));
        };
        if matches!(which, Op::In | Op::Nin) {
            let Value::List(items) = value else {
                return fail(format!(
                    "{} takes a list, got {}",
                    text(op.as_str().unwrap_or(b"")),
                    short(value)
                ));
            };
            if items.len() > self.limits.max_list {
                return Err(QueryError {
                    message: format!(
                        "{} lists more than {} values (the gateway's --sg-query-max-list)",
                        text(op.as_str().unwrap_or(b"")),
                        self.limits.max_list
                    ),
                    bound: Some(Bound::List),
                });
            }
        }
        if top && path.len() == 1 {
            let key = &path[0];
            match (which, value) {
                (Op::Eq, v) if indexable(v) => {
                    self.hints.push((key.clone(), vec![v.clone()]));
                    self.eq_hints += 1;
                }
                (Op::In, Value::List(items))
                    if !items.is_empty() && items.iter().all(indexable) =>
                {
                    self.hints.push((key.clone(), items.clone()));
                }
                (Op::Gt | Op::Gte | Op::Lt | Op::Lte, v) if numeric(v) => self.bound(key, which, v),
                _ => {}
            }
        }
        Ok(Pred::Cmp(
            which,
            path.clone(),
            Operand::Value(value.clone()),
        ))
    }

    fn path_form(
        &mut self,
        entry: &Value,
        op: &[u8],
        depth: usize,
        top: bool,
    ) -> Result<Pred, QueryError> {
        if let Some(logic) = logical(op) {
            return self.logical(logic, op, entry.get(b"with"), depth, top);
        }
        let path = parse_path(entry.get(b"path"))?;
        let needs = || {
            fail(format!(
                "{} needs \"to\": {{\"value\": V}} or {{\"path\": P, \"default\": D}}",
                text(op)
            ))
        };
        let Some(to @ Value::Map(_)) = entry.get(b"to") else {
            return needs();
        };
        if let Some(value) = to.get(b"value") {
            return self.compare(&Value::Str(op.into()), &path, value, depth, top);
        }
        if let Some(other) = to.get(b"path") {
            self.bump(depth)?;
            let Some(which) = comparison(op) else {
                return fail(format!("unknown operator '{}'", text(op)));
            };
            let other = parse_path(Some(other))?;
            let default = to.get(b"default").cloned().unwrap_or(Value::Null);
            return Ok(Pred::Cmp(which, path, Operand::Path(other, default)));
        }
        needs()
    }
}

fn one_or_all(mut parts: Vec<Pred>) -> Pred {
    if parts.len() == 1 {
        parts.pop().expect("one part")
    } else {
        Pred::All(Logic::And, parts)
    }
}

/// `true` and `"true"` are true, everything else false (spec §7).
fn flag(value: Option<&Value>) -> bool {
    matches!(value, Some(Value::Bool(true)))
        || matches!(value, Some(Value::Str(s)) if &**s == b"true")
}

/// Parse a query object within `limits`.
pub fn parse(raw: &Value, limits: Limits) -> Result<Query, QueryError> {
    if !matches!(raw, Value::Map(_)) {
        return fail(format!("a query must be an object, got {}", short(raw)));
    }
    let application = match raw.get(b"application") {
        None | Some(Value::Null) => None,
        Some(Value::Str(s)) => Some(s.clone()),
        Some(_) => return fail("application must be a string (application ids, not tags)"),
    };
    let key = match raw.get(b"key") {
        None | Some(Value::Null) => None,
        Some(Value::Str(s)) => Some(s.clone()),
        Some(other) => Some(repr(other).into_bytes().into()),
    };
    let mut compiler = Compiler {
        limits,
        count: 0,
        eq_hints: 0,
        hints: Vec::new(),
        ranges: Vec::new(),
    };
    let predicate = match raw.get(b"ops") {
        None | Some(Value::Null) => None,
        Some(Value::List(ops)) if ops.is_empty() => None,
        Some(Value::List(ops)) => Some(one_or_all(
            ops.iter()
                .map(|entry| compiler.condition(entry, 1, true))
                .collect::<Result<_, _>>()?,
        )),
        Some(_) => return fail("ops must be a list of conditions"),
    };
    let selector = selector(raw.get(b"selector"))?;
    let exact = compiler.count == 1 && compiler.eq_hints == 1 && compiler.ranges.is_empty();
    Ok(Query {
        application,
        restricted: flag(raw.get(b"restricted")),
        key,
        droppable: flag(raw.get(b"droppable")),
        optional: flag(raw.get(b"optional")),
        predicate,
        hints: compiler.hints,
        ranges: compiler.ranges,
        selector,
        exact,
    })
}

fn selector(raw: Option<&Value>) -> Result<Option<Selection>, QueryError> {
    let members = match raw {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Map(m)) if m.len() == 1 => m,
        Some(_) => {
            return fail(r#"selector must be one of {"$min"|"$max"|"$avg": "<metadata key>"}"#)
        }
    };
    let (kind, key) = &members[0];
    let which = match kind.as_str() {
        Some(b"$min") => Selector::Min,
        Some(b"$max") => Selector::Max,
        Some(b"$avg") => Selector::Avg,
        _ => {
            return fail(format!(
                "unknown selector {}: use $min, $max or $avg",
                repr(kind)
            ))
        }
    };
    match key {
        Value::Str(k) if !k.is_empty() => Ok(Some((which, k.clone()))),
        _ => fail(format!(
            "{} takes a metadata key",
            text(kind.as_str().unwrap_or(b""))
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::json;
    use crate::dialects::singyeong::value::from_json;

    fn q(text: &str) -> Result<Query, QueryError> {
        let (r, span) = json::document(text.as_bytes()).unwrap();
        parse(&from_json(&r, span), Limits::default())
    }

    fn meta(text: &str) -> Metadata {
        let (r, span) = json::document(text.as_bytes()).unwrap();
        let Value::Map(m) = from_json(&r, span) else {
            panic!()
        };
        m.into_iter()
            .map(|(k, v)| {
                let k = k.as_str().unwrap().to_vec();
                let version = k.starts_with(b"v");
                (k.into_boxed_slice(), (v, version))
            })
            .collect()
    }

    #[test]
    fn both_forms_and_every_operator() {
        let m = meta(
            r#"{"s":"eu","i":5,"f":2.5,"v":"1.4.2","l":[1,"a",[2,3]],"m":{"a":{"b":[10,20]},"k":1}}"#,
        );
        for (query, want) in [
            (r#"{"ops":[{"s":{"$eq":"eu"}}]}"#, true),
            (r#"{"ops":[{"i":{"$eq":5.0}}]}"#, true),
            (r#"{"ops":[{"i":{"$in":[1,5]}}]}"#, true),
            (r#"{"ops":[{"zz":{"$nin":[1]}}]}"#, true),
            (r#"{"ops":[{"zz":{"$eq":1}}]}"#, false),
            (r#"{"ops":[{"v":{"$gt":"1.10.0"}}]}"#, false),
            (r#"{"ops":[{"v":{"$lt":"1.10.0"}}]}"#, true),
            (r#"{"ops":[{"l":{"$contains":"a"}}]}"#, true),
            (r#"{"ops":[{"m":{"$contains":"k"}}]}"#, true),
            (r#"{"ops":[{"/m/a/b/1":{"$eq":20}}]}"#, true),
            (
                r#"{"ops":[{"path":"/l/2/0","op":"$eq","to":{"value":2}}]}"#,
                true,
            ),
            (
                r#"{"ops":[{"path":"/f","op":"$lt","to":{"path":"/i"}}]}"#,
                true,
            ),
            (
                r#"{"ops":[{"op":"$nor","with":[{"path":"/i","op":"$eq","to":{"value":5}}]}]}"#,
                false,
            ),
            (r#"{"ops":[{"i":{"$or":[{"$eq":0},{"$gte":5}]}}]}"#, true),
        ] {
            assert_eq!(
                q(query).unwrap().matches(b"app", false, &m),
                want,
                "{query}"
            );
        }
    }

    #[test]
    fn malformed_and_oversized_queries_say_why() {
        for (query, reason) in [
            ("[]", "a query must be an object, got []"),
            (
                r#"{"ops":[{"a":{"$regex":1}}]}"#,
                "unknown operator '$regex'",
            ),
            (
                r#"{"ops":[{"a":5}]}"#,
                r#"a: expected {"$op": value}, got 5"#,
            ),
            (
                r#"{"ops":[{"a":{"$in":"x"}}]}"#,
                "$in takes a list, got 'x'",
            ),
            (
                r#"{"selector":{"$median":"x"}}"#,
                "unknown selector '$median'",
            ),
        ] {
            assert!(q(query).unwrap_err().message.contains(reason), "{query}");
        }
        let many = format!(
            r#"{{"ops":[{{"a":{{"$in":[{}]}}}}]}}"#,
            ["1"; 1025].join(",")
        );
        assert_eq!(q(&many).unwrap_err().bound, Some(Bound::List));
        let mut deep = r#"{"a":{"$eq":1}}"#.to_owned();
        for _ in 0..40 {
            deep = format!(r#"{{"$and":[{deep}]}}"#);
        }
        let deep = format!(r#"{{"ops":[{deep}]}}"#);
        let (r, span) = json::document_within(deep.as_bytes(), 100).unwrap();
        let err = parse(&from_json(&r, span), Limits::default()).unwrap_err();
        assert_eq!(err.bound, Some(Bound::Depth));
        let ops = format!(r#"{{"ops":[{}]}}"#, [r#"{"a":{"$eq":1}}"#; 9].join(","));
        let tight = Limits {
            max_ops: 8,
            ..Limits::default()
        };
        let (r, span) = json::document(ops.as_bytes()).unwrap();
        assert_eq!(
            parse(&from_json(&r, span), tight).unwrap_err().bound,
            Some(Bound::Ops)
        );
    }

    #[test]
    fn hints_ranges_and_exact() {
        let query = q(r#"{"ops":[{"k":{"$eq":1}}]}"#).unwrap();
        assert!(query.exact && query.hints.len() == 1);
        assert!(!q(r#"{"ops":[{"k":{"$eq":1,"$ne":2}}]}"#).unwrap().exact);
        let query = q(r#"{"ops":[{"k":{"$gt":1,"$gte":3,"$lt":9}}]}"#).unwrap();
        assert_eq!(query.ranges[0].low, Some((Value::Int(3), true)));
        assert_eq!(query.ranges[0].high, Some((Value::Int(9), false)));
    }
}
