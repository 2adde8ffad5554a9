//! Every identified client of the gateway (local ones and other instances' replicas) and the
//! indices a query starts from, so that matching does not scan every client:
//!
//! - by application, so `"application": "api"` never looks at other applications' clients;
//! - by top-level key and scalar value (booleans, numbers with 1 and 1.0 in one bucket,
//!   strings, versions by precedence), so a top-level `$eq`/`$in` starts from its bucket;
//! - by top-level key in numeric order, so a range (`$gt $gte $lt $lte`) reads a slice.
//!
//! [`Index::resolve`] is the whole routing decision of a SEND or BROADCAST (decisions 5 and
//! 6): match, the `optional` fallback, the selector, then `key` (rendezvous hashing) or one
//! at random for a SEND. Python's dialect and the fast path both call it.

use std::cmp::Ordering;
use std::collections::HashMap;

use super::query::{holds, Metadata, Query, Range, Selector};
use super::value::{num_cmp, version_key, Value, VersionKey};
use crate::forward::maps::IdMap;
use crate::forward::routes::ConnId;

/// One client as the matcher sees it.
#[derive(Debug, Default)]
pub struct Client {
    pub app: Box<[u8]>,
    pub id: Box<[u8]>,
    pub restricted: bool,
    /// its connection on this instance (None: another instance's client)
    pub conn: Option<ConnId>,
    /// the connection speaks JSON (the fast path writes only JSON frames)
    pub json: bool,
    pub meta: Metadata,
    /// its application's number while it is indexed (compared instead of the name; `add` sets it)
    pub(crate) app_no: u64,
}

/// A member's (application number, restricted): what a lone `$eq` checks, beside the handle,
/// so that a BROADCAST to a bucket reads no client twice.
type Tag = (u64, bool);

/// A set of client handles with O(1) insert and remove, iterated as a slice.
#[derive(Debug, Default)]
struct Bucket {
    members: Vec<u64>,
    tags: Vec<Tag>,
    at: IdMap<usize>,
}

impl Bucket {
    fn insert(&mut self, h: u64, tag: Tag) {
        if !self.at.contains_key(&h) {
            self.at.insert(h, self.members.len());
            self.members.push(h);
            self.tags.push(tag);
        }
    }

    fn remove(&mut self, h: u64) {
        if let Some(i) = self.at.remove(&h) {
            self.members.swap_remove(i);
            self.tags.swap_remove(i);
            if let Some(moved) = self.members.get(i) {
                self.at.insert(*moved, i);
            }
        }
    }
}

/// The bucket of a stored scalar (None: not indexed: lists, maps, null, NaN).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    B(bool),
    I(i64),
    Big(Box<str>),
    F(u64),
    S(Box<[u8]>),
    V(VersionKey),
}

const TWO_63: f64 = 9_223_372_036_854_775_808.0;

fn bucket(value: &Value, version: bool) -> Option<Key> {
    if version {
        return version_key(value).map(Key::V);
    }
    Some(match value {
        Value::Bool(b) => Key::B(*b),
        Value::Int(i) => Key::I(*i),
        Value::Big(b) => Key::Big(b.clone()),
        Value::Float(f) if f.is_nan() => return None,
        Value::Float(f) if f.fract() == 0.0 && f.abs() < TWO_63 => Key::I(*f as i64),
        Value::Float(f) if f.is_finite() && f.fract() == 0.0 => Key::Big(format!("{f:.0}").into()),
        Value::Float(f) => Key::F(f.to_bits()),
        Value::Str(s) => Key::S(s.clone()),
        _ => return None,
    })
}

fn sortable(value: &Value, version: bool) -> bool {
    !version && value.number().is_some() && !value.is_nan()
}

fn cmp(a: &Value, b: &Value) -> Ordering {
    num_cmp(a.number().expect("number"), b.number().expect("number")).unwrap_or(Ordering::Equal)
}

#[derive(Debug, Default)]
pub struct Index {
    pub clients: IdMap<Client>,
    /// application -> (its number, its clients)
    by_app: HashMap<Box<[u8]>, (u64, Bucket)>,
    apps_seen: u64,
    by_value: HashMap<Box<[u8]>, HashMap<Key, Bucket>>,
    by_number: HashMap<Box<[u8]>, Vec<(Value, u64)>>,
    rng: u64,
}

/// Where a query's candidates come from.
enum From<'a> {
    All,
    Bucket(&'a Bucket),
    Owned(Vec<u64>),
}

impl Index {
    /// `seed` fixes the SEND picks (the caller's: the core has no entropy of its own).
    pub fn new(seed: u64) -> Self {
        Index {
            rng: seed | 1,
            ..Index::default()
        }
    }

