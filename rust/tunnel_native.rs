//! The tunnel's native express table: the common relay-mode request served without a Python
//! object of its own, from the client's read to the connector's outbox and from the
//! connector's `Deliver` to the client's outbox.
//!
//! Why: with the express path (`dialects/tunnel/express.py`) each tunnelled request still cost
//! the relay ~14 us of user time at 1 KiB x 64, spread thin over Python bookkeeping: a request
//! id, a `ClientRequest`, a `Job`, a waiter, the memory budget, the deadline queue, counters,
//! the HTTP connection's per-request state (py-spy, issue #13). The relay is the tunnel's
//! bottleneck (one process, busy or waiting for a core ~95% of the time at full load), so
//! that time is the rate. Here the job lives in this table instead: one Rust call per client
//! read parses the request and, when it is the common case, encodes its `RequestTarget` into
//! the connector's outbox; the connector's decoder answers the `Deliver` into the client's
//! outbox while it decodes the read. Python keeps the rare events: a client that goes away,
//! the response deadline (a periodic `expired`), a connector that leaves, a `Deliver` this
//! table does not answer (it `take`s the job and Python answers as the express path does).
//!
//! Served here only when all of these hold, else declined (the reason counted when the path is
//! a `/relay/` one) and the read's events go to Python as `HttpStreamParser.feed` gives them:
//! - the whole request (head and a Content-Length body of at most `max_body`) is this read,
//!   nothing after it; not HEAD, not an upgrade, no `Expect`, kept alive, one `Host`;
//! - `/relay/{tenant}/{target}/...` with both segments free of `%`, the tenant registered
//!   here (`set_tenant`: any acknowledge mode) with a connector whose outbox accepts, and
//!   the bearer token, when the tenant requires one, one the relay verified (`add_token`) for
//!   this tenant and not past its end;
//! - nothing of the tenant queued on the Python path (`outside`: a request here would overtake
//!   them), and when it has a concurrency limit (`Sharing`), its jobs in flight on this relay,
//!   the table's and Python's, under it. While Python has some of its jobs queued the table
//!   also leaves the tenant's `Deliver`s to Python, whose answer sends the next queued job
//!   (hub.py's `pump`): a slot freed here would otherwise wait for a Python job to free one;
//! - the tenant's lease of the memory budget (`set_tenant`) has room for the job's size
//!   (hub.py's `held_size`: `JOB_OVERHEAD` + body + URL + header characters);
//! - 16 bytes of the caller's entropy are left for the request id (a version-4 UUID, as
//!   ids.py makes them; `refill`).
//!
//! Acknowledge modes 1 (ConnectorReceived), 2 (ConnectorFinished) and 3 (Manual) as hub.py
//! keeps them: the job stays here until it was acknowledged *and* answered (the client's
//! answer does not wait for the acknowledgement); it keeps a copy of its body until
//! acknowledged, so that when its connector leaves first `connector_left` hands it to Python
//! to send again (at least once: the target may see it twice). The connector's `Acknowledge`
//! (modes 1 and 2) is taken by the same scanner as its `Deliver`s; a manual one comes from
//! the acknowledge URL (`acknowledge_manual`), whose token is 24 bytes of the caller's
//! entropy as `secrets.token_urlsafe(24)` writes them.
//!
//! Sans-I/O: the time is an argument (the dialect's clock, ns), randomness comes from Python.

use std::collections::HashMap;

use crate::codec::http::{Framing, RequestHead};
use crate::forward::maps::IdMap;
use crate::forward::outboxes::Outboxes;
use crate::forward::routes::ConnId;
use crate::tunnel_express::{answer, request_headers};
use base64::Engine as _;

use crate::codec::ws::{OP_BINARY, OP_TEXT};
use crate::dialects::tunnel::wire::{
    decode, encode_client_request, ClientRequestRef, FieldValue, Json, Msgpack,
};

/// hub.py's `JOB_OVERHEAD`: what a job costs the memory budget beyond its text and body.
pub const JOB_OVERHEAD: u64 = 1330;
/// Bytes of entropy one request id takes.
const ID_BYTES: usize = 16;
/// Bytes of entropy a manual acknowledge URL's token takes (hub.py's `token_urlsafe(24)`).
const TOKEN_BYTES: usize = 24;
/// The manual acknowledgement mode.
const MANUAL: u8 = 3;
/// The methods the tunnel's client routes serve (dialect.py `METHODS`), HEAD left to Python.
const METHODS: [&str; 6] = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"];
/// Verified tokens remembered at most (all forgotten when full: Python teaches them again).
const TOKENS: usize = 4096;

/// A connector of a registered tenant.
#[derive(Debug, Clone, Copy)]
pub struct Connector {
    pub id: ConnId,
    /// msgpack (binary frames) or JSON (text frames)
    pub binary: bool,
    /// its jobs in flight on the Python path (`outside`), for least in flight
    pub outside: u32,
}

/// How a tenant's connectors share its requests (decision 7), as Python's hub shares them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sharing {
    /// at most this many of the tenant's jobs in flight on this relay (0: no limit)
    pub limit: u32,
    /// the connector with the fewest jobs in flight (the table's and Python's) first, ties
    /// in turn; false: round robin
    pub least_inflight: bool,
}

/// A tenant the table serves.
#[derive(Debug, Clone)]
pub struct Tenant {
    /// the tenant's name as stored (the `tenantName` sent, the metric label)
    pub name: String,
    pub require_auth: bool,
    /// the budget bytes Python charged to the tenant for this table's jobs
    pub lease: u64,
    /// of the lease, what the jobs in flight hold
    pub held: u64,
    /// its jobs in flight
    pub inflight: u32,
    /// Python has jobs of it queued (`outside`): new requests and answers are Python's
    pub queued: bool,
    pub sharing: Sharing,
    pub connectors: Vec<Connector>,
    next: usize,
    /// new requests are served here (false: declined, jobs in flight still answered)
    pub enabled: bool,
    /// the acknowledge mode its requests are sent with (0, 1 or 2)
    pub ack_mode: u8,
}

/// A request sent to a connector and not answered yet.
#[derive(Debug)]
pub struct Job {
    /// the client's connection; None once it went away or timed out (the answer is dropped)
    pub client: Option<ConnId>,
    /// the tenant's key (normalized name)
    pub tenant: String,
    pub connector: ConnId,
    pub size: u64,
    /// the client's answer is due by then (ns, the caller's clock): 504 after
    pub deadline: i64,
    pub target: String,
    /// the client half-closed: its answer is Python's (it closes the connection)
    pub client_done: bool,
    /// the request's head, for Python when it answers (`take`)
    pub head: Option<RequestHead>,
    /// when the table took it (the caller's clock, ns): the route record's time in the relay
    pub started: i64,
    /// the request body's bytes (the route record's size)
    pub body: u64,
    /// the acknowledge mode it was sent with (0, 1 or 2)
    pub ack_mode: u8,
    /// no longer in flight: its connector's `Deliver` came (the client was answered, or had
    /// gone; in the table it is then kept only to be acknowledged), or it left the table
    pub answered: bool,
    /// the request body while the job is not acknowledged (sent again if its connector
    /// leaves); None: acknowledged (mode 0: from the start)
    pub body_copy: Option<Vec<u8>>,
    /// the manual acknowledge URL's token (mode 3), else empty
    pub ack_token: String,
}

/// The route record (`--records`) of a request the table answered: client.py's `_Record` of
/// the same outcome, in the caller's clock (Python moves it into the records' clock when it
/// takes them, `take_records`). No source: clients are anonymous; the route is `local`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelRecord {
    /// when the answer was made (ns)
    pub time: i64,
    /// `tenant/target`
    pub dst: String,
    pub size: u64,
    pub outcome: &'static str,
    pub reason: Option<&'static str>,
    /// from the request's read to its answer (ns)
    pub relay_ns: i64,
}

/// The records' reasons of a 503 (client.py's `CONNECTOR_UNAVAILABLE`) and of a 504 (client.py's
/// `handle`).
const CONNECTOR_UNAVAILABLE: &str = "connector unavailable";
const RECORD_NO_ANSWER: &str = "no answer in time";

