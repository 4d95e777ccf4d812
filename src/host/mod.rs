//! The host layer: the only code that talks to `proxy_wasm`. One module, one
//! `vm_id`, three root ids: `probe` (bootstrap singleton service), `guard` and
//! `router` (HTTP filters). Each root parses its configuration once in
//! `on_configure` and hands an immutable `Rc` to its HTTP contexts.

mod calls;
mod guard;
mod probe;
mod router;
mod view;

use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use crate::config::Config;
use calls::log;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    // A panic traps the VM; say why in Envoy's log first.
    std::panic::set_hook(Box::new(|info| {
        log(LogLevel::Critical, &format!("llm-geo-router: panic: {info}"));
    }));
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> { Box::new(Root::new(context_id)) });
}}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Probe,
    Guard,
    Router,
}

enum State {
    Unconfigured,
    Probe(Box<probe::Probe>),
    Guard(Rc<guard::GuardShared>),
    Router(Rc<router::RouterShared>),
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
            p.on_response(token_id, num_headers, body_size);
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
                &format!("llm-geo-router: root_id {id:?} is not one of \"probe\", \"guard\", \"router\"; configuration refused"),
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
        self.state = match role {
            Role::Probe => match probe::Probe::new(config, self.context_id) {
                Some(p) => State::Probe(Box::new(p)),
                None => return false,
            },
            Role::Guard => State::Guard(Rc::new(guard::GuardShared::new(config))),
            Role::Router => State::Router(Rc::new(router::RouterShared::new(config))),
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
        if let State::Probe(p) = &mut self.state {
            p.on_tick();
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

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(match &self.state {
            State::Guard(g) => Box::new(guard::GuardFilter::new(g.clone())),
            State::Router(r) => Box::new(router::RouterFilter::new(r.clone())),
            State::Unconfigured | State::Probe(_) => Box::new(PassThrough),
        })
    }
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Probe => "probe",
        Role::Guard => "guard",
        Role::Router => "router",
    }
}

struct PassThrough;
impl Context for PassThrough {}
impl HttpContext for PassThrough {}