    pub fn add(&mut self, h: u64, mut client: Client) {
        self.remove(h);
        let seen = &mut self.apps_seen;
        let (no, members) = self.by_app.entry(client.app.clone()).or_insert_with(|| {
            *seen += 1;
            (*seen, Bucket::default())
        });
        members.insert(h, (*no, client.restricted));
        client.app_no = *no;
        let tag = (client.app_no, client.restricted);
        for (key, (value, version)) in &client.meta {
            self.index(h, tag, key, value, *version);
        }
        self.clients.insert(h, client);
    }

    pub fn remove(&mut self, h: u64) -> Option<Client> {
        let client = self.clients.remove(&h)?;
        if let Some((_, b)) = self.by_app.get_mut(&client.app) {
            b.remove(h);
            if b.members.is_empty() {
                self.by_app.remove(&client.app);
            }
        }
        for (key, (value, version)) in &client.meta {
            self.unindex(h, key, value, *version);
        }
        Some(client)
    }

    /// Write metadata values (later wins; `version` None keeps the key's type), re-indexed.
    pub fn set_values(&mut self, h: u64, values: Vec<(Box<[u8]>, Value, Option<bool>)>) {
        let Some(mut client) = self.clients.remove(&h) else {
            return;
        };
        for (key, value, version) in values {
            let old = client.meta.remove(&key);
            if let Some((v, ver)) = &old {
                self.unindex(h, &key, v, *ver);
            }
            let version = version.unwrap_or(old.is_some_and(|(_, ver)| ver));
            self.index(h, (client.app_no, client.restricted), &key, &value, version);
            client.meta.insert(key, (value, version));
        }
        self.clients.insert(h, client);
    }

    fn index(&mut self, h: u64, tag: Tag, key: &[u8], value: &Value, version: bool) {
        if sortable(value, version) {
            let sorted = self.by_number.entry(key.into()).or_default();
            let at = sorted.partition_point(|(v, _)| cmp(v, value) != Ordering::Greater);
            sorted.insert(at, (value.clone(), h));
        }
        if let Some(b) = bucket(value, version) {
            self.by_value
                .entry(key.into())
                .or_default()
                .entry(b)
                .or_default()
                .insert(h, tag);
        }
    }

    fn unindex(&mut self, h: u64, key: &[u8], value: &Value, version: bool) {
        if sortable(value, version) {
            if let Some(sorted) = self.by_number.get_mut(key) {
                let start = sorted.partition_point(|(v, _)| cmp(v, value) == Ordering::Less);
                if let Some(i) = sorted[start..].iter().position(|(_, m)| *m == h) {
                    sorted.remove(start + i);
                }
                if sorted.is_empty() {
                    self.by_number.remove(key);
                }
            }
        }
        let Some(b) = bucket(value, version) else {
            return;
        };
        if let Some(values) = self.by_value.get_mut(key) {
            if let Some(members) = values.get_mut(&b) {
                members.remove(h);
                if members.members.is_empty() {
                    values.remove(&b);
                }
            }
            if values.is_empty() {
                self.by_value.remove(key);
            }
        }
    }

    /// The smallest candidate set the query's application, hints and ranges allow (None: no
    /// client can match), and whether it is a hint's bucket (for `Query::exact`).
    fn candidates(&self, q: &Query) -> Option<(From<'_>, bool)> {
        let mut best = From::All;
        let mut size = self.clients.len();
        let mut hinted = false;
        if let Some(app) = &q.application {
            let members = &self.by_app.get(app)?.1;
            best = From::Bucket(members);
            size = members.members.len();
        }
        for (key, values) in &q.hints {
            let buckets = self.by_value.get(key)?;
            let mut first: Option<&Bucket> = None;
            let mut more: Vec<&[u64]> = Vec::new();
            for value in values {
                let version = version_key(value).map(Key::V);
                for k in bucket(value, false).iter().chain(version.iter()) {
                    if let Some(b) = buckets.get(k).filter(|b| !b.members.is_empty()) {
                        match first {
                            None => first = Some(b),
                            Some(_) => more.push(&b.members),
                        }
                    }
                }
            }
            let first = first?;
            let n = first.members.len() + more.iter().map(|f| f.len()).sum::<usize>();
            if n < size {
                hinted = true;
                size = n;
                best = if more.is_empty() {
                    From::Bucket(first)
                } else {
                    more.push(&first.members);
                    let mut all: Vec<u64> = more.concat();
                    all.sort_unstable();
                    all.dedup();
                    size = all.len();
                    From::Owned(all)
                };
            }
        }
        for range in &q.ranges {
            let sorted = self.by_number.get(&range.key)?;
            let (start, stop) = self.span(sorted, range);
            if start >= stop {
                return None;
            }
            if stop - start < size {
                size = stop - start;
                hinted = false;
                best = From::Owned(sorted[start..stop].iter().map(|(_, h)| *h).collect());
            }
        }
        Some((best, hinted))
    }