/// What a connector that left leaves to Python (`NativeTunnel::connector_left`).
#[derive(Debug, Default)]
pub struct Left {
    /// clients still waiting whose job the connector had acknowledged (or mode 0): Python
    /// answers them 503 (counted here), with the request method
    pub clients: Vec<(ConnId, String)>,
    /// jobs not acknowledged, by request id, out of the table: Python sends them again (at
    /// least once), answering their client if it still waits
    pub again: Vec<(String, Job)>,
    /// the tenant's lease when it has no connector left (the tenant is forgotten; Python
    /// gives the lease back to the budget)
    pub lease: Option<u64>,
}

impl Job {
    /// Acknowledged (mode 0: from the start): it no longer keeps its body.
    pub fn acked(&self) -> bool {
        self.body_copy.is_none()
    }
}

/// Why a request was left to Python (counted by reason).
pub type Decline = &'static str;

/// The table (module docstring).
#[derive(Debug, Default)]
pub struct NativeTunnel {
    pub origin_id: String,
    /// TTL + response timeout (ns): the client's answer is due that long after the request
    pub span: i64,
    /// the `expiresIn` told to connectors (ms)
    pub expires_in: i64,
    /// largest body served here
    pub max_body: usize,
    pub tenants: HashMap<String, Tenant>,
    /// bearer token -> (tenant key, the last second it is good: the tokens' clock, unix s)
    tokens: HashMap<String, (String, i64)>,
    pub jobs: HashMap<String, Job>,
    by_client: IdMap<String>,
    /// jobs in flight by connector: a connector with none (one of a tenant not served here)
    /// has nothing to `deliver`, and its messages go to Python undecoded
    by_connector: IdMap<u32>,
    entropy: Vec<u8>,
    used: usize,
    /// answers by (tenant name, target or "-", status): Python reads them at scrape
    pub requests: HashMap<(String, String, u16), u64>,
    /// HTTP answers by (method, status), as the listener counts them
    pub http: HashMap<(String, u16), u64>,
    pub declined: HashMap<Decline, u64>,
    pub taken: u64,
    pub answered: u64,
    /// jobs not acknowledged yet (modes 1 and 2): while there are none, a connector's
    /// message that is not a `Deliver` is not looked at for an `Acknowledge`
    pub unacked: u32,
    /// route records are kept (`--records`) in `records`, for Python to take
    pub recording: bool,
    pub records: Vec<TunnelRecord>,
}

/// The route record of `job` answered at `now` (`name`: its tenant's).
fn record_of(
    job: &Job,
    name: &str,
    now: i64,
    outcome: &'static str,
    reason: Option<&'static str>,
) -> TunnelRecord {
    TunnelRecord {
        time: now,
        dst: format!("{name}/{}", job.target),
        size: job.body,
        outcome,
        reason,
        relay_ns: (now - job.started).max(0),
    }
}

/// The job is no longer in flight (answered, or leaving the table): its client and the
/// in-flight counts let go of, once. (The table's maps, borrowed apart from its jobs.)
fn settle(
    job: &mut Job,
    tenants: &mut HashMap<String, Tenant>,
    by_connector: &mut IdMap<u32>,
    by_client: &mut IdMap<String>,
) {
    if job.answered {
        return;
    }
    job.answered = true;
    if let Some(client) = job.client {
        by_client.remove(&client);
    }
    if let Some(t) = tenants.get_mut(&job.tenant) {
        t.inflight -= 1;
    }
    if let Some(n) = by_connector.get_mut(&job.connector) {
        *n -= 1;
        if *n == 0 {
            by_connector.remove(&job.connector);
        }
    }
}

/// `a == b` in a time that does not depend on where they differ (`secrets.compare_digest`).
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |diff, (x, y)| diff | (x ^ y))
            == 0
}

/// The job's request method (what the listener counts its answer under).
fn method_of(job: &Job) -> String {
    job.head
        .as_ref()
        .map_or_else(String::new, |h| h.method.clone())
}

/// `ids.py`'s text of 16 random bytes as a version-4 UUID.
fn uuid4(raw: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    const VARIANT: &[u8; 4] = b"89ab";
    let mut h = [0u8; 32];
    for (i, b) in raw.iter().enumerate() {
        h[2 * i] = HEX[(b >> 4) as usize];
        h[2 * i + 1] = HEX[(b & 15) as usize];
    }
    let mut s = String::with_capacity(36);
    let part = |s: &mut String, from: usize, to: usize| {
        s.extend(h[from..to].iter().map(|&c| char::from(c)));
    };
    part(&mut s, 0, 8);
    s.push('-');
    part(&mut s, 8, 12);
    s.push_str("-4");
    part(&mut s, 13, 16);
    s.push('-');
    s.push(char::from(VARIANT[((raw[8] >> 4) & 3) as usize]));
    part(&mut s, 17, 20);
    s.push('-');
    part(&mut s, 20, 32);
    s
}

