//! The tunnel's hub: every decision about a tunnelled request, made once, for every request.
//!
//! Theory of operation
//! -------------------
//! A client request becomes a *job* here whichever way it came in: read whole from the
//! client's socket by the fast path (`py::TunnelHub::feed`, one Rust call per read), or
//! handed over by Python after it did the I/O the request needed first (loading a tenant,
//! verifying a token, streaming a body into the body store, asking the cluster). Both call
//! [`Hub::step`], which walks the same decisions and says what comes next ([`Step`]): an
//! answer at once, an I/O step for Python, or the job held here. The fast path commits only a
//! held job and leaves everything else to Python untouched (`Step::Decline`), so the same
//! request then takes the same decisions on the Python side.
//!
//! A job waits in its tenant's queue until a connector of the tenant has room ([`Hub::pump`]):
//! at most the tenant's concurrency limit in flight on this relay, spread round robin or least
//! in flight first. Its `RequestTarget` is encoded into that connector's outbox. Deadlines:
//! a job still queued at its pickup deadline (`ttl`) is answered 408 and never sent (a job
//! found expired when a connector frees up is dropped then); a client still waiting at its
//! answer deadline (`span`: TTL + response timeout) is answered 504 and the job, if a
//! connector holds it, runs on with its answer dropped. Python arms one timer at
//! [`Hub::next_deadline`] and calls [`Hub::expire`].
//!
//! Acknowledgement modes (spec/tunnel.md decision 6, §11): a job is safe (never sent again)
//! once sent (0 Disabled), once the connector acknowledged it (1 ConnectorReceived, 2
//! ConnectorFinished), or once its acknowledge URL was called (3 Manual, a token of 24 random
//! bytes). A job is forgotten once answered and safe. A connector that leaves puts its unsafe
//! jobs back at the head of their queue (at least once: the target may see them twice); its
//! safe jobs whose client still waits are answered 503.
//!
//! Memory budget: from intake until forgotten, a job's in-memory bytes (`JOB_OVERHEAD`, its
//! inline body, URL and header characters; a stored body is on disk) count against a budget
//! per tenant and one in all. A request over either is refused 503 before anything is kept.
//!
//! Waiters: the client's connection when the fast path holds it (its answer is written into
//! its outbox here, or handed to Python when HTTP/1.1 cannot carry it kept alive), a Python
//! task (`Waiter::Task`), another relay of the cluster (`Waiter::Origin`: the answers go to
//! its bus as frames built here), or nobody (queue mode). What Python must do for them comes
//! out as [`Effect`]s.
//!
//! Several relays (scaleout.py): a request for a tenant with no connector here is held as
//! *published* until a relay holding its connectors reports it taken (`remote_reply`); the
//! pickup deadline holds until then, the answer deadline after. A job from another relay
//! (`take_remote`) is queued here like any other, its answers told to its origin.
//! A published job is never refused on a guess: when its publish failed (the write may still
//! reach Redis) or its pickup deadline passed without word of it (the word may be on its
//! way), it is *withdrawing* ([`Effect::Withdraw`]): Python asks Redis who came first, this
//! relay withdrawing it or a relay taking it (scaleout.py's claim), and tells the verdict
//! (`withdrawn`: 503 or 408 now; `taken_by`: the answer comes from the bus). Without a verdict
//! the client gets 504 at its answer deadline (the relay cannot tell).
//!
//! Sans-I/O: times are arguments (the dialect's clock in ns; tokens' ends in unix seconds),
//! randomness comes from Python (`refill`), and the outboxes are the caller's.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use base64::Engine as _;

use crate::codec::http::RequestHead;
use crate::codec::ws::{OP_BINARY, OP_TEXT};
use crate::dialects::tunnel::answer::{self, Delivered, Response, Trace};
use crate::dialects::tunnel::wire::{
    decode_kinds, encode_client_request, kind_bit, ClientRequestRef, FieldRef, Json, Msgpack,
};
use crate::forward::outboxes::Outboxes;
use crate::forward::routes::ConnId;

/// What a job costs the memory budget beyond its text and body: the job, its maps and the
/// Python objects a Python-side waiter keeps (tracemalloc, 20,000 jobs with four headers).
pub const JOB_OVERHEAD: u64 = 1330;
/// Bytes of entropy one request id takes (a version-4 UUID).
const ID_BYTES: usize = 16;
/// Bytes of entropy a manual acknowledge URL's token takes.
const TOKEN_BYTES: usize = 24;
/// The manual acknowledgement mode.
pub const MANUAL: u8 = 3;
/// The methods a client may tunnel (HEAD too, on the Python side: its answer has no body).
const METHODS: [&str; 7] = ["HEAD", "GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"];
/// What a token may be used for (its scopes): attaching a connector, or a client request of
/// a tenant that requires a token.
pub const ROLE_CONNECTOR: u8 = 1;
pub const ROLE_CLIENT: u8 = 2;
/// Verified tokens remembered at most (all forgotten when full: Python verifies them again).
const TOKENS: usize = 4096;
/// Longest tenant name (a URL path segment of letters, digits and `-_.`: tenants.py).
const TENANT_NAME_MAX: usize = 100;

// The reasons of the answers the hub makes itself (client and route record read the same).
pub const BAD_PATH: &str = "expected /{relay|queue|trace}/{tenant}/{target}/{path}";
pub const NO_ANSWER_IN_TIME: &str = "the connector did not answer in time";
pub const CONNECTOR_UNAVAILABLE: &str = "connector unavailable";
pub const EXPIRED: &str = "request expired before a connector took it";
pub const TRANSPORT_FAILURE: &str = "transport failure";
pub const TAKER_GONE: &str = "the relay that took the request is gone; it may have run";
pub const CONNECTOR_LEFT: &str = "the connector left holding the request; it may have run";
pub const NO_TOKEN: &str = "no bearer token";
pub const OTHER_TENANT: &str = "the token is for another tenant";
pub const BAD_ANSWER: &str = "the connector's answer is not one HTTP/1.1 carries";
pub const MANUAL_ONLY: &str = "Acknowledge: this request is acknowledged by its URL (manual mode)";

/// How a tunnelled request is served (the first path segment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// request and answer
    Relay,
    /// 202 at once; the connector runs it and its answer is dropped
    Queue,
    /// as relay, with RelayServer's tracing headers both ways
    Trace,
}

/// The hub's settings (TunnelSettings, the flags).
#[derive(Debug, Clone)]
pub struct Config {
    /// this relay's id: `requestOriginId`, `acknowledgeOriginId`, the manual acknowledge URL
    pub origin_id: String,
    /// the pickup deadline after intake (ns)
    pub ttl: i64,
    /// the answer deadline after intake (ns): TTL + response timeout
    pub span: i64,
    /// bodies up to this size travel inline; the fast path takes only those
    pub inline_limit: usize,
    /// a tenant's jobs in flight here when it sets no limit of its own (0: none)
    pub default_limit: u32,
    /// the acknowledge mode of tenants that set none
    pub default_ack_mode: u8,
    pub least_inflight: bool,
    /// 503 at once for a tenant with no connector, instead of waiting up to the TTL
    pub require_connection: bool,
    /// with a cluster: a tenant with a connector here is served here
    pub shortcut: bool,
    /// several relays share Redis: a tenant without a connector here goes to them
    pub clustered: bool,
    pub tenant_bytes: u64,
    pub total_bytes: u64,
    /// tenant lookups (found or not) are kept this long (ns)
    pub tenant_ttl: i64,
    /// tenants kept at most without connectors or jobs (misses included)
    pub tenant_max: usize,
    /// the relay's host name and version (trace mode's answer fields)
    pub machine: String,
    pub version: String,
}

impl Config {
    /// What trace mode adds to the answer to request `request_id`.
    pub fn trace<'a>(&'a self, request_id: &'a str) -> Trace<'a> {
        Trace {
            request_id,
            machine: &self.machine,
            version: &self.version,
        }
    }
}

/// A tenant as the directory has it (tenants.py `Tenant`), for the hub.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantSettings {
    /// the name as stored (sent as `tenantName`, the metrics' label)
    pub name: String,
    pub require_auth: bool,
    /// its own concurrency limit (0: the relay's)
    pub max_concurrent: u32,
    /// its own acknowledge mode (None: the relay's)
    pub ack_mode: Option<u8>,
    /// a client's `Authorization` reaches the target even when it carries the relay's token
    /// (`require_auth`); otherwise it is dropped there
    pub forward_authorization: bool,
}

#[derive(Debug, Clone, Copy)]
struct Connector {
    id: ConnId,
    /// msgpack (binary frames) or JSON (text frames)
    binary: bool,
    /// its jobs in flight
    inflight: u32,
}

/// A tenant the hub knows: its settings (None: the directory has no such tenant), when they
/// were loaded, its connectors here and its jobs.
#[derive(Debug)]
struct Tenant {
    settings: Option<TenantSettings>,
    loaded: i64,
    connectors: Vec<Connector>,
    /// request ids, oldest first
    queue: VecDeque<String>,
    inflight: u32,
    next: usize,
    /// budget bytes its jobs hold
    held: u64,
}

impl Tenant {
    /// The tenant's name in everything it is shown by (`tenantName`, metric labels, the
    /// monitor): as stored, else (its directory entry gone) its key.
    fn name<'a>(&'a self, key: &'a str) -> &'a str {
        self.settings.as_ref().map_or(key, |s| s.name.as_str())
    }

    /// Kept whatever the cache's limits: it has connectors or jobs here.
    fn pinned(&self) -> bool {
        !self.connectors.is_empty() || self.held > 0 || !self.queue.is_empty() || self.inflight > 0
    }
}

/// A request's body as the job holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    Inline(Vec<u8>),
    /// in the body store under `name` (Python's), `size` bytes
    Stored {
        name: String,
        size: u64,
    },
}

impl Body {
    fn len(&self) -> u64 {
        match self {
            Body::Inline(b) => b.len() as u64,
            Body::Stored { size, .. } => *size,
        }
    }
}

/// Who waits for a job's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Waiter {
    /// a client connection the fast path served from its read
    Client(ConnId),
    /// a Python task (client.py), by the token Python keeps its future under
    Task(u64),
    /// another relay of the cluster (its instance id)
    Origin(String),
    /// nobody (queue mode, or the client went away or timed out)
    Nobody,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Place {
    Queued,
    Sent(ConnId),
    /// handed to the cluster, not taken by any relay yet
    Published,
    /// taken by the relay of that instance
    Taken(String),
    /// published, and this relay asked to withdraw it (its publish failed, or its pickup
    /// deadline passed untaken): the verdict, or the answer deadline, decides
    Withdrawing,
}

#[derive(Debug)]
struct Job {
    tenant: String,
    target: String,
    method: String,
    url: String,
    /// the request's fields (names in first-seen order, all their values), while it may be
    /// sent (again)
    headers: Vec<(String, Vec<String>)>,
    body: Option<Body>,
    /// the body's length (the route record's size)
    body_len: u64,
    tracing: bool,
    discard: bool,
    ack_mode: u8,
    ack_token: String,
    waiter: Waiter,
    place: Place,
    acked: bool,
    /// its connector's `Deliver` came (or it left for good)
    answered: bool,
    pickup: i64,
    due: i64,
    /// budget bytes (0: not charged, a published job)
    size: u64,
    /// intake time (the route record's relay time)
    started: i64,
    /// a fast-path client's request head, for Python when it must answer after all
    head: Option<RequestHead>,
    /// the fast-path client half-closed: its answer is Python's (it closes)
    client_done: bool,
}

/// What comes next for a request (`Hub::step`).
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// answer at once (`Retry-After`-less; a 401 carries `WWW-Authenticate: Bearer`)
    Refuse { status: u16, reason: String },
    /// Python loads this tenant from the directory (`set_tenant`), then steps again
    Load(String),
    /// Python verifies this bearer token (`add_token` when good, else its 401), then again
    Verify(String),
    /// Python asks the cluster whether a relay holds a connector of this tenant key, then
    /// steps again with the answer
    Reach(String),
    /// Python reads the body (inline up to `inline_limit`, else into the body store), then
    /// steps again with it
    Body,
    /// the job is held here (queued or sent): its waiter gets the answer
    Held(String),
    /// queue mode: the job is held here; answer 202 now
    Accepted(String),
    /// Python hands the job to the cluster (the `RequestTarget` msgpack, its pickup deadline in
    /// the hub's clock); it is held as published, its waiter answered from the bus
    Publish {
        request_id: String,
        message: Vec<u8>,
        pickup: i64,
    },
    /// (the fast path) not served from the read, for this reason: Python takes the request
    Decline(&'static str),
}

/// A job's outcome for its waiter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// the relay's own answer: status and reason
    Status(u16, &'static str),
    /// the connector's answer
    Response(Response),
}

/// What Python must do after a call (`Hub::take_effects`).
#[derive(Debug, PartialEq, Eq)]
pub enum Effect {
    /// a Python task's answer
    Resolve { token: u64, outcome: Outcome },
    /// a fast-path client's answer that Python writes (it closes or streams), with its head
    Answer {
        conn: ConnId,
        head: Option<RequestHead>,
        outcome: Outcome,
    },
    /// a frame for another relay's waiter of `request_id` (scaleout.py's bus frames)
    Tell {
        instance: String,
        request_id: String,
        frame: Vec<u8>,
    },
    /// a body-store file nobody needs any more
    Remove(String),
    /// the response body the connector stored for this request id: nobody reads it
    RemoveResponse(String),
    /// a published job to withdraw from its tenant's work queue (scaleout.py), unless a relay
    /// took it already: Python calls `withdrawn` or `taken_by` with the verdict (its pickup
    /// deadline bounds how long a verdict may take: scaleout.py)
    Withdraw {
        request_id: String,
        tenant: String,
        pickup: i64,
    },
}

/// A route record (`--records`) of an answer: destination, size, outcome, reason, times.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub time: i64,
    pub dst: Option<String>,
    pub size: u64,
    pub route: &'static str,
    pub outcome: &'static str,
    pub reason: Option<&'static str>,
    pub started: i64,
}

/// The bus frames of scaleout.py: taken (+ the taker's instance id), the answer (msgpack or
/// JSON `Deliver`, as the connector sent it), or the relay's own status in ASCII.
pub const TAKEN: u8 = b'k';
pub const RESPONSE_MSGPACK: u8 = b'r';
pub const RESPONSE_JSON: u8 = b'j';
pub const STATUS: u8 = b's';

