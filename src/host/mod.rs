//! The host layer: the only code that talks to `proxy_wasm`. One module, one
//! `vm_id`, four root ids: `probe` (bootstrap singleton service), `guard`,
//! `router` (HTTP filters on the client listener) and `exchange` (HTTP
//! filter on the peers' listener). Each callback is handed to the core's state
//! machine ([`crate::roots::guard::GuardStream`], [`crate::roots::router::RouterStream`],
//! [`crate::roots::probe::Probe`]) with a [`adapters::Host`] that carries out what
//! it asks; this layer decides nothing itself.

mod adapters;
mod calls;

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

use crate::cache::exchange::ExchangeStream;
use crate::config::{BodyWaitConfig, Config};
use crate::fleet::view::View;
use crate::request::body_wait::{self, BodyWait};
use crate::roots::guard::{Guard, GuardStream};
use crate::roots::probe::Probe;
use crate::roots::router::{RouterShared, RouterStream};
use crate::shared::envoy_version::EnvoyVersion;
use crate::shared::flow::Flow;
use crate::shared::names::{Global, OBSERVATIONS_QUEUE};
use adapters::{define_stats, Callout, Host, Queue, Stats};
use calls::log;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    // A panic traps the VM; say why in Envoy's log first.
    std::panic::set_hook(Box::new(|info| {
        log(LogLevel::Critical, &format!("llm-geo-router: panic: {info}"));
    }));
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> { Box::new(Root::new(context_id)) });
}}

thread_local! {
    /// This VM's view of the snapshot, shared by the guard and the router
    /// (same `vm_id`, same worker): one copy per published version.
    static VIEW: RefCell<View> = RefCell::new(View::new());
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Probe,
    Guard,
    Router,
    Exchange,
}

struct GuardRoot {
    guard: Guard,
    stats: Stats,
    body_wait: BodyWaitConfig,
    /// This worker's requests paused on their headers for the body.
    waits: RefCell<BodyWait>,
}

struct RouterRoot {
    shared: RouterShared,
    stats: Stats,
    queue: Queue,
    /// This worker's requests paused on their headers for the body.
    waits: RefCell<BodyWait>,
}

struct ExchangeRoot {
    cfg: Rc<Config>,
    stats: Stats,
    queue: Queue,
}

struct ProbeRoot {
    probe: Probe,
    stats: Stats,
    queue: Queue,
}

enum State {
    Unconfigured,
    Probe(Box<ProbeRoot>),
    Guard(Rc<GuardRoot>),
    Router(Rc<RouterRoot>),
    Exchange(Rc<ExchangeRoot>),
}

struct Root {
    context_id: u32,
    role: Option<Role>,
    state: State,
}

impl Root {
    fn new(context_id: u32) -> Self {
        Root {
            context_id,
            role: None,
            state: State::Unconfigured,
        }
    }