/// The token of an `Authorization: Bearer ...` value, as tokens.py's `bearer` reads it;
/// None for anything else, and for values that are not plain printable ASCII (Python's
/// whitespace rules then decide, on its path).
fn bearer(value: &[u8]) -> Option<&str> {
    if !value.iter().all(|b| (0x20..0x7f).contains(b)) {
        return None;
    }
    let text = std::str::from_utf8(value).ok()?.trim_matches(' ');
    let (scheme, token) = text.split_once(' ')?;
    let token = token.trim_matches(' ');
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

impl NativeTunnel {
    pub fn new(origin_id: String, ttl: i64, span: i64, max_body: usize) -> Self {
        NativeTunnel {
            origin_id,
            span,
            expires_in: (ttl / 1_000_000).max(1),
            max_body,
            ..Self::default()
        }
    }

    /// More random bytes for request ids (what is left is kept).
    pub fn refill(&mut self, entropy: &[u8]) {
        self.entropy.drain(..self.used);
        self.used = 0;
        self.entropy.extend_from_slice(entropy);
    }

    /// Ids the entropy left makes.
    pub fn ids_left(&self) -> usize {
        (self.entropy.len() - self.used) / ID_BYTES
    }

    /// The tenant is served here with these settings; `lease` more budget bytes are its.
    pub fn set_tenant(
        &mut self,
        key: &str,
        name: &str,
        require_auth: bool,
        lease: u64,
        sharing: Sharing,
        ack_mode: u8,
    ) {
        let t = self
            .tenants
            .entry(key.to_owned())
            .or_insert_with(|| Tenant {
                name: name.to_owned(),
                require_auth,
                lease: 0,
                held: 0,
                inflight: 0,
                queued: false,
                sharing,
                connectors: Vec::new(),
                next: 0,
                enabled: true,
                ack_mode,
            });
        t.name = name.to_owned();
        t.require_auth = require_auth;
        t.lease += lease;
        t.sharing = sharing;
        t.enabled = true;
        t.ack_mode = ack_mode;
    }

    /// What Python's hub has of the tenant: jobs queued or not, and its jobs in flight by
    /// connector (`counts`; a connector not named has none).
    pub fn outside(&mut self, key: &str, queued: bool, counts: &[(ConnId, u32)]) {
        let Some(t) = self.tenants.get_mut(key) else {
            return;
        };
        t.queued = queued;
        for c in &mut t.connectors {
            c.outside = counts
                .iter()
                .find(|(id, _)| *id == c.id)
                .map_or(0, |(_, n)| *n);
        }
    }

    /// The connector's jobs in flight here.
    pub fn connector_inflight(&self, id: ConnId) -> u32 {
        self.by_connector.get(&id).copied().unwrap_or(0)
    }

    /// The index of the connector of `t` the next job goes to (`Sharing`).
    fn pick(&self, t: &Tenant) -> usize {
        let count = t.connectors.len();
        let first = t.next % count;
        if !t.sharing.least_inflight {
            return first;
        }
        (0..count)
            .map(|step| (first + step) % count)
            .min_by_key(|&i| {
                let c = &t.connectors[i];
                self.connector_inflight(c.id) + c.outside
            })
            .expect("the tenant has a connector")
    }

    /// New requests of the tenant go to Python (its settings changed); jobs in flight stay.
    pub fn disable(&mut self, key: &str) {
        if let Some(t) = self.tenants.get_mut(key) {
            t.enabled = false;
        }
    }

    pub fn add_connector(&mut self, key: &str, id: ConnId, binary: bool) {
        if let Some(t) = self.tenants.get_mut(key) {
            if !t.connectors.iter().any(|c| c.id == id) {
                t.connectors.push(Connector {
                    id,
                    binary,
                    outside: 0,
                });
            }
        }
    }

    /// The connector is gone: its jobs leave the table (`Left`).
    pub fn connector_left(&mut self, key: &str, id: ConnId, now: i64) -> Left {
        let gone: Vec<String> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.connector == id)
            .map(|(r, _)| r.clone())
            .collect();
        let mut left = Left::default();
        for request_id in gone {
            let Some(job) = self.remove(&request_id) else {
                continue;
            };
            if !job.acked() {
                left.again.push((request_id, job));
            } else if let Some(client) = job.client {
                let name = self.count_answer(&job.tenant, "-".into(), 503);
                if self.recording {
                    let reason = Some(CONNECTOR_UNAVAILABLE);
                    self.records
                        .push(record_of(&job, &name, now, "rejected", reason));
                }
                left.clients.push((client, method_of(&job)));
            }
        }
        if let Some(t) = self.tenants.get_mut(key) {
            t.connectors.retain(|c| c.id != id);
            if t.connectors.is_empty() && t.held == 0 {
                left.lease = Some(t.lease);
                self.tenants.remove(key);
            }
        }
        left
    }

    /// Every tenant forgotten, every job dropped (the relay is shutting down): the clients
    /// still waiting, and the leases to give back.
    pub fn close(&mut self) -> (Vec<(ConnId, String)>, u64) {
        let clients = self
            .jobs
            .values()
            .filter_map(|j| j.client.map(|c| (c, method_of(j))))
            .collect();
        let lease = self.tenants.values().map(|t| t.lease).sum();
        self.jobs.clear();
        self.by_client.clear();
        self.by_connector.clear();
        self.tenants.clear();
        self.unacked = 0;
        (clients, lease)
    }

    fn tenant_name(&self, key: &str) -> String {
        self.tenants
            .get(key)
            .map_or_else(|| key.to_owned(), |t| t.name.clone())
    }

    /// One answer counted under (the tenant's name, `target`, `status`); the name.
    fn count_answer(&mut self, key: &str, target: String, status: u16) -> String {
        let name = self.tenant_name(key);
        *self
            .requests
            .entry((name.clone(), target, status))
            .or_default() += 1;
        name
    }

    /// A token Python verified for the tenant `key`, good up to the second `until` (the
    /// tokens' clock, unix seconds).
    pub fn add_token(&mut self, token: &str, key: &str, until: i64) {
        if self.tokens.len() >= TOKENS {
            self.tokens.clear();
        }
        self.tokens
            .insert(token.to_owned(), (key.to_owned(), until));
    }

    fn decline(&mut self, why: Decline) -> Decline {
        *self.declined.entry(why).or_default() += 1;
        why
    }

    /// Serve the request (module docstring): its job is in the table and its message in the
    /// connector's outbox; the request id. The head is the caller's to `attach`. `now`: the
    /// hub's clock (ns) for the response deadline; `wall`: the tokens' clock (unix seconds).
    pub fn offer(
        &mut self,
        head: &RequestHead,
        body: &[u8],
        client: ConnId,
        (now, wall): (i64, i64),
        outboxes: &mut Outboxes,
    ) -> Result<String, Decline> {
        if !head.path.starts_with("/relay/") {
            // not a tunnel client request (the metrics, a token, a connector): not counted
            return Err("other");
        }
        if !head.keep_alive
            || head.is_websocket_upgrade
            || head.expect_continue
            || !METHODS.contains(&head.method.as_str())
        {
            return Err(self.decline("request"));
        }
        match head.framing {
            Framing::Length(n) if n as usize <= self.max_body && n as usize == body.len() => {}
            _ => return Err(self.decline("request")),
        }
        let hosts = head.headers.iter().filter(|(n, _)| n == "host").count();
        if hosts != 1 && !(hosts == 0 && head.version == 0) {
            return Err(self.decline("request"));
        }
        let mut parts = head.path.splitn(5, '/');
        let (Some(""), Some("relay"), Some(tenant), Some(target)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(self.decline("path"));
        };
        let rest = parts.next().unwrap_or("");
        if tenant.is_empty() || target.is_empty() || tenant.contains('%') || target.contains('%') {
            return Err(self.decline("path"));
        }
        if !tenant.is_ascii() {
            return Err(self.decline("tenant"));
        }
        let key = tenant.to_ascii_uppercase();
        let Some(t) = self.tenants.get(&key) else {
            return Err(self.decline("tenant"));
        };
        if !t.enabled {
            return Err(self.decline("tenant"));
        }
        if t.require_auth {
            let good = head
                .header("authorization")
                .and_then(bearer)
                .and_then(|tok| self.tokens.get(tok))
                .is_some_and(|(k, until)| *k == key && wall <= *until);
            if !good {
                return Err(self.decline("auth"));
            }
        }
        if t.connectors.is_empty() {
            return Err(self.decline("no connector"));
        }
        if t.queued {
            return Err(self.decline("queued"));
        }
        let limit = t.sharing.limit;
        if limit > 0 && t.inflight + t.connectors.iter().map(|c| c.outside).sum::<u32>() >= limit {
            return Err(self.decline("limit"));
        }
        let index = self.pick(t);
        let connector = t.connectors[index];
        if !outboxes.accepts(connector.id) {
            return Err(self.decline("congested"));
        }
        let url = match &head.query {
            Some(q) => format!("{rest}?{q}"),
            None => rest.to_owned(),
        };
        let (headers, text) =
            request_headers(head.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())));
        let size = JOB_OVERHEAD + (body.len() + url.chars().count() + text) as u64;
        if t.held + size > t.lease {
            return Err(self.decline("budget"));
        }
        let manual = t.ack_mode == MANUAL;
        let needed = ID_BYTES + if manual { TOKEN_BYTES } else { 0 };
        if self.entropy.len() - self.used < needed {
            return Err(self.decline("entropy"));
        }
        let request_id = uuid4(&self.entropy[self.used..self.used + ID_BYTES]);
        self.used += ID_BYTES;
        if self.jobs.contains_key(&request_id) {
            return Err(self.decline("entropy"));
        }
        let (ack_token, ack_url) = if manual {
            let raw = &self.entropy[self.used..self.used + TOKEN_BYTES];
            self.used += TOKEN_BYTES;
            let token = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw);
            let url = format!(
                "/tunnel/acknowledge/{}/{request_id}/{token}",
                self.origin_id
            );
            (token, Some(url))
        } else {
            (String::new(), None)
        };
        let length = body.len() as i64;
        let fields = ClientRequestRef {
            request_id: &request_id,
            request_origin_id: &self.origin_id,
            target,
            tenant_name: &t.name,
            http_method: &head.method,
            url: &url,
            http_headers: &headers,
            acknowledge_mode: i64::from(t.ack_mode),
            acknowledge_origin_id: Some(&self.origin_id),
            original_body_size: length,
            body_size: length,
            body_content: (!body.is_empty()).then_some(body),
            enable_tracing: false,
            discard_connector_response: false,
            expires_in: Some(self.expires_in),
            acknowledge_url: ack_url.as_deref(),
        };
        let (message, opcode) = if connector.binary {
            let sink = Msgpack::with_capacity(256 + body.len());
            (encode_client_request(sink, &fields), OP_BINARY)
        } else {
            let sink = Json::with_capacity(384 + body.len() * 4 / 3);
            (encode_client_request(sink, &fields), OP_TEXT)
        };
        outboxes.forward(connector.id, opcode, message.len(), |out| {
            out.copy_from_slice(&message)
        });
        let t = self.tenants.get_mut(&key).expect("looked up above");
        let ack_mode = t.ack_mode;
        t.next = index + 1;
        t.held += size;
        t.inflight += 1;
        *self.by_connector.entry(connector.id).or_default() += 1;
        self.by_client.insert(client, request_id.clone());
        self.jobs.insert(
            request_id.clone(),
            Job {
                client: Some(client),
                tenant: key,
                connector: connector.id,
                size,
                deadline: now + self.span,
                target: target.to_owned(),
                client_done: false,
                head: None,
                started: now,
                body: body.len() as u64,
                ack_mode,
                answered: false,
                body_copy: (ack_mode != 0).then(|| body.to_vec()),
                ack_token,
            },
        );
        if ack_mode != 0 {
            self.unacked += 1;
        }
        self.taken += 1;
        Ok(request_id)
    }

    /// The job's head, kept for Python (`take`).
    pub fn attach(&mut self, request_id: &str, head: RequestHead) {
        if let Some(job) = self.jobs.get_mut(request_id) {
            job.head = Some(head);
        }
    }

    /// The job leaves the table: its lease bytes (and, in flight, its counts) are given back.
    fn remove(&mut self, request_id: &str) -> Option<Job> {
        let mut job = self.jobs.remove(request_id)?;
        if let Some(t) = self.tenants.get_mut(&job.tenant) {
            t.held -= job.size;
        }
        settle(
            &mut job,
            &mut self.tenants,
            &mut self.by_connector,
            &mut self.by_client,
        );
        if !job.acked() {
            self.unacked -= 1;
        }
        Some(job)
    }

    /// The job's `Deliver` came: when acknowledged, it leaves the table (returned); else it
    /// stays, answered and without its client, until acknowledged or its connector leaves.
    fn finish(&mut self, request_id: &str) -> Option<Job> {
        let job = self.jobs.get_mut(request_id)?;
        if job.acked() {
            return self.remove(request_id);
        }
        settle(
            job,
            &mut self.tenants,
            &mut self.by_connector,
            &mut self.by_client,
        );
        job.client = None;
        None
    }

    /// The connector's `Acknowledge` of `request_id`: the job is done when answered too.
    /// False: not a job of this table sent to that connector (Python says so).
    /// (A manual job is not acknowledged this way: false.)
    pub fn acknowledge(&mut self, request_id: &str, connector: ConnId) -> bool {
        match self.jobs.get(request_id) {
            Some(job) if job.connector == connector && job.ack_mode != MANUAL => {
                self.acked(request_id);
                true
            }
            _ => false,
        }
    }

    /// The manual acknowledge URL of `request_id` was called with `token`: false for an
    /// unknown job, one not in manual mode or already acknowledged, or a wrong token.
    pub fn acknowledge_manual(&mut self, request_id: &str, token: &str) -> bool {
        match self.jobs.get(request_id) {
            Some(job)
                if job.ack_mode == MANUAL && !job.acked() && same_secret(&job.ack_token, token) =>
            {
                self.acked(request_id);
                true
            }
            _ => false,
        }
    }

    /// The job was acknowledged: it leaves the table when answered too.
    fn acked(&mut self, request_id: &str) {
        let Some(job) = self.jobs.get_mut(request_id) else {
            return;
        };
        if job.body_copy.take().is_none() {
            return; // acknowledged already
        }
        self.unacked -= 1;
        if job.answered {
            self.remove(request_id);
        }
    }

    /// A connector's message: when it is the `Deliver` of a job of this table sent to that
    /// connector, for a client still waiting, with an answer `tunnel_express::answer` encodes
    /// and the client keeps its connection for (status < 400, not half-closed), the answer goes
    /// into the client's outbox and the job is done: the client. A `Deliver` with an inline
    /// body for a client gone is dropped here too (None, and `true` in the second place).
    /// Anything else: (None, false), the message is Python's (which may `take` the job).
    pub fn deliver(
        &mut self,
        data: &[u8],
        binary: bool,
        connector: ConnId,
        now: i64,
        outboxes: &mut Outboxes,
    ) -> (Option<ConnId>, bool) {
        if self.unacked == 0 && !self.by_connector.contains_key(&connector) {
            return (None, false);
        }
        let Some(got) = answer(data, binary) else {
            let done = self.unacked > 0 && self.acknowledge_message(data, binary, connector);
            return (None, done);
        };
        let Some(job) = self.jobs.get(&got.request_id) else {
            return (None, false);
        };
        if job.connector != connector || self.tenants.get(&job.tenant).is_some_and(|t| t.queued) {
            return (None, false);
        }
        if job.answered {
            return (None, true); // a second `Deliver`: dropped, as the hub drops it
        }
        let Some(client) = job.client else {
            self.finish(&got.request_id);
            return (None, true);
        };
        if job.client_done || got.status >= 400 {
            return (None, false);
        }
        let record = self.recording.then(|| {
            let name = self.tenant_name(&job.tenant);
            record_of(job, &name, now, "delivered", None)
        });
        outboxes.push_marked(client, &got.bytes);
        let (key, target, method) = match self.finish(&got.request_id) {
            Some(job) => {
                let method = method_of(&job);
                (job.tenant, job.target, method)
            }
            None => {
                // kept until acknowledged
                let job = &self.jobs[&got.request_id];
                (job.tenant.clone(), job.target.clone(), method_of(job))
            }
        };
        if let Some(record) = record {
            self.records.push(record);
        }
        let target = if got.status == 404 {
            "-".into()
        } else {
            target
        };
        self.count_answer(&key, target, got.status);
        *self.http.entry((method, got.status)).or_default() += 1;
        self.answered += 1;
        (Some(client), true)
    }

    /// `data` as an `Acknowledge` of a job of this table sent to `connector`: taken (true).
    fn acknowledge_message(&mut self, data: &[u8], binary: bool, connector: ConnId) -> bool {
        match decode(data, binary) {
            Ok(("Acknowledge", fields)) => match fields.get(1) {
                Some(FieldValue::Str(request_id)) => self.acknowledge(request_id, connector),
                _ => false,
            },
            _ => false,
        }
    }

    /// The job of `request_id` sent to `connector`, out of the table for Python to finish.
    pub fn take(&mut self, request_id: &str, connector: ConnId) -> Option<Job> {
        if self.jobs.get(request_id)?.connector != connector {
            return None;
        }
        self.remove(request_id)
    }

    /// The client went away: its job runs on, its answer will be dropped.
    pub fn abandon(&mut self, client: ConnId) {
        if let Some(request_id) = self.by_client.remove(&client) {
            if let Some(job) = self.jobs.get_mut(&request_id) {
                job.client = None;
            }
        }
    }

    /// The client half-closed: its answer will be Python's.
    pub fn client_done(&mut self, client: ConnId) {
        if let Some(request_id) = self.by_client.get(&client) {
            if let Some(job) = self.jobs.get_mut(request_id) {
                job.client_done = true;
            }
        }
    }

    /// Clients whose answer was due by `now`, detached from their jobs (which run on, as
    /// the express path's do), each with its tenant's name: Python answers them 504.
    pub fn expired(&mut self, now: i64) -> Vec<(ConnId, String, String)> {
        let due: Vec<String> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.client.is_some() && j.deadline <= now)
            .map(|(r, _)| r.clone())
            .collect();
        let mut out = Vec::with_capacity(due.len());
        for request_id in due {
            let job = self.jobs.get_mut(&request_id).expect("listed above");
            let client = job.client.take().expect("listed above");
            let (key, method) = (job.tenant.clone(), method_of(job));
            self.by_client.remove(&client);
            let name = self.count_answer(&key, "-".into(), 504);
            if self.recording {
                let job = &self.jobs[&request_id];
                let record = record_of(job, &name, now, "expired", Some(RECORD_NO_ANSWER));
                self.records.push(record);
            }
            out.push((client, name, method));
        }
        out
    }

    /// Jobs of the tenant in flight here.
    pub fn inflight(&self, key: &str) -> u32 {
        self.tenants.get(key).map_or(0, |t| t.inflight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::http::StreamParser;
    use crate::dialects::tunnel::wire::{decode, FieldValue};

    fn head(raw: &[u8]) -> (RequestHead, Vec<u8>) {
        let mut p = StreamParser::new(Default::default());
        let out = p.feed(raw);
        let mut head = None;
        let mut body = Vec::new();
        for ev in out.events {
            match ev {
                crate::codec::http::Event::Head(h) => head = Some(h),
                crate::codec::http::Event::Data(d) => body.extend_from_slice(d),
                crate::codec::http::Event::End(_) => {}
            }
        }
        (head.unwrap(), body)
    }

    fn table(outboxes: &mut Outboxes) -> NativeTunnel {
        let mut t = NativeTunnel::new("origin".into(), 120_000_000_000, 150_000_000_000, 16384);
        t.refill(&(0u8..64).collect::<Vec<_>>());
        t.set_tenant("ACME", "acme", false, 1 << 20, Sharing::default(), 0);
        outboxes.open(9);
        t.add_connector("ACME", 9, true);
        t
    }

    /// The message in connector 9's outbox (one binary frame), decoded.
    fn sent_to_9(o: &mut Outboxes) -> (&'static str, Vec<FieldValue>) {
        let sent = o.take(9).unwrap();
        // 2-byte header for < 126 bytes, else 4
        let payload = if sent[1] & 127 == 126 {
            &sent[4..]
        } else {
            &sent[2..]
        };
        decode(payload, true).unwrap()
    }

    const POST: &[u8] = b"POST /relay/acme/app/echo?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\nX-A: 1\r\n\r\nhi";

    #[test]
    fn uuid4_is_ids_py_text() {
        let raw: Vec<u8> = (0u8..16).collect();
        assert_eq!(uuid4(&raw), "00010203-0405-4607-8809-0a0b0c0d0e0f");
    }

    #[test]
    fn bearer_reads_as_tokens_py() {
        assert_eq!(bearer(b"Bearer abc"), Some("abc"));
        assert_eq!(bearer(b" bearer  abc "), Some("abc"));
        assert_eq!(bearer(b"Basic abc"), None);
        assert_eq!(bearer(b"Bearer "), None);
        assert_eq!(bearer(b"Bearer \xa0abc"), None);
    }

    #[test]
    fn a_request_goes_to_the_connector_and_its_deliver_to_the_client() {
        let mut o = Outboxes::new();
        let mut t = table(&mut o);
        o.open(1);
        let (h, body) = head(POST);
        let id = t.offer(&h, &body, 1, (5, 5), &mut o).unwrap();
        t.attach(&id, h);
        let (kind, fields) = sent_to_9(&mut o);
        assert_eq!(kind, "RequestTarget");
        assert_eq!(fields[0], FieldValue::Str(id.clone()));
        assert_eq!(t.inflight("ACME"), 1);
        let deliver = format!(
            concat!(
                r#"{{"target":"Deliver","arguments":[{{"requestId":"{}","requestOriginId":"o","#,
                r#""httpStatusCode":200,"httpHeaders":{{}},"originalBodySize":2,"bodySize":2,"#,
                r#""bodyContent":"aGk=","requestFailed":false}}]}}"#
            ),
            id
        );
        // from another connector: not this job's
        assert_eq!(
            t.deliver(deliver.as_bytes(), false, 8, 0, &mut o),
            (None, false)
        );
        assert_eq!(
            t.deliver(deliver.as_bytes(), false, 9, 0, &mut o),
            (Some(1), true)
        );
        assert!(o.take(1).unwrap().starts_with(b"HTTP/1.1 200 OK\r\n"));
        assert_eq!(t.inflight("ACME"), 0);
        assert_eq!(t.tenants["ACME"].held, 0);
        assert_eq!(t.requests[&("acme".into(), "app".into(), 200)], 1);
        assert_eq!(t.http[&("POST".into(), 200)], 1);
    }

    #[test]
    fn declines_what_python_decides() {
        let mut o = Outboxes::new();
        let mut t = table(&mut o);
        let cases: [&[u8]; 6] = [
            b"HEAD /relay/acme/app HTTP/1.1\r\nHost: h\r\n\r\n",
            b"GET /relay/acme/app HTTP/1.1\r\n\r\n",
            b"GET /relay/ac%6De/app HTTP/1.1\r\nHost: h\r\n\r\n",
            b"GET /relay/other/app HTTP/1.1\r\nHost: h\r\n\r\n",
            b"GET /queue/acme/app HTTP/1.1\r\nHost: h\r\n\r\n",
            b"GET /relay/acme/app HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        ];
        for raw in cases {
            let (h, body) = head(raw);
            assert!(t.offer(&h, &body, 1, (0, 0), &mut o).is_err(), "{raw:?}");
        }
        assert_eq!(t.taken, 0);
    }

    #[test]
    fn tokens_budget_entropy_and_deadlines() {
        let mut o = Outboxes::new();
        let mut t = table(&mut o);
        t.set_tenant("ACME", "acme", true, 0, Sharing::default(), 0);
        let raw = b"GET /relay/acme/app HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer tok\r\n\r\n";
        let (h, body) = head(raw);
        assert_eq!(t.offer(&h, &body, 1, (0, 0), &mut o), Err("auth"));
        t.add_token("tok", "OTHER", 100);
        assert_eq!(t.offer(&h, &body, 1, (0, 0), &mut o), Err("auth"));
        t.add_token("tok", "ACME", 100);
        assert_eq!(t.offer(&h, &body, 1, (101, 101), &mut o), Err("auth"));
        assert!(t.offer(&h, &body, 1, (100, 100), &mut o).is_ok());
        // 64 bytes of entropy: four ids
        for client in 2..5 {
            assert!(t.offer(&h, &body, client, (100, 100), &mut o).is_ok());
        }
        assert_eq!(t.offer(&h, &body, 5, (100, 100), &mut o), Err("entropy"));
        // an id already in flight (entropy that repeats) is not used twice
        t.refill(&(0u8..16).collect::<Vec<_>>());
        assert_eq!(t.offer(&h, &body, 5, (100, 100), &mut o), Err("entropy"));
        t.refill(&[1u8; 16]);
        let mut small = Outboxes::new();
        small.open(9);
        let t_size = t.tenants["ACME"].held / 4;
        t.tenants.get_mut("ACME").unwrap().lease = t.tenants["ACME"].held;
        assert_eq!(t.offer(&h, &body, 5, (100, 100), &mut small), Err("budget"));
        // deadlines: due at 100 + span
        assert!(t.expired(100 + t.span - 1).is_empty());
        let due = t.expired(100 + t.span);
        assert_eq!(due.len(), 4);
        assert!(due.iter().all(|(_, name, _)| name == "acme"));
        // the jobs run on until their connector answers or leaves
        assert_eq!(t.inflight("ACME"), 4);
        let left = t.connector_left("ACME", 9, 0);
        assert!(left.again.is_empty());
        assert!(left.clients.is_empty());
        assert_eq!(left.lease, Some(4 * t_size));
        assert!(t.tenants.is_empty());
    }

    fn deliver_of(id: &str) -> String {
        format!(
            concat!(
                r#"{{"target":"Deliver","arguments":[{{"requestId":"{}","requestOriginId":"o","#,
                r#""httpStatusCode":200,"httpHeaders":{{}},"originalBodySize":0,"bodySize":0,"#,
                r#""requestFailed":false}}]}}"#
            ),
            id
        )
    }

    /// `table` with its tenant's connectors sharing its requests as `Sharing` says.
    fn shared(o: &mut Outboxes, limit: u32, least_inflight: bool) -> NativeTunnel {
        let mut t = table(o);
        let sharing = Sharing {
            limit,
            least_inflight,
        };
        t.set_tenant("ACME", "acme", false, 0, sharing, 0);
        t
    }

    #[test]
    fn a_limit_counts_the_tables_jobs_and_pythons() {
        let mut o = Outboxes::new();
        let mut t = shared(&mut o, 2, false);
        let (h, body) = head(POST);
        let first = t.offer(&h, &body, 1, (0, 0), &mut o).unwrap();
        t.outside("ACME", false, &[(9, 1)]);
        assert_eq!(t.offer(&h, &body, 2, (0, 0), &mut o), Err("limit"));
        t.outside("ACME", false, &[]);
        let second = t.offer(&h, &body, 2, (0, 0), &mut o).unwrap();
        assert_eq!(t.offer(&h, &body, 3, (0, 0), &mut o), Err("limit"));
        // Python queued the third: its answers free the slots, so it gets them too
        t.outside("ACME", true, &[]);
        o.open(1);
        assert_eq!(
            t.deliver(deliver_of(&first).as_bytes(), false, 9, 0, &mut o),
            (None, false)
        );
        assert_eq!(t.offer(&h, &body, 4, (0, 0), &mut o), Err("queued"));
        t.outside("ACME", false, &[]);
        assert_eq!(
            t.deliver(deliver_of(&first).as_bytes(), false, 9, 0, &mut o),
            (Some(1), true)
        );
        assert!(t.offer(&h, &body, 4, (0, 0), &mut o).is_ok());
        assert_eq!(t.inflight("ACME"), 2);
        assert!(t.jobs.contains_key(&second));
        assert_eq!(t.declined[&"limit"], 2);
    }

    #[test]
    fn least_inflight_takes_the_idlest_connector_ties_in_turn() {
        let mut o = Outboxes::new();
        let mut t = shared(&mut o, 0, true);
        o.open(8);
        t.add_connector("ACME", 8, true);
        let (h, body) = head(POST);
        let on = |t: &NativeTunnel, id: &str| t.jobs[id].connector;
        let a = t.offer(&h, &body, 1, (0, 0), &mut o).unwrap();
        let b = t.offer(&h, &body, 2, (0, 0), &mut o).unwrap();
        assert_eq!((on(&t, &a), on(&t, &b)), (9, 8));
        // 9's job answered: 9 has none, 8 one
        assert!(t.deliver(deliver_of(&a).as_bytes(), false, 9, 0, &mut o).1);
        let c = t.offer(&h, &body, 3, (0, 0), &mut o).unwrap();
        assert_eq!(on(&t, &c), 9);
        // Python's jobs count too: 9 has two of them
        t.outside("ACME", false, &[(9, 2)]);
        let d = t.offer(&h, &body, 4, (0, 0), &mut o).unwrap();
        assert_eq!(on(&t, &d), 8);
        assert_eq!(t.connector_inflight(8), 2);
    }

    #[test]
    fn route_records_of_each_answer_when_recording() {
        let mut o = Outboxes::new();
        let mut t = table(&mut o);
        o.open(1);
        let (h, body) = head(POST);
        let first = t.offer(&h, &body, 1, (5, 5), &mut o).unwrap();
        t.deliver(deliver_of(&first).as_bytes(), false, 9, 12, &mut o);
        assert!(t.records.is_empty(), "not recording");
        t.recording = true;
        let second = t.offer(&h, &body, 1, (20, 20), &mut o).unwrap();
        t.deliver(deliver_of(&second).as_bytes(), false, 9, 27, &mut o);
        t.offer(&h, &body, 2, (30, 30), &mut o).unwrap();
        t.expired(30 + t.span);
        t.offer(&h, &body, 3, (40, 40), &mut o).unwrap();
        t.connector_left("ACME", 9, 50);
        let got: Vec<_> = t
            .records
            .iter()
            .map(|r| {
                (
                    r.time,
                    r.dst.as_str(),
                    r.size,
                    r.outcome,
                    r.reason,
                    r.relay_ns,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (27, "acme/app", 2, "delivered", None, 7),
                (
                    30 + t.span,
                    "acme/app",
                    2,
                    "expired",
                    Some(RECORD_NO_ANSWER),
                    t.span
                ),
                (
                    50,
                    "acme/app",
                    2,
                    "rejected",
                    Some(CONNECTOR_UNAVAILABLE),
                    10
                ),
            ]
        );
    }

    fn acknowledge_of(id: &str) -> String {
        format!(
            r#"{{"target":"Acknowledge","arguments":[{{"originId":"origin","requestId":"{id}"}}]}}"#
        )
    }

    #[test]
    fn acknowledged_jobs_leave_when_answered_too_and_the_rest_go_back_to_python() {
        let mut o = Outboxes::new();
        let mut t = table(&mut o);
        t.set_tenant("ACME", "acme", false, 0, Sharing::default(), 2);
        o.open(1);
        o.open(2);
        let (h, body) = head(POST);
        // mode 2: answered first, then acknowledged
        let first = t.offer(&h, &body, 1, (0, 0), &mut o).unwrap();
        t.attach(&first, h.clone());
        assert_eq!(t.unacked, 1);
        let (_, fields) = sent_to_9(&mut o);
        assert!(
            fields.contains(&FieldValue::Int(2)),
            "sent with mode 2: {fields:?}"
        );
        let answered = t.deliver(deliver_of(&first).as_bytes(), false, 9, 1, &mut o);
        assert_eq!(answered, (Some(1), true));
        assert!(t.jobs[&first].answered, "kept until acknowledged");
        assert_eq!((t.inflight("ACME"), t.connector_inflight(9)), (0, 0));
        assert!(t.tenants["ACME"].held > 0);
        // a second Deliver is dropped; the acknowledgement comes through the same scan
        assert_eq!(
            t.deliver(deliver_of(&first).as_bytes(), false, 9, 2, &mut o),
            (None, true)
        );
        assert_eq!(
            t.deliver(acknowledge_of(&first).as_bytes(), false, 8, 2, &mut o),
            (None, false),
            "another connector's"
        );
        assert_eq!(
            t.deliver(acknowledge_of(&first).as_bytes(), false, 9, 2, &mut o),
            (None, true)
        );
        assert!(t.jobs.is_empty());
        assert_eq!((t.unacked, t.tenants["ACME"].held), (0, 0));
        // mode 1: acknowledged while in flight, answered after
        let second = t.offer(&h, &body, 1, (0, 0), &mut o).unwrap();
        assert!(t.acknowledge(&second, 9));
        assert!(t.jobs[&second].body_copy.is_none());
        assert_eq!(
            t.deliver(deliver_of(&second).as_bytes(), false, 9, 3, &mut o),
            (Some(1), true)
        );
        assert!(t.jobs.is_empty());
        // not acknowledged when the connector leaves: sent again by Python, answered or not
        let waiting = t.offer(&h, &body, 1, (0, 0), &mut o).unwrap();
        let done = t.offer(&h, &body, 2, (0, 0), &mut o).unwrap();
        t.deliver(deliver_of(&done).as_bytes(), false, 9, 4, &mut o);
        let mut left = t.connector_left("ACME", 9, 5);
        assert!(left.clients.is_empty());
        left.again.sort_by_key(|(_, j)| j.client.is_none());
        let again: Vec<_> = left
            .again
            .iter()
            .map(|(id, j)| (id.as_str(), j.client, j.body_copy.as_deref()))
            .collect();
        assert_eq!(
            again,
            vec![
                (waiting.as_str(), Some(1), Some(&b"hi"[..])),
                (done.as_str(), None, Some(&b"hi"[..])),
            ]
        );
        assert_eq!(t.unacked, 0);
        assert!(
            t.tenants.is_empty(),
            "the lease comes back with the last connector"
        );
    }

    #[test]
    fn a_manual_job_is_acknowledged_by_its_url_token_only() {
        let mut o = Outboxes::new();
        let mut t = table(&mut o);
        t.set_tenant("ACME", "acme", false, 0, Sharing::default(), MANUAL);
        o.open(1);
        let (h, body) = head(POST);
        let id = t.offer(&h, &body, 1, (0, 0), &mut o).unwrap();
        let (_, fields) = sent_to_9(&mut o);
        let token = t.jobs[&id].ack_token.clone();
        assert_eq!(token.len(), 32, "token_urlsafe(24)");
        let url = format!("/tunnel/acknowledge/origin/{id}/{token}");
        assert!(fields.contains(&FieldValue::Str(url)), "{fields:?}");
        assert!(!t.acknowledge(&id, 9), "not on the socket");
        let answered = t.deliver(deliver_of(&id).as_bytes(), false, 9, 1, &mut o);
        assert_eq!(answered, (Some(1), true));
        assert!(!t.acknowledge_manual(&id, "guessed"));
        assert!(!t.acknowledge_manual(&id, &token[..31]));
        assert!(t.acknowledge_manual(&id, &token));
        assert!(t.jobs.is_empty());
        assert!(!t.acknowledge_manual(&id, &token), "once only");
        assert_eq!(t.unacked, 0);
        // 16 + 24 bytes of entropy a request: 64 bytes made one
        assert_eq!(t.offer(&h, &body, 1, (0, 0), &mut o), Err("entropy"));
    }

    #[test]
    fn connector_left_names_the_waiting_clients() {
        let mut o = Outboxes::new();
        let mut t = table(&mut o);
        let (h, body) = head(POST);
        t.offer(&h, &body, 1, (0, 0), &mut o).unwrap();
        t.offer(&h, &body, 2, (0, 0), &mut o).unwrap();
        t.abandon(2);
        let left = t.connector_left("ACME", 9, 0);
        assert!(left.again.is_empty());
        assert_eq!(left.clients, vec![(1, String::new())]);
        assert_eq!(left.lease, Some(1 << 20));
        assert_eq!(t.requests[&("acme".into(), "-".into(), 503)], 1);
    }
}

pub mod py {
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyList};

    use crate::codec::http::py::{events_list, HttpRequest, HttpStreamParser};
    use crate::codec::http::Event;
    use crate::codec::scanner::py::Scanner;
    use crate::codec::scanner::{ScanFeed, Scanned};
    use crate::codec::ws::py::payload_bytes;
    use crate::codec::ws::Payload;
    use crate::forward::outboxes::py::{open_outboxes, Outboxes};
    use crate::forward::routes::ConnId;

    /// (connection, request method) of clients Python answers (503, 504).
    type Waiting = Vec<(Py<PyAny>, String)>;

    /// The native express table (module docstring) and the outboxes it writes into, whose
    /// connections are its clients' (a served client's outbox is opened with its connection,
    /// so Python gets the connection back from there when it must answer).
    #[pyclass(module = "rmb_relay._core", name = "NativeTunnel")]
    pub struct NativeTunnel {
        pub(crate) inner: super::NativeTunnel,
        outboxes: Py<Outboxes>,
    }

    /// A job out of the table, for Python: (client connection or None, its request or None,
    /// tenant key, target, deadline, when the table took it, its body's bytes, acknowledge
    /// mode, acknowledged, the body while not acknowledged, the manual acknowledge token).
    type JobOut = (
        Option<Py<PyAny>>,
        Option<Py<HttpRequest>>,
        String,
        String,
        i64,
        i64,
        u64,
        u8,
        bool,
        Option<Py<PyBytes>>,
        String,
    );

    impl NativeTunnel {
        fn job_out(&self, py: Python<'_>, job: super::Job) -> PyResult<JobOut> {
            let acked = job.acked();
            let conn = match job.client {
                Some(c) => self.outboxes.bind(py).try_borrow()?.conn(py, c),
                None => None,
            };
            let request = match job.head {
                Some(head) => Some(Py::new(py, HttpRequest::from_head(py, head))?),
                None => None,
            };
            let body = job.body_copy.map(|b| PyBytes::new(py, &b).unbind());
            Ok((
                conn,
                request,
                job.tenant,
                job.target,
                job.deadline,
                job.started,
                job.body,
                job.ack_mode,
                acked,
                body,
                job.ack_token,
            ))
        }

        /// The connections of `clients` (each with its `T`), from the outboxes; a client whose
        /// outbox is gone (the connection was lost, `abandon`) is left out.
        fn conns<T>(
            &self,
            py: Python<'_>,
            clients: Vec<(ConnId, T)>,
        ) -> PyResult<Vec<(Py<PyAny>, T)>> {
            let boxes = self.outboxes.bind(py).try_borrow()?;
            Ok(clients
                .into_iter()
                .filter_map(|(c, t)| boxes.conn(py, c).map(|conn| (conn, t)))
                .collect())
        }
    }

    #[pymethods]
    impl NativeTunnel {
        #[new]
        #[pyo3(signature = (outboxes, origin_id, ttl, span, *, max_body = 16384))]
        fn new(
            outboxes: Py<Outboxes>,
            origin_id: String,
            ttl: i64,
            span: i64,
            max_body: usize,
        ) -> Self {
            NativeTunnel {
                inner: super::NativeTunnel::new(origin_id, ttl, span, max_body),
                outboxes,
            }
        }

        /// One client read (module docstring): None when the request was served here (its
        /// message is in the connector's outbox), else the read's events exactly as
        /// `HttpStreamParser.feed` gives them.
        #[allow(clippy::too_many_arguments)]
        fn feed<'py>(
            &mut self,
            py: Python<'py>,
            parser: &Bound<'py, HttpStreamParser>,
            data: &[u8],
            client: ConnId,
            conn: &Bound<'py, PyAny>,
            now: i64,
            wall: i64,
        ) -> PyResult<Option<Bound<'py, PyList>>> {
            let mut parser = parser.try_borrow_mut()?;
            let inner = &mut parser.inner;
            let mut out = inner.feed(data);
            let whole = out.error.is_none()
                && matches!(out.events.first(), Some(Event::Head(_)))
                && matches!(out.events.last(), Some(Event::End(t)) if t.is_empty())
                && out.events[1..out.events.len() - 1]
                    .iter()
                    .all(|e| matches!(e, Event::Data(_)));
            if whole {
                let body: Vec<u8>;
                let data_events = &out.events[1..out.events.len() - 1];
                let body_ref: &[u8] = match data_events {
                    [] => b"",
                    [Event::Data(d)] => d,
                    _ => {
                        body = data_events
                            .iter()
                            .flat_map(|e| match e {
                                Event::Data(d) => d.iter().copied(),
                                _ => [].iter().copied(),
                            })
                            .collect();
                        &body
                    }
                };
                let Event::Head(head) = &out.events[0] else {
                    unreachable!("checked above")
                };
                let mut boxes = self.outboxes.bind(py).try_borrow_mut()?;
                if let Ok(request_id) =
                    self.inner
                        .offer(head, body_ref, client, (now, wall), &mut boxes.inner)
                {
                    let Event::Head(head) = out.events.swap_remove(0) else {
                        unreachable!("checked above")
                    };
                    self.inner.attach(&request_id, head);
                    if !boxes.inner.is_open(client) {
                        // once per connection: it stays open until the connection is lost
                        boxes.open(client, conn.clone().unbind(), "tunnel");
                    }
                    return Ok(None);
                }
            }
            events_list(py, out).map(Some)
        }

        /// A connector's message (`ConnectorSession.on_message`'s first look): True when it
        /// was answered or dropped here (module docstring), False when it is Python's.
        fn deliver(
            &mut self,
            py: Python<'_>,
            data: &[u8],
            binary: bool,
            connector: ConnId,
            now: i64,
        ) -> PyResult<bool> {
            let mut boxes = self.outboxes.bind(py).try_borrow_mut()?;
            Ok(self.deliver_into(data, binary, connector, now, &mut boxes.inner))
        }

        /// The job of `request_id` sent to `connector`, out of the table for Python to finish
        /// (`JobOut`), or None.
        fn take(
            &mut self,
            py: Python<'_>,
            request_id: &str,
            connector: ConnId,
        ) -> PyResult<Option<JobOut>> {
            match self.inner.take(request_id, connector) {
                Some(job) => self.job_out(py, job).map(Some),
                None => Ok(None),
            }
        }

        /// The client went away (its connection is lost).
        fn abandon(&mut self, client: ConnId) {
            self.inner.abandon(client);
        }

        /// The client half-closed while its request is served here.
        fn client_done(&mut self, client: ConnId) {
            self.inner.client_done(client);
        }

        /// (connection, method) of every client whose answer was due by `now`.
        fn expired(&mut self, py: Python<'_>, now: i64) -> PyResult<Waiting> {
            let clients = self.inner.expired(now).into_iter();
            self.conns(py, clients.map(|(c, _, method)| (c, method)).collect())
        }

        /// The connector left: the connections of the clients still waiting (Python answers
        /// 503), the jobs not acknowledged (request id, `JobOut`: Python sends them again),
        /// and the tenant's lease when it has no connector left (else None).
        #[allow(clippy::type_complexity)]
        fn connector_left(
            &mut self,
            py: Python<'_>,
            key: &str,
            connector: ConnId,
            now: i64,
        ) -> PyResult<(Waiting, Vec<(String, JobOut)>, Option<u64>)> {
            let left = self.inner.connector_left(key, connector, now);
            let again = left
                .again
                .into_iter()
                .map(|(id, job)| Ok((id, self.job_out(py, job)?)))
                .collect::<PyResult<_>>()?;
            Ok((self.conns(py, left.clients)?, again, left.lease))
        }

        /// The connector's `Acknowledge` of `request_id` (`ConnectorSession`'s path, when the
        /// scanner did not take it): False when it is not a job of this table sent there.
        fn acknowledge(&mut self, request_id: &str, connector: ConnId) -> bool {
            self.inner.acknowledge(request_id, connector)
        }

        /// The manual acknowledge URL of `request_id` was called with `token`: False when it
        /// is not a manual job of this table waiting for it, or the token is wrong.
        fn acknowledge_manual(&mut self, request_id: &str, token: &str) -> bool {
            self.inner.acknowledge_manual(request_id, token)
        }

        /// The acknowledge mode of a job in the table, None for an unknown request id.
        fn ack_mode_of(&self, request_id: &str) -> Option<u8> {
            self.inner.jobs.get(request_id).map(|j| j.ack_mode)
        }

        /// Jobs not acknowledged yet (modes 1 to 3).
        #[getter]
        fn unacked(&self) -> u32 {
            self.inner.unacked
        }

        /// Shutting down: the waiting clients' connections and the leases to give back.
        fn close(&mut self, py: Python<'_>) -> PyResult<(Waiting, u64)> {
            let (clients, lease) = self.inner.close();
            Ok((self.conns(py, clients)?, lease))
        }

        /// The tenant is served here (`lease` more budget bytes are its), its connectors
        /// sharing its requests as `limit` (0: none) and `least_inflight` (else round robin)
        /// say, its requests sent with acknowledge mode `ack_mode` (0, 1 or 2).
        #[pyo3(signature = (
            key, name, require_auth, lease, *, limit = 0, least_inflight = false, ack_mode = 0
        ))]
        #[allow(clippy::too_many_arguments)]
        fn set_tenant(
            &mut self,
            key: &str,
            name: &str,
            require_auth: bool,
            lease: u64,
            limit: u32,
            least_inflight: bool,
            ack_mode: u8,
        ) -> PyResult<()> {
            if ack_mode > 3 {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "acknowledge modes are 0 (disabled) to 3 (manual)",
                ));
            }
            let sharing = super::Sharing {
                limit,
                least_inflight,
            };
            self.inner
                .set_tenant(key, name, require_auth, lease, sharing, ack_mode);
            Ok(())
        }

        /// What Python's hub has of the tenant: jobs queued or not, and (connector, its jobs
        /// in flight) of the connectors with some.
        fn outside(&mut self, key: &str, queued: bool, counts: Vec<(ConnId, u32)>) {
            self.inner.outside(key, queued, &counts);
        }

        /// The connector's jobs in flight in the table.
        fn connector_inflight(&self, connector: ConnId) -> u32 {
            self.inner.connector_inflight(connector)
        }

        fn disable(&mut self, key: &str) {
            self.inner.disable(key);
        }

        fn has_tenant(&self, key: &str) -> bool {
            self.inner.tenants.contains_key(key)
        }

        fn add_connector(&mut self, key: &str, connector: ConnId, binary: bool) {
            self.inner.add_connector(key, connector, binary);
        }

        fn add_token(&mut self, token: &str, key: &str, until: i64) {
            self.inner.add_token(token, key, until);
        }

        fn refill(&mut self, entropy: &Bound<'_, PyBytes>) {
            self.inner.refill(entropy.as_bytes());
        }

        #[getter]
        fn ids_left(&self) -> usize {
            self.inner.ids_left()
        }

        fn inflight(&self, key: &str) -> u32 {
            self.inner.inflight(key)
        }

        /// The tenant key of a job in the table, None for an unknown request id.
        fn tenant_of(&self, request_id: &str) -> Option<String> {
            self.inner.jobs.get(request_id).map(|j| j.tenant.clone())
        }

        /// Budget bytes the tenant's jobs here hold (of its lease).
        fn held(&self, key: &str) -> u64 {
            self.inner.tenants.get(key).map_or(0, |t| t.held)
        }

        /// Budget bytes the table holds for the tenant (its lease; 0 when not served here).
        fn lease(&self, key: &str) -> u64 {
            self.inner.tenants.get(key).map_or(0, |t| t.lease)
        }

        fn __len__(&self) -> usize {
            self.inner.jobs.len()
        }

        #[getter]
        fn taken(&self) -> u64 {
            self.inner.taken
        }

        #[getter]
        fn answered(&self) -> u64 {
            self.inner.answered
        }

        /// Route records are kept for `take_records` (`--records`).
        #[getter]
        fn get_recording(&self) -> bool {
            self.inner.recording
        }

        #[setter]
        fn set_recording(&mut self, on: bool) {
            self.inner.recording = on;
        }

        /// The route records kept since the last call, in the callers' clock: (time, dst,
        /// size, outcome, reason, relay ns).
        #[allow(clippy::type_complexity)]
        fn take_records(
            &mut self,
        ) -> Vec<(i64, String, u64, &'static str, Option<&'static str>, i64)> {
            std::mem::take(&mut self.inner.records)
                .into_iter()
                .map(|r| (r.time, r.dst, r.size, r.outcome, r.reason, r.relay_ns))
                .collect()
        }

        /// ((tenant name, target, status), count) of the answers written here and the 503s
        /// and 504s counted here.
        fn requests(&self) -> Vec<((String, String, String), u64)> {
            self.inner
                .requests
                .iter()
                .map(|((t, g, s), n)| ((t.clone(), g.clone(), s.to_string()), *n))
                .collect()
        }

        /// ((method, status), count) of the HTTP answers written here.
        fn http_answers(&self) -> Vec<((String, String), u64)> {
            self.inner
                .http
                .iter()
                .map(|((m, s), n)| ((m.clone(), s.to_string()), *n))
                .collect()
        }

        /// (reason, count) of the requests left to Python.
        fn declined(&self) -> Vec<(String, u64)> {
            self.inner
                .declined
                .iter()
                .map(|(r, n)| ((*r).to_owned(), *n))
                .collect()
        }
    }

    impl NativeTunnel {
        /// `deliver` with the outboxes already borrowed (the connector's scanner, scan.rs).
        pub(crate) fn deliver_into(
            &mut self,
            data: &[u8],
            binary: bool,
            connector: ConnId,
            now: i64,
            outboxes: &mut crate::forward::outboxes::Outboxes,
        ) -> bool {
            self.inner.deliver(data, binary, connector, now, outboxes).1
        }
    }

    /// The `scan_error` of a connector's message the table looked at and left to Python.
    pub const TUNNEL_DECLINED: &str = "not a Deliver the native express table answers";

    /// The scanner of one connector's websocket: each `Deliver` the table answers is written
    /// into its client's outbox inside the decoder's `feed` (no event, no Python call per
    /// message); every other message, and every later one of the same read, goes to Python
    /// as it came, those the table looked at and declined with the `scan_error`
    /// `TUNNEL_DECLINED` (so Python does not offer them to it again).
    #[pyclass(extends = Scanner, module = "rmb_relay._core", name = "TunnelScanner", frozen)]
    pub struct TunnelScanner {
        pub(crate) table: Py<NativeTunnel>,
        pub(crate) outboxes: Py<Outboxes>,
        #[pyo3(get)]
        pub(crate) conn_id: u64,
        #[pyo3(get)]
        pub(crate) binary: bool,
    }

    #[pymethods]
    impl TunnelScanner {
        /// The scanner of connector `conn_id`'s websocket, writing into the table's outboxes.
        #[new]
        fn new(
            py: Python<'_>,
            table: Py<NativeTunnel>,
            conn_id: u64,
            binary: bool,
        ) -> (Self, Scanner) {
            let outboxes = table.borrow(py).outboxes.clone_ref(py);
            let scanner = TunnelScanner {
                table,
                outboxes,
                conn_id,
                binary,
            };
            (scanner, Scanner::new(start_tunnel))
        }

        fn __repr__(&self) -> String {
            format!(
                "TunnelScanner(conn_id={}, binary={})",
                self.conn_id, self.binary
            )
        }
    }

    /// A tunnel connector's scanner for one `feed`: its `Deliver`s answered by the table.
    struct TunnelFeed<'py> {
        table: PyRefMut<'py, NativeTunnel>,
        outboxes: Option<PyRefMut<'py, Outboxes>>,
        connector: u64,
        /// msgpack in binary frames, else JSON in text frames
        binary: bool,
        /// the message unmasked, reused across the feed's messages
        scratch: Vec<u8>,
    }

    fn start_tunnel<'a, 'py>(scanner: &'a Bound<'py, PyAny>) -> PyResult<Box<dyn ScanFeed + 'a>> {
        let py = scanner.py();
        let s = scanner.downcast::<TunnelScanner>()?.get();
        Ok(Box::new(TunnelFeed {
            table: s.table.bind(py).try_borrow_mut()?,
            outboxes: open_outboxes(py, Some(&s.outboxes), s.conn_id)?,
            connector: s.conn_id,
            binary: s.binary,
            scratch: Vec::new(),
        }))
    }

    impl ScanFeed for TunnelFeed<'_> {
        fn message(
            &mut self,
            py: Python<'_>,
            is_text: bool,
            payload: Payload<'_>,
            now: u64,
            fast: bool,
        ) -> PyResult<Option<Scanned>> {
            // a frame of the other kind is Python's (it answers the error)
            let binary = self.binary;
            let Some(ob) = self.outboxes.as_mut().filter(|_| fast && is_text != binary) else {
                return Ok(Some((payload_bytes(py, payload)?, None, None)));
            };
            let scratch = &mut self.scratch;
            scratch.clear();
            scratch.resize(payload.len(), 0);
            payload.copy_to(scratch);
            // `now`: the dialect's scan clock, the hub's (route records' times)
            let now = now as i64;
            if self
                .table
                .deliver_into(scratch, binary, self.connector, now, &mut ob.inner)
            {
                Ok(None)
            } else {
                let declined = Some(TUNNEL_DECLINED.to_owned());
                Ok(Some((PyBytes::new(py, scratch).unbind(), None, declined)))
            }
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<NativeTunnel>()?;
        m.add_class::<TunnelScanner>()
    }
}