    fn span(&self, sorted: &[(Value, u64)], range: &Range) -> (usize, usize) {
        let start = match &range.low {
            None => 0,
            Some((low, true)) => sorted.partition_point(|(v, _)| cmp(v, low) == Ordering::Less),
            Some((low, false)) => sorted.partition_point(|(v, _)| cmp(v, low) != Ordering::Greater),
        };
        let stop = match &range.high {
            None => sorted.len(),
            Some((high, true)) => {
                sorted.partition_point(|(v, _)| cmp(v, high) != Ordering::Greater)
            }
            Some((high, false)) => sorted.partition_point(|(v, _)| cmp(v, high) == Ordering::Less),
        };
        (start, stop)
    }

    /// How many candidates a query reads (what the index saves; tests hold it to account).
    pub fn candidate_count(&self, q: &Query) -> usize {
        match self.candidates(q) {
            None => 0,
            Some((From::All, _)) => self.clients.len(),
            Some((From::Bucket(b), _)) => b.members.len(),
            Some((From::Owned(v), _)) => v.len(),
        }
    }

    /// Whether the client `h` matches `q`.
    pub fn matches(&self, q: &Query, h: u64) -> bool {
        self.clients
            .get(&h)
            .is_some_and(|c| q.matches(&c.app, c.restricted, &c.meta))
    }