    fn role(&mut self) -> Option<Role> {
        if self.role.is_none() {
            self.role = match calls::property(&["plugin_root_id"]).as_deref() {
                Some(b"probe") => Some(Role::Probe),
                Some(b"guard") => Some(Role::Guard),
                Some(b"router") => Some(Role::Router),
                Some(b"exchange") => Some(Role::Exchange),
                _ => None,
            };
        }
        self.role
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let State::Probe(p) = &mut self.state {
            let mut host = Host::new(&p.stats);
            host.queue = Some(&p.queue);
            let mut answer = Callout {
                num_headers,
                body_size,
            };
            p.probe
                .on_callout_response(&mut host, token_id, &mut answer);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(role) = self.role() else {
            let id = calls::property(&["plugin_root_id"])
                .map(|b| String::from_utf8_lossy(&b).into_owned());
            log(
                LogLevel::Error,
                &format!("llm-geo-router: root_id {id:?} is not one of \"probe\", \"guard\", \"router\", \"exchange\"; configuration refused"),
            );
            return false;
        };
        let raw = calls::plugin_configuration();
        let config = match Config::parse(&raw) {
            Ok(c) => Rc::new(c),
            Err(e) => {
                log(
                    LogLevel::Error,
                    &format!(
                        "llm-geo-router {}: {e}; configuration refused",
                        role_name(role)
                    ),
                );
                return false;
            }
        };
        // A removed field: accepted and ignored, said once per Envoy.
        for w in config.unlogged_warnings(&mut calls::HostStore) {
            log(
                LogLevel::Warn,
                &format!("llm-geo-router {}: {w}", role_name(role)),
            );
        }
        let stats = define_stats(&config);
        let vm_id = calls::property(&["plugin_vm_id"])
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        self.state = match role {
            Role::Probe => {
                let now = calls::now_ms();
                // The owner names this root context in the lease and, hashed,
                // this Envoy in the exchange: unique across the deployment's
                // processes (node id, start time in ns).
                // `xds.node`: Envoy 1.33 removed the bare `node` path.
                let node = calls::property(&["xds", "node", "id"])
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_default();
                say_envoy_version();
                let owner = format!("{}-{}-{node}", self.context_id, calls::now_ns());
                let mut root = ProbeRoot {
                    probe: Probe::new(config, owner, now),
                    stats,
                    queue: Queue {
                        vm_id,
                        ..Queue::default()
                    },
                };
                root.queue.id.set(calls::register_queue(OBSERVATIONS_QUEUE));
                let mut host = Host::new(&root.stats);
                if !root.probe.start(&mut host) {
                    return false;
                }
                State::Probe(Box::new(root))
            }
            Role::Guard => {
                let body_wait = config.body_wait.clone();
                let tick = body_wait::tick_ms(body_wait.timeout_ms);
                if tick > 0 {
                    calls::set_tick_ms(tick);
                }
                State::Guard(Rc::new(GuardRoot {
                    guard: Guard::new(config, calls::now_ms()),
                    stats,
                    body_wait,
                    waits: RefCell::new(BodyWait::new()),
                }))
            }
            Role::Router => {
                // HTTP contexts have no timers: the root's tick expires
                // the requests paused too long for their body.
                let tick = body_wait::tick_ms(config.body_wait.timeout_ms);
                if tick > 0 {
                    calls::set_tick_ms(tick);
                }
                State::Router(Rc::new(RouterRoot {
                    shared: RouterShared::new(config),
                    stats,
                    queue: Queue {
                        vm_id,
                        ..Queue::default()
                    },
                    waits: RefCell::new(BodyWait::new()),
                }))
            }
            Role::Exchange => {
                if !config.exchange.enabled() {
                    log(
                        LogLevel::Error,
                        "llm-geo-router exchange: the configuration has no exchange.cluster; configuration refused",
                    );
                    return false;
                }
                State::Exchange(Rc::new(ExchangeRoot {
                    cfg: config,
                    stats,
                    queue: Queue {
                        vm_id,
                        ..Queue::default()
                    },
                }))
            }
        };
        log(
            LogLevel::Info,
            &format!(
                "llm-geo-router {}: configured (root context {})",
                role_name(role),
                self.context_id
            ),
        );
        true
    }

    fn on_tick(&mut self) {
        match &mut self.state {
            State::Probe(p) => {
                let mut host = Host::new(&p.stats);
                host.queue = Some(&p.queue);
                p.probe.on_tick(&mut host);
            }
            State::Router(r) => expire_body_waits(
                "router",
                &r.waits,
                &r.shared.cfg.body_wait,
                &r.stats,
                Global::RouterBodyWaitTimeout,
                self.context_id,
            ),
            State::Guard(g) => expire_body_waits(
                "guard",
                &g.waits,
                &g.body_wait,
                &g.stats,
                Global::GuardBodyWaitTimeout,
                self.context_id,
            ),
            State::Exchange(_) | State::Unconfigured => {}
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        match self.role {
            Some(Role::Probe) => None,
            // Unknown roles still hand out (pass-through) HTTP contexts: the
            // SDK traps on a root without a type.
            _ => Some(ContextType::HttpContext),
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(match &self.state {
            State::Guard(g) => Box::new(GuardFilter {
                id: context_id,
                root: g.clone(),
                stream: GuardStream::new(),
            }),
            State::Router(r) => Box::new(RouterFilter {
                id: context_id,
                root: r.clone(),
                stream: RouterStream::new(),
            }),
            State::Exchange(x) => Box::new(ExchangeFilter {
                root: x.clone(),
                stream: ExchangeStream::new(),
            }),
            State::Unconfigured | State::Probe(_) => Box::new(PassThrough),
        })
    }
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Probe => "probe",
        Role::Guard => "guard",
        Role::Router => "router",
        Role::Exchange => "exchange",
    }
}

/// The core's verdict on a filter's requests paused too long for their
/// body, carried out in each one's own context (the host defers the action
/// until this callback returns).
fn expire_body_waits(
    role: &str,
    waits: &RefCell<BodyWait>,
    cfg: &BodyWaitConfig,
    stats: &Stats,
    stat: Global,
    root_id: u32,
) {
    let mut host = Host::new(stats);
    let expired = waits.borrow_mut().on_tick(&mut host, role, stat, cfg);
    if expired.is_empty() {
        return;
    }
    for (id, flow) in expired {
        if !calls::set_effective_context(id) {
            continue;
        }
        match flow {
            Flow::Continue => {
                if calls::resume_request() {
                    waits.borrow_mut().resumed(id);
                }
            }
            other => {
                act(other);
            }
        }
    }
    calls::set_effective_context(root_id);
}

/// The body once complete, if the stream wants it (`None`: the host could
/// not read it); else what to tell Envoy meanwhile (go on without it, or
/// wait for the rest).
fn complete_body(
    wanted: bool,
    size: usize,
    end_of_stream: bool,
) -> Result<Option<Vec<u8>>, Action> {
    match (wanted, end_of_stream) {
        (false, _) => Err(Action::Continue),
        (true, false) => Err(Action::Pause),
        (true, true) => Ok(calls::request_body(size)),
    }
}

/// Carry out the core's flow decision.
fn act(flow: Flow) -> Action {
    match flow {
        Flow::Continue => Action::Continue,
        Flow::Pause => Action::Pause,
        Flow::Reply(r) => {
            let headers: Vec<(&str, &str)> =
                r.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
            calls::send_response(r.status, &headers, &r.body);
            Action::Pause
        }
    }
}

struct GuardFilter {
    id: u32,
    root: Rc<GuardRoot>,
    stream: GuardStream,
}

impl Context for GuardFilter {}

impl Drop for GuardFilter {
    fn drop(&mut self) {
        // The request ended (no on_log here: the guard needs none).
        if let Ok(mut waits) = self.root.waits.try_borrow_mut() {
            waits.done(self.id);
        }
    }
}

impl HttpContext for GuardFilter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let mut host = Host::new(&self.root.stats);
        let flow = VIEW.with(|v| {
            self.stream.on_request_headers(
                &self.root.guard,
                &mut host,
                &mut v.borrow_mut(),
                end_of_stream,
            )
        });
        if matches!(flow, Flow::Pause) {
            self.root
                .waits
                .borrow_mut()
                .paused(self.id, calls::now_ms());
        }
        act(flow)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // As in the router: a request the guard's tick resumed is not
        // touched again (its headers are no longer readable).
        if !self.root.waits.borrow_mut().arrived(self.id) {
            return Action::Continue;
        }
        let body = match complete_body(self.stream.wants_body(), body_size, end_of_stream) {
            Ok(body) => body,
            Err(action) => return action,
        };
        let mut host = Host::new(&self.root.stats);
        host.body_size = body_size;
        act(match body {
            Some(body) => self
                .stream
                .on_request_body(&self.root.guard, &mut host, &body),
            None => self.stream.on_body_unreadable(&mut host),
        })
    }
}