/// The hub (module docstring).
#[derive(Debug)]
pub struct Hub {
    pub config: Config,
    /// this instance's id on the bus (the `taken` frames')
    pub instance: String,
    tenants: HashMap<String, Tenant>,
    jobs: HashMap<String, Job>,
    /// connector -> its tenant key
    connectors: HashMap<ConnId, String>,
    /// fast-path client -> its job
    by_client: HashMap<ConnId, String>,
    /// Python task -> its job
    by_task: HashMap<u64, String>,
    /// (deadline, request id): pickup and answer deadlines, checked against the job
    deadlines: BinaryHeap<Reverse<(i64, String)>>,
    /// tokens that passed the full check (tokens.py): their tenant claim, good up to (unix
    /// s); the only cache of verdicts, for the fast path and Python alike
    tokens: HashMap<String, (String, i64, u8)>,
    entropy: Vec<u8>,
    used: usize,
    held_total: u64,
    effects: Vec<Effect>,
    pub records: Vec<Record>,
    pub recording: bool,
    /// answers by (tenant name or "-", target or "-", status)
    pub requests: HashMap<(String, String, u16), u64>,
    /// answers the hub wrote into a client's outbox, by (method, status)
    pub http: HashMap<(String, u16), u64>,
    pub expired: u64,
    pub redelivered: u64,
    /// client requests the fast path took from the read, and the ones it left to Python
    /// by the first reason (not counting reads that are no tunnel request)
    pub fast_taken: u64,
    pub fast_declined: HashMap<&'static str, u64>,
    /// refusals at the budget: tenant, total
    pub refused: [u64; 2],
}

/// `a == b` in a time that does not depend on where they differ.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |diff, (x, y)| diff | (x ^ y))
            == 0
}

/// 16 random bytes as a version-4 UUID's text.
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