    /// Every client the query matches (restricted ones only if it asks for them).
    pub fn matching(&self, q: &Query) -> Vec<u64> {
        let Some((from, hinted)) = self.candidates(q) else {
            return Vec::new();
        };
        let app = q
            .application
            .as_ref()
            .map(|a| self.by_app.get(a).map_or(0, |(no, _)| *no));
        let predicate = q.predicate.as_ref().filter(|_| !(hinted && q.exact));
        let ok = |h: &u64| {
            self.clients.get(h).is_some_and(|c| {
                app.is_none_or(|no| no == c.app_no)
                    && (q.restricted || !c.restricted)
                    && predicate.is_none_or(|p| holds(p, &c.meta))
            })
        };
        match from {
            From::All => {
                let mut all: Vec<u64> = self.clients.keys().copied().filter(|h| ok(h)).collect();
                all.sort_unstable();
                all
            }
            // a lone `$eq`'s bucket: its members' tags say all there is to check
            From::Bucket(b) if predicate.is_none() => b
                .members
                .iter()
                .zip(&b.tags)
                .filter(|(_, (no, restricted))| {
                    app.is_none_or(|a| a == *no) && (q.restricted || !restricted)
                })
                .map(|(h, _)| *h)
                .collect(),
            From::Bucket(b) => b.members.iter().copied().filter(|h| ok(h)).collect(),
            From::Owned(v) => v.into_iter().filter(|h| ok(h)).collect(),
        }
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64*: uniform enough to pick one receiver among the matches
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn selected(&self, q: &Query) -> Vec<u64> {
        let matches = self.matching(q);
        match &q.selector {
            Some((kind, key)) if !matches.is_empty() => {
                self.select(*kind, key, &matches).into_iter().collect()
            }
            _ => matches,
        }
    }

    /// The receivers of a SEND (one) or BROADCAST (all), per decisions 5 and 6.
    pub fn resolve(&mut self, q: &Query, broadcast: bool) -> Vec<u64> {
        let mut matches = self.selected(q);
        if matches.is_empty() && q.optional {
            matches = self.selected(&q.fallback());
        }
        if broadcast || matches.len() <= 1 {
            return matches;
        }
        if let Some(key) = &q.key {
            let best = matches
                .iter()
                .copied()
                .max_by_key(|h| self.clients.get(h).map_or(0, |c| rendezvous_weight(key, c)))
                .expect("matches");
            return vec![best];
        }
        let at = (self.next_random() % matches.len() as u64) as usize;
        vec![matches[at]]
    }

    /// Decision 6: the client with the smallest/largest number at `key`, or the one nearest
    /// the mean; ties go to the lowest (application, client id), so every instance agrees.
    pub fn select(&self, kind: Selector, key: &[u8], among: &[u64]) -> Option<u64> {
        let numbers: Vec<(&Value, &Client, u64)> = among
            .iter()
            .filter_map(|h| {
                let c = self.clients.get(h)?;
                let v = &c.meta.get(key)?.0;
                (v.number().is_some() && !v.is_nan()).then_some((v, c, *h))
            })
            .collect();
        let tie = |a: &Client, b: &Client| (&a.app, &a.id).cmp(&(&b.app, &b.id));
        let f = |v: &Value| match v {
            Value::Int(i) => *i as f64,
            Value::Float(f) => *f,
            Value::Big(b) => b.parse().unwrap_or(0.0),
            _ => 0.0,
        };
        let mean = numbers.iter().map(|(v, _, _)| f(v)).sum::<f64>() / numbers.len().max(1) as f64;
        numbers
            .iter()
            .min_by(|(va, ca, _), (vb, cb, _)| {
                let by = match kind {
                    Selector::Min => cmp(va, vb),
                    Selector::Max => cmp(vb, va),
                    Selector::Avg => (f(va) - mean)
                        .abs()
                        .partial_cmp(&(f(vb) - mean).abs())
                        .unwrap_or(Ordering::Equal),
                };
                by.then_with(|| tie(ca, cb))
            })
            .map(|(_, _, h)| *h)
    }
}

/// Highest-random-weight hashing: the same on every instance and across restarts, so a key's
/// target stays put while the match set is unchanged and only a leaving node's keys move.
/// The weight is BLAKE2b-64 of `key \0 application \0 client id`, read big-endian.
pub fn rendezvous_weight(key: &[u8], client: &Client) -> u64 {
    let text = [key, b"\0", &client.app, b"\0", &client.id].concat();
    u64::from_be_bytes(blake2b_64(&text))
}

const IV: [u64; 8] = [
    0x6a09_e667_f3bc_c908,
    0xbb67_ae85_84ca_a73b,
    0x3c6e_f372_fe94_f82b,
    0xa54f_f53a_5f1d_36f1,
    0x510e_527f_ade6_82d1,
    0x9b05_688c_2b3e_6c1f,
    0x1f83_d9ab_fb41_bd6b,
    0x5be0_cd19_137e_2179,
];

const SIGMA: [[usize; 16]; 10] = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
    [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4],
    [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
    [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13],
    [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
    [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11],
    [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
    [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5],
    [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
];

fn compress(h: &mut [u64; 8], block: &[u8; 128], t: u64, last: bool) {
    let mut m = [0u64; 16];
    for (i, word) in m.iter_mut().enumerate() {
        *word = u64::from_le_bytes(block[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    }
    let mut v = [0u64; 16];
    v[..8].copy_from_slice(h);
    v[8..].copy_from_slice(&IV);
    v[12] ^= t;
    if last {
        v[14] = !v[14];
    }
    let g = |v: &mut [u64; 16], a: usize, b: usize, c: usize, d: usize, x: u64, y: u64| {
        v[a] = v[a].wrapping_add(v[b]).wrapping_add(x);
        v[d] = (v[d] ^ v[a]).rotate_right(32);
        v[c] = v[c].wrapping_add(v[d]);
        v[b] = (v[b] ^ v[c]).rotate_right(24);
        v[a] = v[a].wrapping_add(v[b]).wrapping_add(y);
        v[d] = (v[d] ^ v[a]).rotate_right(16);
        v[c] = v[c].wrapping_add(v[d]);
        v[b] = (v[b] ^ v[c]).rotate_right(63);
    };
    for round in 0..12 {
        let s = &SIGMA[round % 10];
        g(&mut v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
        g(&mut v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
        g(&mut v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
        g(&mut v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
        g(&mut v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
        g(&mut v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
        g(&mut v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
        g(&mut v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for i in 0..8 {
        h[i] ^= v[i] ^ v[i + 8];
    }
}

/// BLAKE2b with an 8-byte digest, unkeyed (Python's `hashlib.blake2b(data, digest_size=8)`).
pub fn blake2b_64(data: &[u8]) -> [u8; 8] {
    let mut h = IV;
    h[0] ^= 0x0101_0000 ^ 8;
    let mut t = 0u64;
    let mut chunks = data.chunks(128).peekable();
    if chunks.peek().is_none() {
        compress(&mut h, &[0; 128], 0, true);
    }
    while let Some(chunk) = chunks.next() {
        let mut block = [0u8; 128];
        block[..chunk.len()].copy_from_slice(chunk);
        t += chunk.len() as u64;
        compress(&mut h, &block, t, chunks.peek().is_none());
    }
    h[0].to_le_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::json;
    use crate::dialects::singyeong::query::{parse, Limits};
    use crate::dialects::singyeong::value::from_json;

    fn q(text: &str) -> Query {
        let (r, span) = json::document(text.as_bytes()).unwrap();
        parse(&from_json(&r, span), Limits::default()).unwrap()
    }

    fn client(app: &str, id: &str, values: &[(&str, Value)]) -> Client {
        Client {
            app: app.as_bytes().into(),
            id: id.as_bytes().into(),
            json: true,
            meta: values
                .iter()
                .map(|(k, v)| (k.as_bytes().into(), (v.clone(), false)))
                .collect(),
            ..Client::default()
        }
    }

    #[test]
    fn blake2b_is_hashlib_s() {
        // hashlib.blake2b(b"", digest_size=8).hexdigest(), and of b"abc"
        assert_eq!(blake2b_64(b""), 0xe4a6a0577479b2b4u64.to_be_bytes());
        assert_eq!(blake2b_64(b"abc"), 0xd8bb14d833d59559u64.to_be_bytes());
        assert_eq!(blake2b_64(&[7; 300]), 0x8a12922e4765be74u64.to_be_bytes());
    }

    #[test]
    fn the_index_agrees_with_a_scan_and_narrows() {
        let mut ix = Index::new(3);
        for n in 0..300i64 {
            let region = ["eu", "us", "ap"][(n % 3) as usize];
            ix.add(
                n as u64,
                client(
                    &format!("app{}", n % 3),
                    &format!("c{n}"),
                    &[("region", Value::str(region)), ("load", Value::Int(n % 10))],
                ),
            );
        }
        for text in [
            r#"{"application":"app1","ops":[{"region":{"$eq":"us"}}]}"#,
            r#"{"ops":[{"load":{"$eq":3.0}}]}"#,
            r#"{"ops":[{"load":{"$in":[1,2]}},{"region":{"$ne":"eu"}}]}"#,
            r#"{"ops":[{"load":{"$gte":3}},{"load":{"$lt":5}}]}"#,
            r#"{"ops":[{"load":{"$gt":3.5,"$lte":8}}]}"#,
            r#"{"ops":[{"load":{"$gt":5}},{"load":{"$lt":2}}]}"#,
            r#"{"application":"nobody"}"#,
        ] {
            let query = q(text);
            let mut want: Vec<u64> = ix
                .clients
                .iter()
                .filter(|(_, c)| query.matches(&c.app, false, &c.meta))
                .map(|(h, _)| *h)
                .collect();
            let mut got = ix.matching(&query);
            want.sort_unstable();
            got.sort_unstable();
            assert_eq!(got, want, "{text}");
        }
        assert_eq!(
            ix.candidate_count(&q(r#"{"application":"app1","ops":[{"load":{"$eq":3}}]}"#)),
            30
        );
        assert_eq!(
            ix.candidate_count(&q(r#"{"ops":[{"load":{"$gte":3}},{"load":{"$lt":5}}]}"#)),
            60
        );
        ix.set_values(3, vec![(b"load".as_slice().into(), Value::Int(4), None)]);
        assert!(!ix
            .matching(&q(r#"{"ops":[{"load":{"$eq":3}}]}"#))
            .contains(&3));
        assert!(ix
            .matching(&q(r#"{"ops":[{"load":{"$gt":3.5,"$lt":4.5}}]}"#))
            .contains(&3));
        ix.remove(4);
        assert!(!ix
            .matching(&q(r#"{"ops":[{"load":{"$gte":4}}]}"#))
            .contains(&4));
    }

    #[test]
    fn resolve_picks_by_selector_key_or_at_random() {
        let mut ix = Index::new(9);
        for n in 0..10i64 {
            ix.add(
                n as u64,
                client("a", &format!("c{n}"), &[("k", Value::Int(n))]),
            );
        }
        assert_eq!(
            ix.resolve(&q(r#"{"selector":{"$max":"k"}}"#), false),
            vec![9]
        );
        assert_eq!(
            ix.resolve(&q(r#"{"selector":{"$avg":"k"}}"#), false),
            vec![4]
        );
        let keyed = q(r#"{"key":"user-1"}"#);
        let first = ix.resolve(&keyed, false);
        assert_eq!(ix.resolve(&keyed, false), first);
        assert_eq!(ix.resolve(&q("{}"), true).len(), 10);
        let opt = q(r#"{"optional":true,"ops":[{"k":{"$eq":99}}]}"#);
        assert_eq!(ix.resolve(&opt, false).len(), 1);
        assert!(ix
            .resolve(&q(r#"{"ops":[{"k":{"$eq":99}}]}"#), false)
            .is_empty());
    }
}