struct RouterFilter {
    id: u32,
    root: Rc<RouterRoot>,
    stream: RouterStream,
}

impl Context for RouterFilter {}

impl HttpContext for RouterFilter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let root = self.root.clone();
        let mut host = Host::new(&root.stats);
        host.queue = Some(&root.queue);
        let flow = VIEW.with(|v| {
            self.stream.on_request_headers(
                &root.shared,
                &mut host,
                &mut v.borrow_mut(),
                end_of_stream,
            )
        });
        if matches!(flow, Flow::Pause) {
            root.waits.borrow_mut().paused(self.id, calls::now_ms());
        }
        act(flow)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // Envoy delivers the body: the pause was honoured as StopIteration,
        // or the guard resumed the request, whose headers the filter can no
        // longer read or set (it goes on unrouted).
        if !self.root.waits.borrow_mut().arrived(self.id) {
            return Action::Continue;
        }
        let body = match complete_body(self.stream.wants_body(), body_size, end_of_stream) {
            Ok(body) => body,
            Err(action) => return action,
        };
        let root = self.root.clone();
        let mut host = Host::new(&root.stats);
        host.queue = Some(&root.queue);
        let flow = VIEW.with(|v| {
            let view = &mut v.borrow_mut();
            match body {
                Some(body) => self
                    .stream
                    .on_request_body(&root.shared, &mut host, view, &body),
                None => self
                    .stream
                    .on_body_unreadable(&root.shared, &mut host, view),
            }
        });
        act(flow)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let root = self.root.clone();
        let mut host = Host::new(&root.stats);
        act(self.stream.on_response_headers(&root.shared, &mut host))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // O(1) unless the stream measures its first byte or reads usage.
        if self.stream.wants_response_body() {
            let root = self.root.clone();
            let mut host = Host::new(&root.stats);
            host.queue = Some(&root.queue);
            self.stream
                .on_response_body(&root.shared, &mut host, body_size, end_of_stream);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.root.waits.borrow_mut().done(self.id);
        let root = self.root.clone();
        let mut host = Host::new(&root.stats);
        host.queue = Some(&root.queue);
        self.stream.on_log(&root.shared, &mut host);
    }
}