/// The token of an `Authorization: Bearer ...` value (scheme case-insensitive, spaces
/// around); None for anything else, non-printable or non-ASCII values included.
pub fn bearer(value: &[u8]) -> Option<&str> {
    if !value.iter().all(|b| (0x20..0x7f).contains(b)) {
        return None;
    }
    let text = std::str::from_utf8(value).ok()?.trim_matches(' ');
    let (scheme, token) = text.split_once(' ')?;
    let token = token.trim_matches(' ');
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// `%XX` escapes decoded (invalid UTF-8 replaced, as Python's `unquote` does).
fn unquote(segment: &str) -> Cow<'_, str> {
    if !segment.contains('%') {
        return Cow::Borrowed(segment);
    }
    let raw = segment.as_bytes();
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if raw[i] == b'%' && i + 2 < raw.len() {
            if let (Some(h), Some(l)) = (hex(raw[i + 1]), hex(raw[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(raw[i]);
        i += 1;
    }
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

/// A tenant name the directory can hold (tenants.py `NAME_PATTERN`).
fn valid_tenant_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= TENANT_NAME_MAX
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"_.-".contains(c))
}

/// The parts of a client request's path: `/{mode}/{tenant}/{target}/{rest}`.
pub struct Route<'a> {
    pub mode: Mode,
    pub tenant: Cow<'a, str>,
    pub target: Cow<'a, str>,
    pub rest: &'a str,
}

/// The client request's route, or None (404 `BAD_PATH`).
pub fn route(path: &str) -> Option<Route<'_>> {
    let mut parts = path.splitn(5, '/');
    let (Some(""), Some(mode), Some(tenant), Some(target)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    let mode = match mode.to_ascii_lowercase().as_str() {
        "relay" => Mode::Relay,
        "queue" => Mode::Queue,
        "trace" => Mode::Trace,
        _ => return None,
    };
    let (tenant, target) = (unquote(tenant), unquote(target));
    if tenant.is_empty() || target.is_empty() {
        return None;
    }
    Some(Route {
        mode,
        tenant,
        target,
        rest: parts.next().unwrap_or(""),
    })
}

/// The 503 reason of a request over the memory budget: which limit, and that nothing runs.
fn refusal_reason(total: bool, tenant: &str, held: u64, size: u64, allowed: u64) -> String {
    let (whose, knob) = if total {
        ("all tenants".to_owned(), "--tunnel-total-bytes")
    } else {
        (format!("tenant {tenant}"), "--tunnel-tenant-bytes")
    };
    format!(
        "relay busy: requests of {whose} waiting here hold {held} bytes, {size} more would pass \
         the {allowed}-byte limit ({knob}); the request was not queued and will not be executed"
    )
}

/// The job's route record at `now`.
fn record_of(
    job: &Job,
    name: &str,
    now: i64,
    outcome: &'static str,
    reason: Option<&'static str>,
) -> Record {
    Record {
        time: now,
        dst: Some(format!("{name}/{}", job.target)),
        size: job.body_len,
        route: match job.place {
            Place::Published | Place::Taken(_) | Place::Withdrawing => "cluster",
            _ => "local",
        },
        outcome,
        reason,
        started: job.started,
    }
}

/// A connector's message as the hub reads it.
enum Message {
    Deliver(Delivered),
    Acknowledge {
        request_id: String,
        remove_body: bool,
    },
}

fn owned_headers(h: &[(Cow<'_, str>, Vec<Cow<'_, str>>)]) -> Vec<(String, Vec<String>)> {
    h.iter()
        .map(|(n, v)| (n.to_string(), v.iter().map(|s| s.to_string()).collect()))
        .collect()
}

/// `data` as a connector's `Deliver` or `Acknowledge`, or the codec's words for why not.
fn read_message(data: &[u8], binary: bool) -> Result<Message, String> {
    let expected = kind_bit("Deliver") | kind_bit("Acknowledge");
    let (kind, f) = decode_kinds(data, binary, expected).map_err(|e| e.to_string())?;
    match (kind, f.as_slice()) {
        (
            "Deliver",
            [FieldRef::Str(id), _, FieldRef::Int(status), FieldRef::Headers(h), _, FieldRef::Int(size), body, ..],
        ) => Ok(Message::Deliver(Delivered {
            request_id: id.to_string(),
            status: *status,
            headers: owned_headers(h),
            body: match body {
                FieldRef::Bytes(b) => Some(b.to_vec()),
                _ => None,
            },
            body_size: *size,
        })),
        ("Acknowledge", [_, FieldRef::Str(id), FieldRef::Bool(remove)]) => {
            Ok(Message::Acknowledge {
                request_id: id.to_string(),
                remove_body: *remove,
            })
        }
        _ => Err(format!("{kind}: unexpected fields")),
    }
}

/// A `RequestTarget` from the bus (msgpack), as a job's request.
struct Remote {
    request_id: String,
    target: String,
    method: String,
    url: String,
    headers: Vec<(String, Vec<String>)>,
    ack_mode: u8,
    body: Option<Vec<u8>>,
    body_size: u64,
    tracing: bool,
    discard: bool,
}

fn read_remote(data: &[u8]) -> Option<Remote> {
    let (_, f) = decode_kinds(data, true, kind_bit("RequestTarget")).ok()?;
    let [FieldRef::Str(id), _, FieldRef::Str(target), _, FieldRef::Str(method), FieldRef::Str(url), FieldRef::Headers(h), FieldRef::Int(ack), _, _, FieldRef::Int(size), body, FieldRef::Bool(tracing), FieldRef::Bool(discard), ..] =
        f.as_slice()
    else {
        return None;
    };
    Some(Remote {
        request_id: id.to_string(),
        target: target.to_string(),
        method: method.to_string(),
        url: url.to_string(),
        headers: owned_headers(h),
        ack_mode: u8::try_from(*ack).ok().filter(|m| *m <= MANUAL)?,
        body: match body {
            FieldRef::Bytes(b) => Some(b.to_vec()),
            _ => None,
        },
        body_size: u64::try_from(*size).unwrap_or(0),
        tracing: *tracing,
        discard: *discard,
    })
}

/// Why a connector's message was refused (the text of its `Error` answer), or nothing.
pub type Refused = Option<String>;

impl Hub {
    pub fn new(config: Config, instance: String) -> Self {
        Hub {
            config,
            instance,
            tenants: HashMap::new(),
            jobs: HashMap::new(),
            connectors: HashMap::new(),
            by_client: HashMap::new(),
            by_task: HashMap::new(),
            deadlines: BinaryHeap::new(),
            tokens: HashMap::new(),
            entropy: Vec::new(),
            used: 0,
            held_total: 0,
            effects: Vec::new(),
            records: Vec::new(),
            recording: false,
            requests: HashMap::new(),
            http: HashMap::new(),
            expired: 0,
            redelivered: 0,
            fast_taken: 0,
            fast_declined: HashMap::new(),
            refused: [0, 0],
        }
    }

    // ---- entropy, tokens, tenants ---------------------------------------------------------

    /// More random bytes for request ids and acknowledge tokens (what is left is kept).
    pub fn refill(&mut self, entropy: &[u8]) {
        self.entropy.drain(..self.used);
        self.used = 0;
        self.entropy.extend_from_slice(entropy);
    }

    /// Ids the entropy left makes.
    pub fn ids_left(&self) -> usize {
        (self.entropy.len() - self.used) / ID_BYTES
    }

    fn random(&mut self, n: usize) -> Option<&[u8]> {
        if self.entropy.len() - self.used < n {
            return None;
        }
        let at = self.used;
        self.used += n;
        Some(&self.entropy[at..at + n])
    }

    /// A token that passed the full check, for the tenant `claim` and the `roles` its scopes
    /// give (`ROLE_*`), good up to `until` (unix s). At most `TOKENS` are kept: a client
    /// presenting ever new tokens costs bounded memory.
    pub fn add_token(&mut self, token: &str, claim: &str, until: i64, roles: u8) {
        if self.tokens.len() >= TOKENS {
            self.tokens.clear(); // (the live ones are verified again, once each)
        }
        self.tokens
            .insert(token.to_owned(), (claim.to_owned(), until, roles));
    }

    /// The tenant claim of a verified token still good at `wall` (unix s), with its roles.
    pub fn known_token(&self, token: &str, wall: i64) -> Option<(&str, u8)> {
        match self.tokens.get(token) {
            Some((claim, until, roles)) if wall <= *until => Some((claim, *roles)),
            _ => None,
        }
    }

    /// The verdicts of the tenant `key`'s tokens are forgotten (it was removed or re-keyed).
    pub fn forget_tokens(&mut self, key: &str) {
        self.tokens
            .retain(|_, (claim, _, _)| !claim.eq_ignore_ascii_case(key));
    }

    /// The directory's answer for the tenant `key` at `now` (None: no such tenant). Beyond
    /// `tenant_max` tenants without connectors or jobs, the oldest such entries are dropped.
    pub fn set_tenant(&mut self, key: &str, settings: Option<TenantSettings>, now: i64) {
        if let Some(t) = self.tenants.get_mut(key) {
            t.settings = settings;
            t.loaded = now;
            return;
        }
        if self.tenants.len() >= self.config.tenant_max {
            self.evict_tenants(now);
        }
        self.tenants.insert(
            key.to_owned(),
            Tenant {
                settings,
                loaded: now,
                connectors: Vec::new(),
                queue: VecDeque::new(),
                inflight: 0,
                next: 0,
                held: 0,
            },
        );
    }

    /// Room in the tenant cache: the expired idle entries go, then the oldest idle ones
    /// until a quarter of the cap is free.
    fn evict_tenants(&mut self, now: i64) {
        let ttl = self.config.tenant_ttl;
        self.tenants
            .retain(|_, t| t.pinned() || now - t.loaded < ttl);
        let cap = self.config.tenant_max;
        if self.tenants.len() < cap {
            return;
        }
        let mut idle: Vec<(i64, String)> = self
            .tenants
            .iter()
            .filter(|(_, t)| !t.pinned())
            .map(|(k, t)| (t.loaded, k.clone()))
            .collect();
        idle.sort_unstable();
        let excess = self.tenants.len() + 1 - cap * 3 / 4;
        for (_, key) in idle.into_iter().take(excess) {
            self.tenants.remove(&key);
        }
    }

    /// The tenant's cached lookup is forgotten (the management API changed it).
    pub fn forget_tenant(&mut self, key: &str) {
        if let Some(t) = self.tenants.get_mut(key) {
            t.loaded = i64::MIN / 2;
        }
    }

    /// The tenant's settings if it is cached, still fresh at `now` (Some(None): no such tenant).
    pub fn tenant(&self, key: &str, now: i64) -> Option<Option<&TenantSettings>> {
        let t = self.tenants.get(key)?;
        (now - t.loaded < self.config.tenant_ttl).then_some(t.settings.as_ref())
    }

    /// Tenants cached, connected ones included.
    pub fn tenants_cached(&self) -> usize {
        self.tenants.len()
    }

    fn name_of(&self, key: &str) -> String {
        self.tenants
            .get(key)
            .map_or(key, |t| t.name(key))
            .to_owned()
    }

    fn limit_of(&self, t: &Tenant) -> u32 {
        match &t.settings {
            Some(s) if s.max_concurrent > 0 => s.max_concurrent,
            _ => self.config.default_limit,
        }
    }

    // ---- counting ---------------------------------------------------------------------------

    /// One answer counted under (tenant name, target, status), and its route record.
    #[allow(clippy::too_many_arguments)]
    fn count(&mut self, name: &str, target: &str, status: u16, record: Option<Record>) {
        *self
            .requests
            .entry((name.to_owned(), target.to_owned(), status))
            .or_default() += 1;
        if let Some(r) = record.filter(|_| self.recording) {
            self.records.push(r);
        }
    }

    /// An answer the caller made itself (a 401 from token verification, a 503 when the
    /// cluster cannot be reached), counted and recorded as the hub's are.
    #[allow(clippy::too_many_arguments)]
    pub fn count_refusal(
        &mut self,
        name: &str,
        dst: Option<String>,
        status: u16,
        outcome: &'static str,
        reason: &'static str,
        started: i64,
        now: i64,
    ) {
        let record = Record {
            time: now,
            dst,
            size: 0,
            route: "none",
            outcome,
            reason: Some(reason),
            started,
        };
        self.count(name, "-", status, Some(record));
    }

    fn refuse(
        &mut self,
        name: &str,
        dst: Option<String>,
        status: u16,
        reason: String,
        why: &'static str,
        started: i64,
    ) -> Step {
        let outcome = if status == 408 { "expired" } else { "rejected" };
        self.count_refusal(name, dst, status, outcome, why, started, started);
        Step::Refuse { status, reason }
    }

    // ---- intake -----------------------------------------------------------------------------

    /// The next step for a client request (module docstring). `body`: None until read;
    /// `reachable`: the cluster's answer once asked; `fast`: the read path, which commits only
    /// a held job (`Decline` otherwise, nothing changed). `now`: the hub's clock (ns), `wall`:
    /// the tokens' (unix s).
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        head: &RequestHead,
        body: Option<Body>,
        waiter: Waiter,
        reachable: Option<bool>,
        (now, wall): (i64, i64),
        fast: bool,
        outboxes: &mut Outboxes,
    ) -> Step {
        let Some(route) = route(&head.path) else {
            if fast {
                return Step::Decline("path");
            }
            return self.refuse("-", None, 404, BAD_PATH.to_owned(), "bad path", now);
        };
        if !valid_tenant_name(&route.tenant) {
            if fast {
                return Step::Decline("tenant");
            }
            let reason = format!("unknown tenant {}", route.tenant);
            return self.refuse("-", None, 404, reason, "unknown tenant", now);
        }
        let key = route.tenant.to_ascii_uppercase();
        let settings = match self.tenant(&key, now) {
            None => {
                if fast {
                    return Step::Decline("tenant");
                }
                return Step::Load(route.tenant.into_owned());
            }
            Some(None) => {
                if fast {
                    return Step::Decline("tenant");
                }
                let reason = format!("unknown tenant {}", route.tenant);
                return self.refuse("-", None, 404, reason, "unknown tenant", now);
            }
            Some(Some(s)) => s,
        };
        let name = settings.name.clone();
        let dst = || Some(format!("{name}/{}", route.target));
        if settings.require_auth {
            let token = head.header("authorization").and_then(bearer);
            // (a connector's token cannot stand for a client: Python's full check says why)
            let verdict = token.map(|t| match self.known_token(t, wall) {
                Some((claim, roles)) if roles & ROLE_CLIENT != 0 => {
                    Some(claim.eq_ignore_ascii_case(&key))
                }
                _ => None,
            });
            match verdict {
                Some(Some(true)) => {}
                _ if fast => return Step::Decline("auth"),
                None => {
                    return self.refuse(&name, dst(), 401, NO_TOKEN.to_owned(), "unauthorized", now)
                }
                Some(Some(false)) => {
                    return self.refuse(
                        &name,
                        dst(),
                        401,
                        OTHER_TENANT.to_owned(),
                        "unauthorized",
                        now,
                    )
                }
                Some(None) => return Step::Verify(token.unwrap_or_default().to_owned()),
            }
        }
        let t = &self.tenants[&key];
        let here = !t.connectors.is_empty();
        let local = here && (!self.config.clustered || self.config.shortcut);
        if !local && self.config.require_connection {
            match reachable {
                Some(true) => {}
                _ if fast => return Step::Decline("no connector"),
                None if self.config.clustered => return Step::Reach(key),
                _ => {
                    let reason = format!("no connector of tenant {name} is connected");
                    return self.refuse(&name, dst(), 503, reason, "no connector", now);
                }
            }
        }
        let Some(body) = body else {
            return if fast {
                Step::Decline("body")
            } else {
                Step::Body
            };
        };
        if !local && self.config.clustered {
            if fast {
                return Step::Decline("cluster");
            }
            return self.publish(head, &route, &key, body, waiter, now);
        }
        if fast && !t.queue.is_empty() {
            return Step::Decline("queued");
        }
        if !METHODS.contains(&head.method.as_str()) {
            // the router offers only these; a fast-path read of another goes to Python's 405
            return Step::Decline("method");
        }
        let url = match &head.query {
            Some(q) => format!("{}?{q}", route.rest),
            None => route.rest.to_owned(),
        };
        let drop_auth = self
            .tenants
            .get(&key)
            .and_then(|t| t.settings.as_ref())
            .is_some_and(|s| s.require_auth && !s.forward_authorization);
        let (headers, text) = answer::request_headers(
            head.headers
                .iter()
                .filter(|(n, _)| !(drop_auth && n == "authorization"))
                .map(|(n, v)| (n.as_str(), v.as_slice())),
        );
        let inline = match &body {
            Body::Inline(b) => b.len(),
            Body::Stored { .. } => 0,
        };
        let size = JOB_OVERHEAD + (inline + url.chars().count() + text) as u64;
        if let Err((total, held, allowed)) = self.fits(&key, size) {
            if fast {
                return Step::Decline("budget");
            }
            self.refused[usize::from(total)] += 1;
            let reason = refusal_reason(total, &name, held, size, allowed);
            return self.refuse(&name, dst(), 503, reason, "relay busy", now);
        }
        let manual = self.ack_mode_for(&key) == MANUAL;
        if self.entropy.len() - self.used < ID_BYTES + if manual { TOKEN_BYTES } else { 0 } {
            return if fast {
                Step::Decline("entropy")
            } else {
                Step::Refuse {
                    status: 503,
                    reason: "relay busy: out of request ids".into(),
                }
            };
        }
        let request_id = uuid4(self.random(ID_BYTES).expect("checked above"));
        if self.jobs.contains_key(&request_id) {
            return if fast {
                Step::Decline("entropy")
            } else {
                Step::Refuse {
                    status: 503,
                    reason: "relay busy: request id in use".into(),
                }
            };
        }
        let ack_token = if manual {
            let raw = self.random(TOKEN_BYTES).expect("checked above");
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
        } else {
            String::new()
        };
        let queue_mode = route.mode == Mode::Queue;
        let waiter = if queue_mode { Waiter::Nobody } else { waiter };
        let job = Job {
            tenant: key.clone(),
            target: route.target.into_owned(),
            method: head.method.clone(),
            url,
            headers,
            body_len: body.len(),
            body: Some(body).filter(|b| b.len() > 0 || matches!(b, Body::Stored { .. })),
            tracing: route.mode == Mode::Trace,
            discard: queue_mode,
            ack_mode: self.ack_mode_for(&key),
            ack_token,
            waiter,
            place: Place::Queued,
            acked: false,
            answered: false,
            pickup: now + self.config.ttl,
            due: now + self.config.span,
            size,
            started: now,
            head: None,
            client_done: false,
        };
        self.hold(request_id.clone(), job, now, outboxes);
        if queue_mode {
            self.count(
                &name,
                &self
                    .jobs
                    .get(&request_id)
                    .map_or_else(String::new, |j| j.target.clone()),
                202,
                None,
            );
            if let Some(job) = self.jobs.get(&request_id) {
                let record = record_of(job, &name, now, "queued", None);
                if self.recording {
                    self.records.push(record);
                }
            }
            return Step::Accepted(request_id);
        }
        Step::Held(request_id)
    }

    fn ack_mode_for(&self, key: &str) -> u8 {
        self.tenants
            .get(key)
            .and_then(|t| t.settings.as_ref())
            .and_then(|s| s.ack_mode)
            .unwrap_or(self.config.default_ack_mode)
    }

    /// Ok when `size` more bytes fit the tenant's and the total budget, else (the total's,
    /// held, allowed).
    fn fits(&self, key: &str, size: u64) -> Result<(), (bool, u64, u64)> {
        let held = self.tenants.get(key).map_or(0, |t| t.held);
        if held + size > self.config.tenant_bytes {
            return Err((false, held, self.config.tenant_bytes));
        }
        if self.held_total + size > self.config.total_bytes {
            return Err((true, self.held_total, self.config.total_bytes));
        }
        Ok(())
    }

    /// The job is admitted (budget charged), queued, and the queue pumped; its deadlines set.
    fn hold(&mut self, request_id: String, job: Job, now: i64, outboxes: &mut Outboxes) {
        let key = job.tenant.clone();
        let (size, due, waited) = (
            job.size,
            job.due,
            !matches!(job.waiter, Waiter::Nobody | Waiter::Origin(_)),
        );
        match &job.waiter {
            Waiter::Client(c) => {
                self.by_client.insert(*c, request_id.clone());
            }
            Waiter::Task(t) => {
                self.by_task.insert(*t, request_id.clone());
            }
            _ => {}
        }
        self.held_total += size;
        let t = self.tenants.get_mut(&key).expect("the tenant is known");
        t.held += size;
        t.queue.push_back(request_id.clone());
        self.jobs.insert(request_id.clone(), job);
        if waited {
            self.deadlines.push(Reverse((due, request_id.clone())));
        }
        self.pump(&key, now, outboxes);
        if let Some(job) = self.jobs.get(&request_id) {
            if job.place == Place::Queued {
                self.deadlines.push(Reverse((job.pickup, request_id)));
            }
        }
    }

    /// The request goes to the cluster: held as published, not charged (the relay that takes
    /// it charges its budget).
    fn publish(
        &mut self,
        head: &RequestHead,
        route: &Route<'_>,
        key: &str,
        body: Body,
        waiter: Waiter,
        now: i64,
    ) -> Step {
        let Some(raw) = self.random(ID_BYTES) else {
            return Step::Refuse {
                status: 503,
                reason: "relay busy: out of request ids".into(),
            };
        };
        let request_id = uuid4(raw);
        let url = match &head.query {
            Some(q) => format!("{}?{q}", route.rest),
            None => route.rest.to_owned(),
        };
        let (headers, _) =
            answer::request_headers(head.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())));
        let name = self.name_of(key);
        let (inline, size) = match &body {
            Body::Inline(b) => (Some(b.as_slice()), b.len() as i64),
            Body::Stored { size, .. } => (None, *size as i64),
        };
        let fields = ClientRequestRef {
            request_id: &request_id,
            request_origin_id: &self.config.origin_id,
            target: &route.target,
            tenant_name: &name,
            http_method: &head.method,
            url: &url,
            http_headers: &headers,
            acknowledge_mode: i64::from(self.ack_mode_for(key)),
            acknowledge_origin_id: None,
            original_body_size: size,
            body_size: size,
            body_content: inline.filter(|b| !b.is_empty()),
            enable_tracing: route.mode == Mode::Trace,
            discard_connector_response: route.mode == Mode::Queue,
            expires_in: None,
            acknowledge_url: None,
        };
        let message = encode_client_request(Msgpack::with_capacity(256), &fields);
        let queue_mode = route.mode == Mode::Queue;
        let job = Job {
            tenant: key.to_owned(),
            target: route.target.to_string(),
            method: head.method.clone(),
            url: String::new(),
            headers: Vec::new(),
            body_len: body.len(),
            body: None,
            tracing: route.mode == Mode::Trace,
            discard: queue_mode,
            ack_mode: 0,
            ack_token: String::new(),
            waiter: if queue_mode {
                Waiter::Nobody
            } else {
                waiter.clone()
            },
            place: Place::Published,
            acked: true,
            answered: false,
            pickup: now + self.config.ttl,
            due: now + self.config.span,
            size: 0,
            started: now,
            head: None,
            client_done: false,
        };
        if let Waiter::Task(t) = &job.waiter {
            self.by_task.insert(*t, request_id.clone());
        }
        let pickup = job.pickup;
        self.deadlines.push(Reverse((pickup, request_id.clone())));
        if !queue_mode {
            self.deadlines.push(Reverse((job.due, request_id.clone())));
        }
        self.jobs.insert(request_id.clone(), job);
        Step::Publish {
            request_id,
            message,
            pickup,
        }
    }

    /// The cluster could not take a published job, and it certainly never reached Redis: it
    /// is forgotten (the caller answers 503).
    pub fn unpublish(&mut self, request_id: &str) {
        if matches!(self.jobs.get(request_id), Some(j) if j.place == Place::Published) {
            self.forget(request_id);
        }
    }

    /// A published job's write failed and may still reach Redis: it is withdrawn before its
    /// client is told anything (module docstring).
    pub fn publish_failed(&mut self, request_id: &str) {
        self.withdraw(request_id);
    }

    fn withdraw(&mut self, request_id: &str) {
        let Some(job) = self.jobs.get_mut(request_id) else {
            return;
        };
        if job.place != Place::Published {
            return;
        }
        job.place = Place::Withdrawing;
        self.effects.push(Effect::Withdraw {
            request_id: request_id.to_owned(),
            tenant: job.tenant.clone(),
            pickup: job.pickup,
        });
    }

    /// The verdict: nobody took the job, and nobody will. Its waiter gets 408 once its pickup
    /// deadline passed, else 503 (its publish failed).
    pub fn withdrawn(&mut self, request_id: &str, now: i64) {
        let Some(job) = self.jobs.get(request_id) else {
            return;
        };
        if job.place != Place::Withdrawing {
            return;
        }
        if now >= job.pickup {
            self.expire_queued(request_id, now);
        } else {
            let outcome = Outcome::Status(503, TRANSPORT_FAILURE);
            self.answer(request_id, outcome, "rejected", now);
            self.forget(request_id);
        }
    }

    /// The verdict: the relay of `instance` took the job first; its answers come over the bus.
    pub fn taken_by(&mut self, request_id: &str, instance: &str) {
        let Some(job) = self.jobs.get_mut(request_id) else {
            return;
        };
        if !matches!(job.place, Place::Published | Place::Withdrawing) {
            return;
        }
        if job.discard {
            self.forget(request_id);
            return;
        }
        job.place = Place::Taken(instance.to_owned());
    }

    /// A fast-path client's request head, kept with its job for Python (`Effect::Answer`).
    pub fn attach(&mut self, request_id: &str, head: RequestHead) {
        if let Some(job) = self.jobs.get_mut(request_id) {
            job.head = Some(head);
        }
    }

    // ---- connectors and sending ------------------------------------------------------------

    /// A connector of the tenant `key` (loaded: `set_tenant`) joined; its queue is pumped.
    pub fn add_connector(
        &mut self,
        key: &str,
        id: ConnId,
        binary: bool,
        now: i64,
        outboxes: &mut Outboxes,
    ) {
        let Some(t) = self.tenants.get_mut(key) else {
            return;
        };
        if !t.connectors.iter().any(|c| c.id == id) {
            t.connectors.push(Connector {
                id,
                binary,
                inflight: 0,
            });
        }
        self.connectors.insert(id, key.to_owned());
        self.pump(key, now, outboxes);
    }

    /// The connector left: its unsafe jobs go back to the head of their queue, in order (at
    /// least once), its safe ones' waiters are answered 504 (it may have run: a 503 would say it
    /// did not); the queue is pumped.
    pub fn remove_connector(&mut self, id: ConnId, now: i64, outboxes: &mut Outboxes) {
        let Some(key) = self.connectors.remove(&id) else {
            return;
        };
        let mut gone: Vec<(i64, String)> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.place == Place::Sent(id))
            .map(|(r, j)| (j.started, r.clone()))
            .collect();
        gone.sort_unstable();
        let mut again = Vec::new();
        for (_, request_id) in gone {
            let job = self.jobs.get_mut(&request_id).expect("listed above");
            if !job.answered {
                job.answered = true;
                if let Some(t) = self.tenants.get_mut(&key) {
                    t.inflight = t.inflight.saturating_sub(1);
                }
            }
            if !job.acked {
                job.place = Place::Queued;
                job.answered = false;
                again.push(request_id);
            } else {
                self.answer(
                    &request_id,
                    Outcome::Status(504, CONNECTOR_LEFT),
                    "rejected",
                    now,
                );
                self.forget(&request_id);
            }
        }
        if let Some(t) = self.tenants.get_mut(&key) {
            t.connectors.retain(|c| c.id != id);
            for request_id in again.iter().rev() {
                t.queue.push_front(request_id.clone());
            }
        }
        self.redelivered += again.len() as u64;
        for request_id in again {
            let pickup = self.jobs[&request_id].pickup;
            self.deadlines.push(Reverse((pickup, request_id)));
        }
        self.pump(&key, now, outboxes);
    }

    /// The connector of `t` the next job goes to.
    fn pick(&self, t: &Tenant) -> usize {
        let count = t.connectors.len();
        let first = t.next % count;
        if !self.config.least_inflight {
            return first;
        }
        (0..count)
            .map(|step| (first + step) % count)
            .min_by_key(|&i| t.connectors[i].inflight)
            .expect("the tenant has a connector")
    }

    /// Send the tenant's queued jobs to its connectors while they have room; a job past its
    /// pickup deadline is answered 408 and dropped instead.
    pub fn pump(&mut self, key: &str, now: i64, outboxes: &mut Outboxes) {
        loop {
            let Some(t) = self.tenants.get(key) else {
                return;
            };
            let Some(request_id) = t.queue.front().cloned() else {
                return;
            };
            if self
                .jobs
                .get(&request_id)
                .is_none_or(|j| j.place != Place::Queued)
            {
                self.tenants
                    .get_mut(key)
                    .expect("looked up")
                    .queue
                    .pop_front();
                continue;
            }
            if now >= self.jobs[&request_id].pickup {
                self.tenants
                    .get_mut(key)
                    .expect("looked up")
                    .queue
                    .pop_front();
                self.expire_queued(&request_id, now);
                continue;
            }
            if t.connectors.is_empty() {
                return;
            }
            let limit = self.limit_of(t);
            if limit > 0 && t.inflight >= limit {
                return;
            }
            let index = self.pick(t);
            let t = self.tenants.get_mut(key).expect("looked up");
            t.queue.pop_front();
            t.next = index + 1;
            t.inflight += 1;
            t.connectors[index].inflight += 1;
            let connector = t.connectors[index];
            let name = t.name(key).to_owned();
            self.send(&request_id, connector, &name, now, outboxes);
        }
    }

    fn send(
        &mut self,
        request_id: &str,
        connector: Connector,
        name: &str,
        now: i64,
        outboxes: &mut Outboxes,
    ) {
        let origin = &self.config.origin_id;
        let job = self.jobs.get_mut(request_id).expect("queued");
        let ack_url = (job.ack_mode == MANUAL).then(|| {
            format!(
                "/tunnel/acknowledge/{origin}/{request_id}/{}",
                job.ack_token
            )
        });
        let (inline, size) = match &job.body {
            Some(Body::Inline(b)) => (Some(b.as_slice()), b.len() as i64),
            Some(Body::Stored { size, .. }) => (None, *size as i64),
            None => (None, 0),
        };
        let fields = ClientRequestRef {
            request_id,
            request_origin_id: origin,
            target: &job.target,
            tenant_name: name,
            http_method: &job.method,
            url: &job.url,
            http_headers: &job.headers,
            acknowledge_mode: i64::from(job.ack_mode),
            acknowledge_origin_id: Some(origin),
            original_body_size: size,
            body_size: size,
            body_content: inline,
            enable_tracing: job.tracing,
            discard_connector_response: job.discard,
            expires_in: Some(((job.pickup - now) / 1_000_000).max(1)),
            acknowledge_url: ack_url.as_deref(),
        };
        let (message, opcode) = if connector.binary {
            let sink = Msgpack::with_capacity(256 + size as usize);
            (encode_client_request(sink, &fields), OP_BINARY)
        } else {
            let sink = Json::with_capacity(384 + size as usize * 4 / 3);
            (encode_client_request(sink, &fields), OP_TEXT)
        };
        // (into a congested connector too: what it is sent is in the memory budget until
        // answered, so its outbox is bounded by it)
        outboxes.push_frame_marked(connector.id, opcode, &message);
        job.place = Place::Sent(connector.id);
        if job.ack_mode == 0 {
            job.acked = true;
            job.headers = Vec::new();
            if matches!(job.body, Some(Body::Inline(_))) {
                job.body = None;
            }
        }
        if let Waiter::Origin(instance) = &job.waiter {
            let mut frame = vec![TAKEN];
            frame.extend_from_slice(self.instance.as_bytes());
            self.effects.push(Effect::Tell {
                instance: instance.clone(),
                request_id: request_id.to_owned(),
                frame,
            });
        }
    }

    // ---- answers ----------------------------------------------------------------------------

    /// The job's waiter gets `outcome` (once): written here for a fast-path client when
    /// HTTP/1.1 carries it kept alive, else as an effect. Counted and recorded.
    fn answer(&mut self, request_id: &str, outcome: Outcome, record: &'static str, now: i64) {
        let Some(job) = self.jobs.get_mut(request_id) else {
            return;
        };
        let mut waiter = std::mem::replace(&mut job.waiter, Waiter::Nobody);
        if job.discard && matches!(waiter, Waiter::Origin(_)) {
            waiter = Waiter::Nobody; // a queue-mode request from another relay: nobody waits
        }
        let head = job.head.take();
        let (key, target) = (job.tenant.clone(), job.target.clone());
        let name = self.name_of(&key);
        let job = &self.jobs[request_id];
        let (status, reason) = match &outcome {
            Outcome::Status(s, r) => (*s, Some(*r)),
            Outcome::Response(r) => (r.status, None),
        };
        // (the records' reason of a 504 is shorter than the client's: analytics group by it)
        let reason = if status == 504 {
            Some("no answer in time")
        } else {
            reason
        };
        let rec = record_of(job, &name, now, record, reason);
        let label = if matches!(outcome, Outcome::Status(..)) || status == 404 {
            "-"
        } else {
            target.as_str()
        };
        match waiter {
            Waiter::Client(conn) => {
                self.by_client.remove(&conn);
                self.effects.push(Effect::Answer {
                    conn,
                    head,
                    outcome,
                });
            }
            Waiter::Task(token) => {
                self.by_task.remove(&token);
                self.effects.push(Effect::Resolve { token, outcome });
            }
            Waiter::Origin(instance) => {
                let frame = match &outcome {
                    Outcome::Status(s, _) => {
                        let mut f = vec![STATUS];
                        f.extend_from_slice(s.to_string().as_bytes());
                        f
                    }
                    Outcome::Response(r) => r.message.clone(),
                };
                self.effects.push(Effect::Tell {
                    instance,
                    request_id: request_id.to_owned(),
                    frame,
                });
                return; // counted by its origin
            }
            Waiter::Nobody => {
                if let Outcome::Response(r) = &outcome {
                    if r.stored.is_some() {
                        self.effects
                            .push(Effect::RemoveResponse(request_id.to_owned()));
                    }
                }
                return;
            }
        }
        self.count(&name, label, status, Some(rec));
    }

    /// A job leaves the hub: its budget bytes go back, its stored body is removed.
    fn forget(&mut self, request_id: &str) {
        let Some(job) = self.jobs.remove(request_id) else {
            return;
        };
        if let Some(t) = self.tenants.get_mut(&job.tenant) {
            t.held -= job.size;
            if !job.answered {
                if let Place::Sent(c) = job.place {
                    t.inflight = t.inflight.saturating_sub(1);
                    if let Some(c) = t.connectors.iter_mut().find(|x| x.id == c) {
                        c.inflight = c.inflight.saturating_sub(1);
                    }
                }
            }
        }
        self.held_total -= job.size;
        match &job.waiter {
            Waiter::Client(c) => {
                self.by_client.remove(c);
            }
            Waiter::Task(t) => {
                self.by_task.remove(t);
            }
            _ => {}
        }
        if let Some(Body::Stored { name, .. }) = job.body {
            if !matches!(
                job.place,
                Place::Published | Place::Taken(_) | Place::Withdrawing
            ) {
                self.effects.push(Effect::Remove(name));
            }
        }
    }

    /// The job is no longer in flight: its connector's and tenant's counts let go of.
    fn settle(&mut self, request_id: &str) {
        let Some(job) = self.jobs.get_mut(request_id) else {
            return;
        };
        if job.answered {
            return;
        }
        job.answered = true;
        let Place::Sent(c) = job.place else {
            return;
        };
        if let Some(t) = self.tenants.get_mut(&job.tenant) {
            t.inflight = t.inflight.saturating_sub(1);
            if let Some(c) = t.connectors.iter_mut().find(|x| x.id == c) {
                c.inflight = c.inflight.saturating_sub(1);
            }
        }
    }

    fn expire_queued(&mut self, request_id: &str, now: i64) {
        self.expired += 1;
        self.answer(request_id, Outcome::Status(408, EXPIRED), "expired", now);
        self.forget(request_id);
    }

    /// Deadlines passed by `now`: queued jobs past their pickup deadline are answered 408 and
    /// dropped, published ones withdrawn (module docstring); waiters past their answer
    /// deadline are answered 504 (a job a connector here holds runs on, its answer dropped; a
    /// job of the cluster is forgotten: an answer that comes later finds nobody).
    /// `slack`: a deadline this close counts as passed (timers fire to the millisecond).
    pub fn expire(&mut self, now: i64, slack: i64, outboxes: &mut Outboxes) {
        let mut pumped = Vec::new();
        while let Some(Reverse((when, _))) = self.deadlines.peek() {
            if *when > now + slack {
                break;
            }
            let Reverse((when, request_id)) = self.deadlines.pop().expect("peeked");
            let Some(job) = self.jobs.get(&request_id) else {
                continue;
            };
            if when == job.pickup && job.place == Place::Published {
                self.withdraw(&request_id);
            } else if when == job.pickup && job.place == Place::Queued {
                let key = job.tenant.clone();
                if let Some(t) = self.tenants.get_mut(&key) {
                    t.queue.retain(|r| *r != request_id);
                }
                pumped.push(key);
                self.expire_queued(&request_id, now);
            } else if when == job.due
                && !job.answered
                && matches!(job.waiter, Waiter::Client(_) | Waiter::Task(_))
            {
                let queued = job.place == Place::Queued;
                let remote = matches!(
                    job.place,
                    Place::Published | Place::Taken(_) | Place::Withdrawing
                );
                self.answer(
                    &request_id,
                    Outcome::Status(504, NO_ANSWER_IN_TIME),
                    "expired",
                    now,
                );
                if queued {
                    self.drop_queued(&request_id);
                } else if remote {
                    self.forget(&request_id);
                }
            }
        }
        for key in pumped {
            self.pump(&key, now, outboxes);
        }
    }

    fn drop_queued(&mut self, request_id: &str) {
        if let Some(job) = self.jobs.get(request_id) {
            let key = job.tenant.clone();
            if let Some(t) = self.tenants.get_mut(&key) {
                t.queue.retain(|r| r != request_id);
            }
            self.forget(request_id);
        }
    }

    /// Whether the deadline entry (`when`, `request_id`) still means something.
    fn due_for(&self, when: i64, request_id: &str) -> bool {
        self.jobs.get(request_id).is_some_and(|job| {
            (when == job.pickup && matches!(job.place, Place::Queued | Place::Published))
                || (when == job.due
                    && !job.answered
                    && matches!(job.waiter, Waiter::Client(_) | Waiter::Task(_)))
        })
    }

    /// The earliest deadline still to check (the hub's clock), if any: entries of jobs
    /// answered, sent or gone meanwhile are dropped on the way.
    pub fn next_deadline(&mut self) -> Option<i64> {
        while let Some(Reverse((when, request_id))) = self.deadlines.peek() {
            if self.due_for(*when, request_id) {
                return Some(*when);
            }
            self.deadlines.pop();
        }
        None
    }

    /// A fast-path client went away: a queued job is dropped, a sent one runs on.
    pub fn abandon_client(&mut self, conn: ConnId) {
        if let Some(request_id) = self.by_client.remove(&conn) {
            self.abandon(&request_id);
        }
    }

    /// A Python task stopped waiting (its client went away): as `abandon_client`.
    pub fn abandon_task(&mut self, token: u64) {
        if let Some(request_id) = self.by_task.remove(&token) {
            self.abandon(&request_id);
        }
    }

    fn abandon(&mut self, request_id: &str) {
        let Some(job) = self.jobs.get_mut(request_id) else {
            return;
        };
        job.waiter = Waiter::Nobody;
        job.head = None;
        if job.place == Place::Queued {
            self.drop_queued(request_id);
        }
    }

    /// The fast-path client half-closed: its answer will be Python's.
    pub fn client_done(&mut self, conn: ConnId) {
        if let Some(request_id) = self.by_client.get(&conn) {
            if let Some(job) = self.jobs.get_mut(request_id) {
                job.client_done = true;
            }
        }
    }

    /// A connector's message. `fast` (its read, inside the decoder's `feed`): handled only
    /// when it needs nothing of Python (Ok(true)); Ok(false) leaves it to Python untouched.
    /// From Python: Ok(true) when handled, Err(reason) when refused (unknown request id, a
    /// manual job's `Acknowledge`), Ok(false) when it is not a message the hub reads (Python's
    /// codec words the error).
    pub fn connector_message(
        &mut self,
        conn: ConnId,
        data: &[u8],
        binary: bool,
        now: i64,
        fast: bool,
        outboxes: &mut Outboxes,
    ) -> Result<bool, String> {
        let Some(key) = self.connectors.get(&conn) else {
            return Ok(false);
        };
        if fast && self.tenants.get(key).is_some_and(|t| !t.queue.is_empty()) {
            return Ok(false); // its answer pumps the queue: Python's turn (effects)
        }
        match read_message(data, binary) {
            Ok(Message::Deliver(d)) => self.deliver(conn, d, binary, data, now, fast, outboxes),
            Ok(Message::Acknowledge {
                request_id,
                remove_body,
            }) => self.acknowledge(conn, &request_id, remove_body, fast),
            Err(_) if fast => Ok(false),
            Err(reason) => Err(reason),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn deliver(
        &mut self,
        conn: ConnId,
        d: Delivered,
        binary: bool,
        data: &[u8],
        now: i64,
        fast: bool,
        outboxes: &mut Outboxes,
    ) -> Result<bool, String> {
        let Some(job) = self
            .jobs
            .get(&d.request_id)
            .filter(|j| j.place == Place::Sent(conn))
        else {
            if fast {
                return Ok(false);
            }
            if d.stored() {
                self.effects
                    .push(Effect::RemoveResponse(d.request_id.clone()));
            }
            return Err(format!("Deliver: unknown request id {:?}", d.request_id));
        };
        if job.answered {
            // a second `Deliver`: dropped
            if d.stored() {
                if fast {
                    return Ok(false);
                }
                self.effects
                    .push(Effect::RemoveResponse(d.request_id.clone()));
            }
            return Ok(true);
        }
        let key = job.tenant.clone();
        let trace = job.tracing.then(|| self.config.trace(&d.request_id));
        if !answer::carried(&d, trace) {
            if fast {
                return Ok(false);
            }
            // a 1xx (a 101 would smuggle a websocket past a front proxy), no HTTP status, a
            // body a 204 cannot have, a field that would split the head: the client gets 502
            if d.stored() {
                self.effects
                    .push(Effect::RemoveResponse(d.request_id.clone()));
            }
            let refused = format!(
                "Deliver: the answer to {:?} is not one HTTP/1.1 carries (status {}, its fields \
                 or its body)",
                d.request_id, d.status
            );
            self.answer(
                &d.request_id,
                Outcome::Status(502, BAD_ANSWER),
                "rejected",
                now,
            );
            self.delivered(&d.request_id, &key, now, outboxes);
            return Err(refused);
        }
        match &job.waiter {
            Waiter::Client(client) if !job.client_done && !d.stored() && d.status < 400 => {
                let client = *client;
                let Ok(status) = u16::try_from(d.status) else {
                    if fast {
                        return Ok(false);
                    }
                    return self.deliver_to_python(conn, d, binary, data, now, outboxes);
                };
                let Some(bytes) = answer::client_answer(
                    status,
                    &d.headers,
                    d.body.as_deref().unwrap_or(b""),
                    trace,
                ) else {
                    if fast {
                        return Ok(false);
                    }
                    return self.deliver_to_python(conn, d, binary, data, now, outboxes);
                };
                let name = self.name_of(&key);
                let job = &self.jobs[&d.request_id];
                let rec = record_of(job, &name, now, "delivered", None);
                let label = if status == 404 {
                    "-".to_owned()
                } else {
                    job.target.clone()
                };
                let method = job.method.clone();
                outboxes.push_marked(client, &bytes);
                self.by_client.remove(&client);
                let job = self.jobs.get_mut(&d.request_id).expect("found above");
                job.waiter = Waiter::Nobody;
                job.head = None;
                self.count(&name, &label, status, Some(rec));
                *self.http.entry((method, status)).or_default() += 1;
                self.delivered(&d.request_id, &key, now, outboxes);
                Ok(true)
            }
            Waiter::Nobody if !d.stored() => {
                self.delivered(&d.request_id, &key, now, outboxes);
                Ok(true)
            }
            _ if fast => Ok(false),
            _ => self.deliver_to_python(conn, d, binary, data, now, outboxes),
        }
    }

    /// `deliver` for a waiter Python answers (a task, another relay, a client HTTP/1.1 cannot
    /// answer kept alive from here).
    fn deliver_to_python(
        &mut self,
        _conn: ConnId,
        d: Delivered,
        binary: bool,
        data: &[u8],
        now: i64,
        outboxes: &mut Outboxes,
    ) -> Result<bool, String> {
        let job = &self.jobs[&d.request_id];
        let key = job.tenant.clone();
        let trace = job.tracing.then(|| self.config.trace(&d.request_id));
        let mut message = Vec::new();
        if matches!(job.waiter, Waiter::Origin(_)) {
            message.push(if binary {
                RESPONSE_MSGPACK
            } else {
                RESPONSE_JSON
            });
            message.extend_from_slice(data);
        }
        let response = answer::response_of(&d, trace, message);
        self.answer(&d.request_id, Outcome::Response(response), "delivered", now);
        self.delivered(&d.request_id, &key, now, outboxes);
        Ok(true)
    }

    /// The job was answered: out of flight, forgotten when safe, the queue pumped.
    fn delivered(&mut self, request_id: &str, key: &str, now: i64, outboxes: &mut Outboxes) {
        self.settle(request_id);
        if self.jobs.get(request_id).is_some_and(|j| j.acked) {
            self.forget(request_id);
        }
        self.pump(key, now, outboxes);
    }

    fn acknowledge(
        &mut self,
        conn: ConnId,
        request_id: &str,
        remove_body: bool,
        fast: bool,
    ) -> Result<bool, String> {
        let Some(job) = self
            .jobs
            .get(request_id)
            .filter(|j| j.place == Place::Sent(conn))
        else {
            if fast {
                return Ok(false);
            }
            return Err(format!("Acknowledge: unknown request id {request_id:?}"));
        };
        if job.ack_mode == MANUAL {
            if fast {
                return Ok(false);
            }
            return Err(MANUAL_ONLY.to_owned());
        }
        if fast && remove_body && matches!(job.body, Some(Body::Stored { .. })) {
            return Ok(false);
        }
        self.acked(request_id, remove_body);
        Ok(true)
    }

    /// The job is safe: its copy of the request goes (its stored body too when asked), and it
    /// is forgotten when answered.
    fn acked(&mut self, request_id: &str, remove_body: bool) {
        let Some(job) = self.jobs.get_mut(request_id) else {
            return;
        };
        if job.acked {
            return;
        }
        job.acked = true;
        job.headers = Vec::new();
        match job.body.take() {
            Some(Body::Stored { name, .. }) if remove_body => {
                self.effects.push(Effect::Remove(name))
            }
            Some(Body::Stored { name, size }) => job.body = Some(Body::Stored { name, size }),
            _ => {}
        }
        if self.jobs[request_id].answered {
            self.forget(request_id);
        }
    }

    /// The manual acknowledge URL of `request_id` was called with `token`: false for an
    /// unknown job, one not in manual mode, not sent or already acknowledged, or a wrong token.
    pub fn acknowledge_manual(&mut self, request_id: &str, token: &str) -> bool {
        match self.jobs.get(request_id) {
            Some(job)
                if job.ack_mode == MANUAL
                    && !job.acked
                    && matches!(job.place, Place::Sent(_))
                    && same_secret(&job.ack_token, token) =>
            {
                self.acked(request_id, true);
                true
            }
            _ => false,
        }
    }

    // ---- several relays ---------------------------------------------------------------------

    /// A job from another relay (`origin`), its `RequestTarget` msgpack from the bus, its
    /// pickup deadline in the hub's clock, its body in the shared store when `stored` names
    /// it. Over the budget it is refused at once (a 503 told to its origin). False: not a
    /// request the hub reads.
    #[allow(clippy::too_many_arguments)]
    pub fn take_remote(
        &mut self,
        key: &str,
        message: &[u8],
        pickup: i64,
        origin: &str,
        stored: Option<String>,
        now: i64,
        outboxes: &mut Outboxes,
    ) -> bool {
        let Some(r) = read_remote(message) else {
            return false;
        };
        if !self.tenants.contains_key(key) {
            return false;
        }
        // (a queue-mode request's origin is told `taken` only: `answer` tells it nothing more)
        let mut waiter = Waiter::Origin(origin.to_owned());
        if let Some(job) = self.jobs.get(&r.request_id) {
            // published here and taken here (the shortcut off): the job goes on as this
            // relay's own, its waiter with it, without its answers crossing the bus
            if origin != self.instance
                || !matches!(job.place, Place::Published | Place::Withdrawing)
            {
                return false;
            }
            let mut job = self.jobs.remove(&r.request_id).expect("looked up");
            waiter = std::mem::replace(&mut job.waiter, Waiter::Nobody);
            if let Waiter::Task(t) = &waiter {
                self.by_task.remove(t);
            }
        }
        let text: usize = r
            .headers
            .iter()
            .map(|(n, v)| n.chars().count() * v.len() + v.iter().map(|s| s.len()).sum::<usize>())
            .sum();
        let inline = r.body.as_ref().map_or(0, Vec::len);
        let size = JOB_OVERHEAD + (inline + r.url.chars().count() + text) as u64;
        let body = match (stored, r.body) {
            (Some(name), _) => Some(Body::Stored {
                name,
                size: r.body_size,
            }),
            (None, Some(b)) => Some(Body::Inline(b)),
            (None, None) => None,
        };
        if let Err((total, _, _)) = self.fits(key, size) {
            self.refused[usize::from(total)] += 1;
            if let Some(Body::Stored { name, .. }) = body {
                self.effects.push(Effect::Remove(name));
            }
            if let Waiter::Origin(instance) = waiter {
                self.effects.push(Effect::Tell {
                    instance,
                    request_id: r.request_id,
                    frame: b"s503".to_vec(),
                });
            }
            return true;
        }
        let job = Job {
            tenant: key.to_owned(),
            target: r.target,
            method: r.method,
            url: r.url,
            headers: r.headers,
            body_len: body.as_ref().map_or(0, Body::len),
            body,
            tracing: r.tracing,
            discard: r.discard,
            ack_mode: r.ack_mode.min(2),
            ack_token: String::new(),
            waiter,
            place: Place::Queued,
            acked: false,
            answered: false,
            pickup,
            due: pickup + (self.config.span - self.config.ttl),
            size,
            started: now,
            head: None,
            client_done: false,
        };
        self.hold(r.request_id, job, now, outboxes);
        true
    }

    /// A bus frame for a job this relay published (`TAKEN`, a response, a status).
    pub fn remote_reply(&mut self, request_id: &str, frame: &[u8], now: i64) {
        let Some(job) = self.jobs.get_mut(request_id) else {
            if frame.first() == Some(&RESPONSE_MSGPACK) || frame.first() == Some(&RESPONSE_JSON) {
                if let Ok(Message::Deliver(d)) =
                    read_message(&frame[1..], frame[0] == RESPONSE_MSGPACK)
                {
                    if d.stored() {
                        self.effects.push(Effect::RemoveResponse(d.request_id));
                    }
                }
            }
            return;
        };
        if !matches!(
            job.place,
            Place::Published | Place::Taken(_) | Place::Withdrawing
        ) {
            return;
        }
        match frame.split_first() {
            Some((&TAKEN, instance)) => {
                if job.discard {
                    self.forget(request_id);
                    return;
                }
                job.place = Place::Taken(String::from_utf8_lossy(instance).into_owned());
            }
            Some((&kind, rest)) if kind == RESPONSE_MSGPACK || kind == RESPONSE_JSON => {
                let Ok(Message::Deliver(d)) = read_message(rest, kind == RESPONSE_MSGPACK) else {
                    return;
                };
                let trace = job.tracing.then(|| self.config.trace(&d.request_id));
                let response = answer::response_of(&d, trace, Vec::new());
                job.answered = true;
                self.answer(request_id, Outcome::Response(response), "delivered", now);
                self.forget(request_id);
            }
            Some((&STATUS, code)) => {
                let status = std::str::from_utf8(code)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(503);
                let reason = match status {
                    408 => EXPIRED,
                    502 => BAD_ANSWER,
                    504 => NO_ANSWER_IN_TIME,
                    _ => CONNECTOR_UNAVAILABLE,
                };
                let record = if status == 408 { "expired" } else { "rejected" };
                job.answered = true;
                self.answer(request_id, Outcome::Status(status, reason), record, now);
                self.forget(request_id);
            }
            _ => {}
        }
    }

    /// The relay of `instance` died (or was given up: it may only be cut off): the jobs it had
    /// taken are answered 504, not 503 — they may have run, and may still answer.
    pub fn instance_gone(&mut self, instance: &str, now: i64) {
        let gone: Vec<String> = self
            .jobs
            .iter()
            .filter(|(_, j)| matches!(&j.place, Place::Taken(i) if i == instance))
            .map(|(r, _)| r.clone())
            .collect();
        for request_id in gone {
            self.answer(
                &request_id,
                Outcome::Status(504, TAKER_GONE),
                "rejected",
                now,
            );
            self.forget(&request_id);
        }
    }

    // ---- the body store, shutdown, what Python reads ---------------------------------------

    /// The stored request body of a job sent to a connector of `key`: (its name, whether
    /// the job is safe, so the body may be removed once fetched).
    pub fn request_body(&self, request_id: &str, key: &str) -> Option<(String, bool)> {
        let job = self.jobs.get(request_id).filter(|j| j.tenant == key)?;
        match &job.body {
            Some(Body::Stored { name, .. }) => Some((name.clone(), job.acked)),
            _ => None,
        }
    }

    /// The connector fetched the stored body and it is removed with the fetch.
    pub fn body_fetched(&mut self, request_id: &str) {
        if let Some(job) = self.jobs.get_mut(request_id) {
            job.body = None;
        }
    }

    /// The tenant key of a job this relay holds (a connector stores its answer's body first).
    pub fn tenant_of(&self, request_id: &str) -> Option<&str> {
        self.jobs.get(request_id).map(|j| j.tenant.as_str())
    }

    /// Every stored body a job still holds (the sweeper keeps them).
    pub fn stored_bodies(&self) -> Vec<String> {
        self.jobs
            .values()
            .filter_map(|j| match &j.body {
                Some(Body::Stored { name, .. }) => Some(name.clone()),
                _ => None,
            })
            .collect()
    }

    /// Shutting down: every waiter is answered 503 and every job dropped.
    pub fn close(&mut self, now: i64) {
        let all: Vec<String> = self.jobs.keys().cloned().collect();
        for request_id in all {
            self.answer(
                &request_id,
                Outcome::Status(503, CONNECTOR_UNAVAILABLE),
                "rejected",
                now,
            );
            self.forget(&request_id);
        }
        self.deadlines.clear();
        for t in self.tenants.values_mut() {
            t.queue.clear();
        }
    }

    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    pub fn has_effects(&self) -> bool {
        !self.effects.is_empty()
    }

    /// Jobs held (in flight, queued, published, or answered and waiting for their
    /// acknowledgement).
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// (tenant key, its name as the requests counter labels it, jobs in flight, jobs queued,
    /// connectors, budget bytes held) of every tenant with connectors or jobs here.
    pub fn tenant_gauges(&self) -> Vec<(String, String, u32, usize, usize, u64)> {
        self.tenants
            .iter()
            .filter(|(_, t)| t.pinned())
            .map(|(k, t)| {
                (
                    k.clone(),
                    t.name(k).to_owned(),
                    t.inflight,
                    t.queue.len(),
                    t.connectors.len(),
                    t.held,
                )
            })
            .collect()
    }

    pub fn held_total(&self) -> u64 {
        self.held_total
    }

    /// The jobs this relay handed to the cluster: (request id, the relay that took it, if one
    /// did yet).
    pub fn published(&self) -> Vec<(String, Option<String>)> {
        self.jobs
            .iter()
            .filter_map(|(r, j)| match &j.place {
                Place::Published | Place::Withdrawing => Some((r.clone(), None)),
                Place::Taken(i) => Some((r.clone(), Some(i.clone()))),
                _ => None,
            })
            .collect()
    }

    /// Whether a connector of the tenant is connected here.
    pub fn has_connector(&self, key: &str) -> bool {
        self.tenants
            .get(key)
            .is_some_and(|t| !t.connectors.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::http::StreamParser;
    use crate::dialects::tunnel::wire::{decode, FieldValue};

    const CONNECTOR: ConnId = 9;
    const CLIENT: ConnId = 1;
    const S: i64 = 1_000_000_000;

    fn config() -> Config {
        Config {
            origin_id: "origin".into(),
            ttl: 10 * S,
            span: 20 * S,
            inline_limit: 16 * 1024,
            default_limit: 0,
            default_ack_mode: 0,
            least_inflight: false,
            require_connection: false,
            shortcut: true,
            clustered: false,
            tenant_bytes: 64 << 20,
            total_bytes: 256 << 20,
            tenant_ttl: 10 * S,
            tenant_max: 100,
            machine: "m".into(),
            version: "v".into(),
        }
    }

    fn hub_with(config: Config, outboxes: &mut Outboxes) -> Hub {
        let mut hub = Hub::new(config, "me".into());
        let mut x: u32 = 12345;
        let entropy: Vec<u8> = (0..4096)
            .map(|_| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                (x >> 16) as u8
            })
            .collect();
        hub.refill(&entropy);
        let settings = TenantSettings {
            name: "Acme".into(),
            require_auth: false,
            max_concurrent: 0,
            ack_mode: None,
            forward_authorization: false,
        };
        hub.set_tenant("ACME", Some(settings), 0);
        for id in [CONNECTOR, CLIENT, CLIENT + 1, CLIENT + 2] {
            outboxes.open(id);
        }
        hub
    }

    fn head(raw: &str) -> RequestHead {
        let mut parser = StreamParser::new(Default::default());
        let out = parser.feed(raw.as_bytes());
        match out.events.into_iter().next() {
            Some(crate::codec::http::Event::Head(h)) => h,
            _ => panic!("no head"),
        }
    }

    fn get(path: &str) -> RequestHead {
        head(&format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n"))
    }

    fn step(hub: &mut Hub, o: &mut Outboxes, path: &str, waiter: Waiter, now: i64) -> Step {
        hub.step(
            &get(path),
            Some(Body::Inline(Vec::new())),
            waiter,
            None,
            (now, 0),
            false,
            o,
        )
    }

    /// The request ids sent to the connector so far, in order.
    fn sent(o: &mut Outboxes) -> Vec<String> {
        let Some(bytes) = o.take(CONNECTOR) else {
            return Vec::new();
        };
        let mut ids = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            // (the hub's frames: unmasked, one per message)
            let (len, head) = match bytes[at + 1] & 0x7f {
                126 => (
                    u16::from_be_bytes([bytes[at + 2], bytes[at + 3]]) as usize,
                    4,
                ),
                127 => (
                    u64::from_be_bytes(bytes[at + 2..at + 10].try_into().unwrap()) as usize,
                    10,
                ),
                n => (n as usize, 2),
            };
            let payload = &bytes[at + head..at + head + len];
            at += head + len;
            let (_, fields) = decode(payload, false).expect("a RequestTarget");
            if let FieldValue::Str(id) = &fields[0] {
                ids.push(id.clone());
            }
        }
        ids
    }

    fn deliver(id: &str, status: i64) -> Vec<u8> {
        format!(
            r#"{{"target":"Deliver","arguments":[{{"requestId":"{id}","requestOriginId":"origin","httpStatusCode":{status},"httpHeaders":{{}},"originalBodySize":2,"bodySize":2,"bodyContent":"aGk=","requestFailed":false}}]}}"#
        )
        .into_bytes()
    }

    #[test]
    fn routes_are_mode_tenant_target_and_the_rest() {
        let r = route("/RELAY/a%63me/t/x/y").unwrap();
        assert_eq!(
            (r.mode, &*r.tenant, &*r.target, r.rest),
            (Mode::Relay, "acme", "t", "x/y")
        );
        assert!(route("/relay/acme").is_none());
        assert!(route("/relay//t").is_none());
        assert!(route("/other/acme/t").is_none());
        assert!(
            valid_tenant_name("a-b.c_1") && !valid_tenant_name("-a") && !valid_tenant_name("é")
        );
    }

    #[test]
    fn a_request_is_sent_and_its_deliver_answers_the_client() {
        let mut o = Outboxes::new();
        let mut hub = hub_with(config(), &mut o);
        hub.add_connector("ACME", CONNECTOR, false, 0, &mut o);
        let Step::Held(id) = step(
            &mut hub,
            &mut o,
            "/relay/acme/app/x",
            Waiter::Client(CLIENT),
            0,
        ) else {
            panic!("not held");
        };
        assert_eq!(sent(&mut o), vec![id.clone()]);
        assert_eq!(
            hub.connector_message(CONNECTOR, &deliver(&id, 200), false, 1, true, &mut o),
            Ok(true)
        );
        let answer = String::from_utf8(o.take(CLIENT).unwrap()).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n") && answer.ends_with("hi"));
        assert!(hub.is_empty() && hub.held_total() == 0 && !hub.has_effects());
        assert_eq!(hub.requests[&("Acme".into(), "app".into(), 200)], 1);
        // the gauges name the tenant as the counter does: as stored, not by its key
        let gauges = hub.tenant_gauges();
        assert_eq!(
            (&*gauges[0].0, &*gauges[0].1, gauges[0].4),
            ("ACME", "Acme", 1)
        );
    }

    #[test]
    fn what_needs_python_is_a_step_for_it_and_the_fast_path_declines_it() {
        let mut o = Outboxes::new();
        let mut hub = hub_with(config(), &mut o);
        let fast = |hub: &mut Hub, o: &mut Outboxes, path: &str| {
            hub.step(
                &get(path),
                Some(Body::Inline(Vec::new())),
                Waiter::Client(CLIENT),
                None,
                (0, 0),
                true,
                o,
            )
        };
        assert_eq!(
            fast(&mut hub, &mut o, "/relay/other/app"),
            Step::Decline("tenant")
        );
        assert_eq!(
            step(&mut hub, &mut o, "/relay/other/app", Waiter::Task(1), 0),
            Step::Load("other".into())
        );
        hub.set_tenant("OTHER", None, 0);
        assert!(matches!(
            step(&mut hub, &mut o, "/relay/other/app", Waiter::Task(1), 0),
            Step::Refuse { status: 404, .. }
        ));
        hub.set_tenant(
            "SECURE",
            Some(TenantSettings {
                name: "secure".into(),
                require_auth: true,
                max_concurrent: 0,
                ack_mode: None,
                forward_authorization: false,
            }),
            0,
        );
        assert!(matches!(
            step(&mut hub, &mut o, "/relay/secure/app", Waiter::Task(1), 0),
            Step::Refuse { status: 401, .. }
        ));
        let with = |token: &str| {
            head(&format!("GET /relay/secure/app HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n\r\n"))
        };
        let s = hub.step(
            &with("tok"),
            None,
            Waiter::Task(1),
            None,
            (0, 5),
            false,
            &mut o,
        );
        assert_eq!(s, Step::Verify("tok".into()));
        hub.add_token("tok", "acme", 10, ROLE_CLIENT);
        let s = hub.step(
            &with("tok"),
            None,
            Waiter::Task(1),
            None,
            (0, 5),
            false,
            &mut o,
        );
        assert_eq!(
            s,
            Step::Refuse {
                status: 401,
                reason: OTHER_TENANT.into()
            }
        );
        hub.add_token("good", "secure", 10, ROLE_CLIENT);
        assert_eq!(
            hub.step(
                &with("good"),
                None,
                Waiter::Task(1),
                None,
                (0, 5),
                false,
                &mut o
            ),
            Step::Body
        );
        assert_eq!(
            hub.step(
                &with("good"),
                None,
                Waiter::Task(1),
                None,
                (0, 11),
                false,
                &mut o
            ),
            Step::Verify("good".into())
        );
        // a tenant's lookup expires: asked for again
        assert_eq!(
            step(&mut hub, &mut o, "/relay/acme/app", Waiter::Task(1), 11 * S),
            Step::Load("acme".into())
        );
    }

    #[test]
    fn the_budget_refuses_before_anything_is_kept() {
        let mut o = Outboxes::new();
        let mut hub = hub_with(
            Config {
                tenant_bytes: 2 * JOB_OVERHEAD + 100,
                ..config()
            },
            &mut o,
        );
        assert!(matches!(
            step(&mut hub, &mut o, "/queue/acme/app", Waiter::Task(1), 0),
            Step::Accepted(_)
        ));
        let Step::Refuse { status, reason } = step(&mut hub, &mut o, "/relay/acme/app/a/b/c/d/e/f/g/h/i/j/k/l/m/n/o/p/q/r/s/t/u/v/w/x/y/z/0123456789012345678901234567890123456789012345678901234567890123456789", Waiter::Task(2), 0) else {
            panic!("not refused");
        };
        assert_eq!(status, 503);
        assert!(reason.contains("--tunnel-tenant-bytes"));
        assert_eq!(hub.len(), 1);
        assert_eq!(hub.refused, [1, 0]);
    }

    #[test]
    fn a_limit_queues_in_order_and_each_answer_sends_the_next() {
        let mut o = Outboxes::new();
        let mut hub = hub_with(
            Config {
                default_limit: 1,
                ..config()
            },
            &mut o,
        );
        hub.add_connector("ACME", CONNECTOR, false, 0, &mut o);
        let ids: Vec<String> = (0..3)
            .map(
                |n| match step(&mut hub, &mut o, "/relay/acme/app", Waiter::Task(n), 0) {
                    Step::Held(id) => id,
                    other => panic!("{other:?}"),
                },
            )
            .collect();
        assert_eq!(sent(&mut o), vec![ids[0].clone()]);
        for (n, id) in ids.iter().enumerate() {
            assert_eq!(
                hub.connector_message(CONNECTOR, &deliver(id, 200), false, 1, false, &mut o),
                Ok(true)
            );
            let effects = hub.take_effects();
            assert!(matches!(&effects[..], [Effect::Resolve { token, .. }] if *token == n as u64));
            assert_eq!(
                sent(&mut o),
                ids.get(n + 1).cloned().into_iter().collect::<Vec<_>>()
            );
        }
        assert!(hub.is_empty());
    }

    #[test]
    fn deadlines_are_408_while_queued_and_504_once_sent() {
        let mut o = Outboxes::new();
        let mut hub = hub_with(
            Config {
                tenant_ttl: 100 * S,
                ..config()
            },
            &mut o,
        );
        let Step::Held(queued) = step(&mut hub, &mut o, "/relay/acme/app", Waiter::Task(1), 0)
        else {
            panic!()
        };
        hub.add_connector("ACME", 5, false, 0, &mut o); // (no outbox: it reads nothing)
        hub.remove_connector(5, 0, &mut o);
        assert_eq!(hub.next_deadline(), None); // sent, then 504 (may have run): nothing left
        assert!(matches!(
            &hub.take_effects()[..],
            [Effect::Resolve {
                outcome: Outcome::Status(504, CONNECTOR_LEFT),
                ..
            }]
        ));
        let Step::Held(_) = step(&mut hub, &mut o, "/relay/acme/app", Waiter::Task(2), S) else {
            panic!()
        };
        assert_eq!(hub.next_deadline(), Some(11 * S));
        hub.expire(11 * S, 0, &mut o);
        assert!(matches!(
            &hub.take_effects()[..],
            [Effect::Resolve {
                token: 2,
                outcome: Outcome::Status(408, EXPIRED)
            }]
        ));
        assert_eq!(hub.expired, 1);
        hub.add_connector("ACME", CONNECTOR, false, 12 * S, &mut o);
        let Step::Held(id) = step(&mut hub, &mut o, "/relay/acme/app", Waiter::Task(3), 12 * S)
        else {
            panic!()
        };
        hub.expire(32 * S, 0, &mut o);
        assert!(matches!(
            &hub.take_effects()[..],
            [Effect::Resolve {
                token: 3,
                outcome: Outcome::Status(504, NO_ANSWER_IN_TIME)
            }]
        ));
        // the late answer is dropped, the job forgotten
        assert_eq!(
            hub.connector_message(CONNECTOR, &deliver(&id, 200), false, 33 * S, false, &mut o),
            Ok(true)
        );
        assert!(hub.is_empty(), "{queued}");
    }

    #[test]
    fn an_unacknowledged_job_goes_again_to_the_next_connector() {
        let mut o = Outboxes::new();
        let mut hub = hub_with(
            Config {
                default_ack_mode: 1,
                ..config()
            },
            &mut o,
        );
        hub.add_connector("ACME", 5, false, 0, &mut o);
        let Step::Held(id) = step(&mut hub, &mut o, "/relay/acme/app", Waiter::Task(1), 0) else {
            panic!()
        };
        hub.remove_connector(5, 0, &mut o);
        assert_eq!(hub.redelivered, 1);
        hub.add_connector("ACME", CONNECTOR, false, 0, &mut o);
        assert_eq!(sent(&mut o), vec![id.clone()]);
        let ack = format!(
            r#"{{"target":"Acknowledge","arguments":[{{"originId":"origin","requestId":"{id}"}}]}}"#
        );
        assert_eq!(
            hub.connector_message(CONNECTOR, ack.as_bytes(), false, 0, true, &mut o),
            Ok(true)
        );
        assert_eq!(
            hub.connector_message(CONNECTOR, &deliver(&id, 200), false, 0, false, &mut o),
            Ok(true)
        );
        assert!(hub.is_empty());
        let unknown = hub.connector_message(CONNECTOR, ack.as_bytes(), false, 0, false, &mut o);
        assert!(unknown
            .unwrap_err()
            .starts_with("Acknowledge: unknown request id"));
    }

    #[test]
    fn a_manual_job_is_acknowledged_by_its_url_token_only() {
        let mut o = Outboxes::new();
        let mut hub = hub_with(
            Config {
                default_ack_mode: MANUAL,
                ..config()
            },
            &mut o,
        );
        hub.add_connector("ACME", CONNECTOR, false, 0, &mut o);
        let Step::Held(id) = step(&mut hub, &mut o, "/relay/acme/app", Waiter::Task(1), 0) else {
            panic!()
        };
        let token = hub.jobs[&id].ack_token.clone();
        assert_eq!(
            hub.connector_message(CONNECTOR, &deliver(&id, 200), false, 0, false, &mut o),
            Ok(true)
        );
        assert!(!hub.acknowledge_manual(&id, "guessed"));
        assert!(hub.acknowledge_manual(&id, &token));
        assert!(!hub.acknowledge_manual(&id, &token));
        assert!(hub.is_empty());
    }

    #[test]
    fn a_published_job_is_answered_from_the_bus() {
        let mut o = Outboxes::new();
        let mut hub = hub_with(
            Config {
                clustered: true,
                ..config()
            },
            &mut o,
        );
        let Step::Publish {
            request_id,
            message,
            pickup,
        } = step(&mut hub, &mut o, "/relay/acme/app/x", Waiter::Task(1), 0)
        else {
            panic!()
        };
        assert_eq!(pickup, 10 * S);
        // another relay takes it: its `RequestTarget` decodes there, its answers come back
        let mut other = hub_with(config(), &mut o);
        other.add_connector("ACME", CONNECTOR, true, 0, &mut o);
        assert!(other.take_remote("ACME", &message, pickup, "me", None, 0, &mut o));
        let effects = other.take_effects();
        let [Effect::Tell { frame, .. }] = &effects[..] else {
            panic!("{effects:?}")
        };
        hub.remote_reply(&request_id, frame, 1);
        hub.expire(11 * S, 0, &mut o); // taken: no 408
        assert!(!hub.has_effects());
        let mut answer = vec![RESPONSE_JSON];
        answer.extend_from_slice(&deliver(&request_id, 201));
        hub.remote_reply(&request_id, &answer, 2);
        assert!(
            matches!(&hub.take_effects()[..], [Effect::Resolve { token: 1, outcome: Outcome::Response(r) }] if r.status == 201 && r.body == b"hi")
        );
        assert!(hub.is_empty());
    }

    #[test]
    fn a_published_job_is_withdrawn_not_refused_on_a_guess() {
        let mut o = Outboxes::new();
        let mut hub = hub_with(
            Config {
                clustered: true,
                ..config()
            },
            &mut o,
        );
        fn publish(hub: &mut Hub, o: &mut Outboxes, token: u64) -> String {
            let Step::Publish { request_id, .. } =
                step(hub, o, "/relay/acme/app/x", Waiter::Task(token), 0)
            else {
                panic!()
            };
            request_id
        }
        let withdraw = |hub: &mut Hub, id: &str| {
            let effects = hub.take_effects();
            assert!(
                matches!(&effects[..], [Effect::Withdraw { request_id, tenant, pickup: 10_000_000_000 }] if request_id == id && tenant == "ACME"),
                "{effects:?}"
            );
        };
        // the publish failed: withdrawn before pickup is 503
        let failed = publish(&mut hub, &mut o, 1);
        hub.publish_failed(&failed);
        withdraw(&mut hub, &failed);
        hub.withdrawn(&failed, S);
        assert!(matches!(
            &hub.take_effects()[..],
            [Effect::Resolve {
                token: 1,
                outcome: Outcome::Status(503, TRANSPORT_FAILURE)
            }]
        ));
        // the pickup deadline passes untaken: a withdraw, no 408 yet; withdrawn: 408
        let late = publish(&mut hub, &mut o, 2);
        // another one is found taken at its pickup deadline: its answer comes from the bus
        let taken = publish(&mut hub, &mut o, 3);
        // and one whose verdict never comes: 504 at its answer deadline, then forgotten
        let unknown = publish(&mut hub, &mut o, 4);
        hub.expire(10 * S, 0, &mut o);
        let effects = hub.take_effects();
        assert_eq!(effects.len(), 3, "{effects:?}");
        assert!(effects.iter().all(|e| matches!(e, Effect::Withdraw { .. })));
        hub.expire(10 * S, 0, &mut o); // asked once
        assert!(!hub.has_effects());
        hub.withdrawn(&late, 10 * S);
        assert!(matches!(
            &hub.take_effects()[..],
            [Effect::Resolve {
                token: 2,
                outcome: Outcome::Status(408, EXPIRED)
            }]
        ));
        hub.taken_by(&taken, "b");
        hub.withdrawn(&taken, 10 * S); // (a verdict contradicting it is ignored)
        assert!(!hub.has_effects());
        assert!(hub.published().contains(&(taken.clone(), Some("b".into()))));
        let mut answer = vec![RESPONSE_JSON];
        answer.extend_from_slice(&deliver(&taken, 201));
        hub.remote_reply(&taken, &answer, 11 * S);
        assert!(
            matches!(&hub.take_effects()[..], [Effect::Resolve { token: 3, outcome: Outcome::Response(r) }] if r.status == 201)
        );
        hub.expire(20 * S, 0, &mut o);
        assert!(matches!(
            &hub.take_effects()[..],
            [Effect::Resolve {
                token: 4,
                outcome: Outcome::Status(504, NO_ANSWER_IN_TIME)
            }]
        ));
        hub.taken_by(&unknown, "b");
        assert!(hub.is_empty());
    }

    #[test]
    fn the_tenant_cache_keeps_connected_tenants_and_drops_the_oldest_idle() {
        let mut o = Outboxes::new();
        let mut hub = hub_with(
            Config {
                tenant_max: 8,
                ..config()
            },
            &mut o,
        );
        hub.add_connector("ACME", CONNECTOR, false, 0, &mut o);
        for n in 0..50 {
            hub.set_tenant(&format!("T{n}"), None, n);
            assert!(hub.tenants_cached() <= 8);
        }
        assert!(hub.tenant("ACME", 1).is_some());
        assert!(hub.tenant("T49", 50).is_some());
    }
}

pub mod py {
    //! `TunnelHub` and the connector websocket's `TunnelScanner` (module docstring above).

    use pyo3::exceptions::PyValueError;
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyList, PyTuple};

    use super::{Body, Config, Effect, Hub, Outcome, Step, TenantSettings, Waiter};
    use crate::codec::http::py::{events_list, HttpRequest, HttpStreamParser};
    use crate::codec::http::{encode_response, Event};
    use crate::codec::mask::Payload;
    use crate::codec::scanner::py::Scanner;
    use crate::codec::scanner::{ScanFeed, Scanned};
    use crate::codec::ws::py::payload_bytes;
    use crate::forward::outboxes::py::{open_outboxes, Outboxes};
    use crate::forward::routes::ConnId;

    // the kinds of `step`'s answer and of the effects (dialects/tunnel/hub.py names them)
    const REFUSE: u8 = 0;
    const LOAD: u8 = 1;
    const VERIFY: u8 = 2;
    const REACH: u8 = 3;
    const BODY: u8 = 4;
    const HELD: u8 = 5;
    const ACCEPTED: u8 = 6;
    const PUBLISH: u8 = 7;
    const RESOLVE: u8 = 0;
    const ANSWER: u8 = 1;
    const TELL: u8 = 2;
    const REMOVE: u8 = 3;
    const REMOVE_RESPONSE: u8 = 4;
    const WITHDRAW: u8 = 5;

    /// The hub and the outboxes it writes into (its clients' and connectors').
    #[pyclass(module = "rmb_relay._core", name = "TunnelHub")]
    pub struct TunnelHub {
        inner: Hub,
        outboxes: Py<Outboxes>,
    }

    /// An outcome for Python: (status, reason, headers, body, stored size, request id); a
    /// relay's own answer has a reason and nothing else, a connector's no reason.
    fn outcome_tuple<'py>(py: Python<'py>, outcome: Outcome) -> PyResult<Bound<'py, PyTuple>> {
        match outcome {
            Outcome::Status(status, reason) => {
                (status, reason, py.None(), py.None(), py.None(), py.None()).into_pyobject(py)
            }
            Outcome::Response(r) => (
                r.status,
                py.None(),
                r.headers,
                PyBytes::new(py, &r.body),
                r.stored,
                r.request_id,
            )
                .into_pyobject(py),
        }
    }

    impl TunnelHub {
        fn effects<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
            let out = PyList::empty(py);
            if !self.inner.has_effects() {
                return Ok(out);
            }
            let boxes = self.outboxes.bind(py).try_borrow()?;
            for effect in self.inner.take_effects() {
                let item = match effect {
                    Effect::Resolve { token, outcome } => {
                        (RESOLVE, token, outcome_tuple(py, outcome)?).into_pyobject(py)?
                    }
                    Effect::Answer {
                        conn,
                        head,
                        outcome,
                    } => {
                        let Some(conn) = boxes.conn(py, conn) else {
                            continue; // the client is gone
                        };
                        let request = match head {
                            Some(h) => Some(Py::new(py, HttpRequest::from_head(py, h))?),
                            None => None,
                        };
                        (ANSWER, conn, request, outcome_tuple(py, outcome)?).into_pyobject(py)?
                    }
                    Effect::Tell {
                        instance,
                        request_id,
                        frame,
                    } => {
                        (TELL, instance, request_id, PyBytes::new(py, &frame)).into_pyobject(py)?
                    }
                    Effect::Remove(name) => (REMOVE, name)
                        .into_pyobject(py)?
                        .into_any()
                        .downcast_into()?,
                    Effect::RemoveResponse(id) => (REMOVE_RESPONSE, id)
                        .into_pyobject(py)?
                        .into_any()
                        .downcast_into()?,
                    Effect::Withdraw {
                        request_id,
                        tenant,
                        pickup,
                    } => (WITHDRAW, request_id, tenant, pickup)
                        .into_pyobject(py)?
                        .into_any()
                        .downcast_into()?,
                };
                out.append(item)?;
            }
            Ok(out)
        }

        fn step_tuple<'py>(py: Python<'py>, step: Step) -> PyResult<Bound<'py, PyTuple>> {
            Ok(match step {
                Step::Refuse { status, reason } => (REFUSE, status, reason).into_pyobject(py)?,
                Step::Load(name) => (LOAD, name).into_pyobject(py)?.into_any().downcast_into()?,
                Step::Verify(token) => (VERIFY, token)
                    .into_pyobject(py)?
                    .into_any()
                    .downcast_into()?,
                Step::Reach(key) => (REACH, key).into_pyobject(py)?.into_any().downcast_into()?,
                Step::Body => (BODY,).into_pyobject(py)?.into_any().downcast_into()?,
                Step::Held(id) => (HELD, id).into_pyobject(py)?.into_any().downcast_into()?,
                Step::Accepted(id) => (ACCEPTED, id)
                    .into_pyobject(py)?
                    .into_any()
                    .downcast_into()?,
                Step::Publish {
                    request_id,
                    message,
                    pickup,
                } => (PUBLISH, request_id, PyBytes::new(py, &message), pickup).into_pyobject(py)?,
                Step::Decline(why) => (REFUSE, 500u16, why).into_pyobject(py)?,
            })
        }
    }

    #[pymethods]
    impl TunnelHub {
        #[new]
        #[pyo3(signature = (
            outboxes, origin_id, instance, *, ttl, span, inline_limit, default_limit,
            default_ack_mode, least_inflight, require_connection, shortcut, clustered,
            tenant_bytes, total_bytes, tenant_ttl, tenant_max, machine, version
        ))]
        #[allow(clippy::too_many_arguments)]
        fn new(
            outboxes: Py<Outboxes>,
            origin_id: String,
            instance: String,
            ttl: i64,
            span: i64,
            inline_limit: usize,
            default_limit: u32,
            default_ack_mode: u8,
            least_inflight: bool,
            require_connection: bool,
            shortcut: bool,
            clustered: bool,
            tenant_bytes: u64,
            total_bytes: u64,
            tenant_ttl: i64,
            tenant_max: usize,
            machine: String,
            version: String,
        ) -> PyResult<Self> {
            if default_ack_mode > super::MANUAL {
                return Err(PyValueError::new_err(
                    "acknowledge modes are 0 (disabled) to 3 (manual)",
                ));
            }
            let config = Config {
                origin_id,
                ttl,
                span,
                inline_limit,
                default_limit,
                default_ack_mode,
                least_inflight,
                require_connection,
                shortcut,
                clustered,
                tenant_bytes,
                total_bytes,
                tenant_ttl,
                tenant_max: tenant_max.max(1),
                machine,
                version,
            };
            Ok(TunnelHub {
                inner: Hub::new(config, instance),
                outboxes,
            })
        }

        /// A client's read (the fast path): None when the hub took its request (its answer
        /// comes through the client's outbox, or as an effect), else the read's events
        /// exactly as `HttpStreamParser.feed` gives them.
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
            let mut out = parser.inner.feed(data);
            let whole = out.error.is_none()
                && matches!(out.events.first(), Some(Event::Head(_)))
                && matches!(out.events.last(), Some(Event::End(t)) if t.is_empty())
                && out.events[1..out.events.len() - 1]
                    .iter()
                    .all(|e| matches!(e, Event::Data(_)));
            if !whole {
                if let Some(Event::Head(head)) = out.events.first() {
                    if super::route(&head.path).is_some() {
                        *self.inner.fast_declined.entry("request").or_default() += 1;
                    }
                }
                return events_list(py, out).map(Some);
            }
            let Event::Head(head) = &out.events[0] else {
                unreachable!("checked above")
            };
            let hosts = head.headers.iter().filter(|(n, _)| n == "host").count();
            let length = match head.framing {
                crate::codec::http::Framing::Length(n) => n as usize,
                crate::codec::http::Framing::Chunked => usize::MAX,
            };
            if !head.keep_alive
                || head.is_websocket_upgrade
                || head.expect_continue
                || head.method == "HEAD"
                || length > self.inner.config.inline_limit
                || (hosts != 1 && !(hosts == 0 && head.version == 0))
            {
                if super::route(&head.path).is_some() {
                    *self.inner.fast_declined.entry("request").or_default() += 1;
                }
                return events_list(py, out).map(Some);
            }
            let body: Vec<u8> = out.events[1..out.events.len() - 1]
                .iter()
                .flat_map(|e| match e {
                    Event::Data(d) => d.iter().copied(),
                    _ => [].iter().copied(),
                })
                .collect();
            let mut boxes = self.outboxes.bind(py).try_borrow_mut()?;
            let step = self.inner.step(
                head,
                Some(Body::Inline(body)),
                Waiter::Client(client),
                None,
                (now, wall),
                true,
                &mut boxes.inner,
            );
            match step {
                Step::Decline("path") => {}
                Step::Decline(why) => *self.inner.fast_declined.entry(why).or_default() += 1,
                _ => self.inner.fast_taken += 1,
            }
            let accepted = match step {
                Step::Held(request_id) => {
                    let Event::Head(head) = out.events.swap_remove(0) else {
                        unreachable!("checked above")
                    };
                    self.inner.attach(&request_id, head);
                    false
                }
                Step::Accepted(_) => true,
                _ => return events_list(py, out).map(Some),
            };
            if !boxes.inner.is_open(client) {
                // once per connection: it stays open until the connection is lost
                boxes.open(client, conn.clone().unbind(), "tunnel");
            }
            if accepted {
                let method = match &out.events[0] {
                    Event::Head(h) => h.method.clone(),
                    _ => String::new(),
                };
                let bytes = encode_response(202, &[], b"", false).expect("a valid answer");
                boxes.inner.push_marked(client, &bytes);
                *self.inner.http.entry((method, 202)).or_default() += 1;
            }
            Ok(None)
        }

        /// A client request on the Python side: the next step (module docstring) as a tuple
        /// whose first item is the kind. `body`: None (not read), bytes (inline) or (store
        /// name, size); `token`: the task's, for the answer's effect.
        #[pyo3(signature = (request, body, token, reachable, now, wall))]
        #[allow(clippy::too_many_arguments)]
        fn step<'py>(
            &mut self,
            py: Python<'py>,
            request: PyRef<'py, HttpRequest>,
            body: Option<&Bound<'py, PyAny>>,
            token: u64,
            reachable: Option<bool>,
            now: i64,
            wall: i64,
        ) -> PyResult<Bound<'py, PyTuple>> {
            let body = match body {
                None => None,
                Some(b) if b.is_instance_of::<PyBytes>() => {
                    Some(Body::Inline(b.downcast::<PyBytes>()?.as_bytes().to_vec()))
                }
                Some(b) => {
                    let (name, size): (String, u64) = b.extract()?;
                    Some(Body::Stored { name, size })
                }
            };
            let mut boxes = self.outboxes.bind(py).try_borrow_mut()?;
            let step = self.inner.step(
                request.head(),
                body,
                Waiter::Task(token),
                reachable,
                (now, wall),
                false,
                &mut boxes.inner,
            );
            Self::step_tuple(py, step)
        }

        /// What Python must do now (module docstring), as tuples whose first item is the kind.
        fn take_effects<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
            self.effects(py)
        }

        #[getter]
        fn has_effects(&self) -> bool {
            self.inner.has_effects()
        }

        /// The directory's answer for tenant `key`: (name, require_auth, max_concurrent,
        /// ack_mode or None), or None for no such tenant.
        fn set_tenant(
            &mut self,
            key: &str,
            settings: Option<(String, bool, u32, Option<u8>, bool)>,
            now: i64,
        ) {
            let settings = settings.map(
                |(name, require_auth, max_concurrent, ack_mode, forward_authorization)| {
                    TenantSettings {
                        name,
                        require_auth,
                        max_concurrent,
                        ack_mode,
                        forward_authorization,
                    }
                },
            );
            self.inner.set_tenant(key, settings, now);
        }

        /// The cached lookup of tenant `key` at `now`: None when not cached (or stale), else
        /// its stored name, None when there is no such tenant.
        fn cached(&self, key: &str, now: i64) -> Option<Option<String>> {
            self.inner
                .tenant(key, now)
                .map(|s| s.map(|s| s.name.clone()))
        }

        fn forget_tenant(&mut self, key: &str) {
            self.inner.forget_tenant(key);
        }

        #[getter]
        fn tenants_cached(&self) -> usize {
            self.inner.tenants_cached()
        }

        /// A token that passed the full check (tokens.py's cache of verdicts), with the roles
        /// its scopes give (`ROLE_*`).
        #[pyo3(signature = (token, tenant, until, roles, /))]
        fn add_token(&mut self, token: &str, tenant: &str, until: i64, roles: u8) {
            self.inner.add_token(token, tenant, until, roles);
        }

        /// The tenant claim and roles of a verified token still good at `wall`.
        #[pyo3(signature = (token, wall, /))]
        fn known_token(&self, token: &str, wall: i64) -> Option<(String, u8)> {
            self.inner
                .known_token(token, wall)
                .map(|(c, r)| (c.to_owned(), r))
        }

        /// Verdicts of every token of tenant `key` go (it was removed or re-keyed).
        fn forget_tokens(&mut self, key: &str) {
            self.inner.forget_tokens(key);
        }

        fn refill(&mut self, entropy: &Bound<'_, PyBytes>) {
            self.inner.refill(entropy.as_bytes());
        }

        #[getter]
        fn ids_left(&self) -> usize {
            self.inner.ids_left()
        }

        fn add_connector(
            &mut self,
            py: Python<'_>,
            key: &str,
            conn_id: ConnId,
            binary: bool,
            now: i64,
        ) -> PyResult<()> {
            let mut boxes = self.outboxes.bind(py).try_borrow_mut()?;
            self.inner
                .add_connector(key, conn_id, binary, now, &mut boxes.inner);
            Ok(())
        }

        fn remove_connector(&mut self, py: Python<'_>, conn_id: ConnId, now: i64) -> PyResult<()> {
            let mut boxes = self.outboxes.bind(py).try_borrow_mut()?;
            self.inner.remove_connector(conn_id, now, &mut boxes.inner);
            Ok(())
        }

        /// A connector's message on the Python side: None when handled, else the text of the
        /// `Error` it is answered with.
        fn connector_message(
            &mut self,
            py: Python<'_>,
            conn_id: ConnId,
            data: &[u8],
            binary: bool,
            now: i64,
        ) -> PyResult<Option<String>> {
            let mut boxes = self.outboxes.bind(py).try_borrow_mut()?;
            Ok(
                match self.inner.connector_message(
                    conn_id,
                    data,
                    binary,
                    now,
                    false,
                    &mut boxes.inner,
                ) {
                    Ok(true) => None,
                    Ok(false) => Some("not a connector of this relay".to_owned()),
                    Err(reason) => Some(reason),
                },
            )
        }

        fn expire(&mut self, py: Python<'_>, now: i64, slack: i64) -> PyResult<()> {
            let mut boxes = self.outboxes.bind(py).try_borrow_mut()?;
            self.inner.expire(now, slack, &mut boxes.inner);
            Ok(())
        }

        #[getter]
        fn next_deadline(&mut self) -> Option<i64> {
            self.inner.next_deadline()
        }

        fn abandon_client(&mut self, conn_id: ConnId) {
            self.inner.abandon_client(conn_id);
        }

        fn abandon_task(&mut self, token: u64) {
            self.inner.abandon_task(token);
        }

        fn client_done(&mut self, conn_id: ConnId) {
            self.inner.client_done(conn_id);
        }

        fn acknowledge_manual(&mut self, request_id: &str, token: &str) -> bool {
            self.inner.acknowledge_manual(request_id, token)
        }

        #[allow(clippy::too_many_arguments)]
        #[pyo3(signature = (key, message, pickup, origin, stored, now))]
        fn take_remote(
            &mut self,
            py: Python<'_>,
            key: &str,
            message: &[u8],
            pickup: i64,
            origin: &str,
            stored: Option<String>,
            now: i64,
        ) -> PyResult<bool> {
            let mut boxes = self.outboxes.bind(py).try_borrow_mut()?;
            Ok(self
                .inner
                .take_remote(key, message, pickup, origin, stored, now, &mut boxes.inner))
        }

        fn remote_reply(&mut self, request_id: &str, frame: &[u8], now: i64) {
            self.inner.remote_reply(request_id, frame, now);
        }

        fn instance_gone(&mut self, instance: &str, now: i64) {
            self.inner.instance_gone(instance, now);
        }

        fn unpublish(&mut self, request_id: &str) {
            self.inner.unpublish(request_id);
        }

        fn publish_failed(&mut self, request_id: &str) {
            self.inner.publish_failed(request_id);
        }

        fn withdrawn(&mut self, request_id: &str, now: i64) {
            self.inner.withdrawn(request_id, now);
        }

        fn taken_by(&mut self, request_id: &str, instance: &str) {
            self.inner.taken_by(request_id, instance);
        }

        fn request_body(&self, request_id: &str, key: &str) -> Option<(String, bool)> {
            self.inner.request_body(request_id, key)
        }

        fn body_fetched(&mut self, request_id: &str) {
            self.inner.body_fetched(request_id);
        }

        fn tenant_of(&self, request_id: &str) -> Option<String> {
            self.inner.tenant_of(request_id).map(str::to_owned)
        }

        fn has_connector(&self, key: &str) -> bool {
            self.inner.has_connector(key)
        }

        fn published(&self) -> Vec<(String, Option<String>)> {
            self.inner.published()
        }

        fn stored_bodies(&self) -> Vec<String> {
            self.inner.stored_bodies()
        }

        #[allow(clippy::too_many_arguments)]
        fn count_refusal(
            &mut self,
            name: &str,
            dst: Option<String>,
            status: u16,
            outcome: &str,
            reason: &str,
            started: i64,
            now: i64,
        ) -> PyResult<()> {
            let outcome = match outcome {
                "rejected" => "rejected",
                "expired" => "expired",
                _ => return Err(PyValueError::new_err("outcome is rejected or expired")),
            };
            let reason: &'static str = match reason {
                "unauthorized" => "unauthorized",
                "transport failure" => "transport failure",
                "no connector" => "no connector",
                "body too large" => "body too large",
                _ => return Err(PyValueError::new_err("an unknown refusal reason")),
            };
            self.inner
                .count_refusal(name, dst, status, outcome, reason, started, now);
            Ok(())
        }

        fn close(&mut self, now: i64) {
            self.inner.close(now);
        }

        fn __len__(&self) -> usize {
            self.inner.len()
        }

        /// ((tenant, target, status), count) of the answers (`rmb_relay_tunnel_requests_total`).
        fn requests(&self) -> Vec<((String, String, String), u64)> {
            self.inner
                .requests
                .iter()
                .map(|((t, g, s), n)| ((t.clone(), g.clone(), s.to_string()), *n))
                .collect()
        }

        /// ((method, status), count) of the answers the hub wrote itself.
        fn http_answers(&self) -> Vec<((String, String), u64)> {
            self.inner
                .http
                .iter()
                .map(|((m, s), n)| ((m.clone(), s.to_string()), *n))
                .collect()
        }

        /// (outcome, count): `taken`, or the reason the fast path left a request to Python.
        fn fast_path(&self) -> Vec<(String, u64)> {
            let mut out = vec![("taken".to_owned(), self.inner.fast_taken)];
            out.extend(
                self.inner
                    .fast_declined
                    .iter()
                    .map(|(r, n)| ((*r).to_owned(), *n)),
            );
            out
        }

        #[getter]
        fn expired(&self) -> u64 {
            self.inner.expired
        }

        #[getter]
        fn redelivered(&self) -> u64 {
            self.inner.redelivered
        }

        /// Refusals at the memory budget: (tenant limit, total limit).
        #[getter]
        fn refused(&self) -> (u64, u64) {
            (self.inner.refused[0], self.inner.refused[1])
        }

        /// (tenant key, stored name, in flight, queued, connectors, bytes held) of each tenant
        /// active here.
        fn tenant_gauges(&self) -> Vec<(String, String, u32, usize, usize, u64)> {
            self.inner.tenant_gauges()
        }

        #[getter]
        fn held_total(&self) -> u64 {
            self.inner.held_total()
        }

        #[getter]
        fn get_recording(&self) -> bool {
            self.inner.recording
        }

        #[setter]
        fn set_recording(&mut self, on: bool) {
            self.inner.recording = on;
        }

        /// The route records since the last call, in the hub's clock: (time, dst, size,
        /// route, outcome, reason, started).
        #[allow(clippy::type_complexity)]
        fn take_records(
            &mut self,
        ) -> Vec<(
            i64,
            Option<String>,
            u64,
            &'static str,
            &'static str,
            Option<&'static str>,
            i64,
        )> {
            std::mem::take(&mut self.inner.records)
                .into_iter()
                .map(|r| {
                    (
                        r.time, r.dst, r.size, r.route, r.outcome, r.reason, r.started,
                    )
                })
                .collect()
        }
    }

    /// The scanner of one connector's websocket: each message the hub handles without
    /// Python (module docstring: a `Deliver` for a fast-path client, an `Acknowledge`) is
    /// taken inside the decoder's `feed`; every other message, and every later one of the
    /// same read, goes to Python as it came.
    #[pyclass(extends = Scanner, module = "rmb_relay._core", name = "TunnelScanner", frozen)]
    pub struct TunnelScanner {
        hub: Py<TunnelHub>,
        outboxes: Py<Outboxes>,
        #[pyo3(get)]
        conn_id: u64,
        #[pyo3(get)]
        binary: bool,
    }

    #[pymethods]
    impl TunnelScanner {
        #[new]
        fn new(py: Python<'_>, hub: Py<TunnelHub>, conn_id: u64, binary: bool) -> (Self, Scanner) {
            let outboxes = hub.borrow(py).outboxes.clone_ref(py);
            (
                TunnelScanner {
                    hub,
                    outboxes,
                    conn_id,
                    binary,
                },
                Scanner::new(start_tunnel),
            )
        }

        fn __repr__(&self) -> String {
            format!(
                "TunnelScanner(conn_id={}, binary={})",
                self.conn_id, self.binary
            )
        }
    }

    struct TunnelFeed<'py> {
        hub: PyRefMut<'py, TunnelHub>,
        outboxes: Option<PyRefMut<'py, Outboxes>>,
        connector: u64,
        binary: bool,
        /// the message unmasked, reused across the feed's messages
        scratch: Vec<u8>,
    }

    fn start_tunnel<'a, 'py>(scanner: &'a Bound<'py, PyAny>) -> PyResult<Box<dyn ScanFeed + 'a>> {
        let py = scanner.py();
        let s = scanner.downcast::<TunnelScanner>()?.get();
        Ok(Box::new(TunnelFeed {
            hub: s.hub.bind(py).try_borrow_mut()?,
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
            // `now`: the dialect's scan clock, the hub's
            let taken = self.hub.inner.connector_message(
                self.connector,
                scratch,
                binary,
                now as i64,
                true,
                &mut ob.inner,
            );
            debug_assert!(
                !self.hub.inner.has_effects(),
                "the fast path leaves no effects"
            );
            if taken == Ok(true) {
                Ok(None)
            } else {
                Ok(Some((PyBytes::new(py, scratch).unbind(), None, None)))
            }
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<TunnelHub>()?;
        m.add_class::<TunnelScanner>()
    }
}