struct ExchangeFilter {
    root: Rc<ExchangeRoot>,
    stream: ExchangeStream,
}

impl Context for ExchangeFilter {}

impl HttpContext for ExchangeFilter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let root = self.root.clone();
        let mut host = Host::new(&root.stats);
        host.queue = Some(&root.queue);
        act(self
            .stream
            .on_request_headers(&root.cfg, &mut host, end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.stream.wants_body() {
            return Action::Continue;
        }
        let root = self.root.clone();
        let mut host = Host::new(&root.stats);
        host.queue = Some(&root.queue);
        // Only a complete body is read (one copy); until then only its size
        // is checked against the limit.
        if !end_of_stream {
            return act(self
                .stream
                .on_request_body(&root.cfg, &mut host, body_size, None));
        }
        act(match calls::request_body(body_size) {
            Some(body) => self
                .stream
                .on_request_body(&root.cfg, &mut host, body_size, Some(&body)),
            None => self.stream.on_body_unreadable(&mut host),
        })
    }
}

struct PassThrough;
impl Context for PassThrough {}
impl HttpContext for PassThrough {}

/// The running Envoy's version, said once per Envoy (from the probe; its
/// root configures more than once, hence the shared-data mark): a warning
/// on a build that can lose a request body frame behind the router and the
/// guard (`shared::envoy_version`), else a line naming it.
fn say_envoy_version() {
    use crate::shared::store::SharedStore;
    let mut store = calls::HostStore;
    let key = crate::shared::names::ENVOY_VERSION_SAID_KEY;
    if matches!(store.get(key), Ok(Some(_))) {
        return;
    }
    let _ = store.set(key, b"1", None);
    let part =
        |name: &str| calls::property(&["xds", "node", "user_agent_build_version", "version", name]);
    let label = calls::property(&[
        "xds",
        "node",
        "user_agent_build_version",
        "metadata",
        "build.label",
    ]);
    let version = EnvoyVersion::from_property_bytes(
        part("major_number").as_deref(),
        part("minor_number").as_deref(),
        part("patch").as_deref(),
        label.as_deref(),
    );
    match version {
        None => log(
            LogLevel::Info,
            "llm-geo-router probe: the Envoy version is not readable here; make sure it carries \
             the body-frame fix (Envoy 1.40.0, 1.39.1, 1.38.4, 1.37.6 or 1.36.10 or later; \
             docs/INSTALL.md)",
        ),
        Some(v) => match v.body_frame_fix() {
            Some(fixed) => log(
                LogLevel::Warn,
                &format!(
                    "llm-geo-router probe: Envoy {v} can silently lose a request body frame behind \
                     a filter that stops on headers, as the router and the guard do \
                     (envoyproxy/envoy#46842): upgrade to {fixed} or later (docs/INSTALL.md)"
                ),
            ),
            None => log(
                LogLevel::Info,
                &format!("llm-geo-router probe: running on Envoy {v}"),
            ),
        },
    }
}
