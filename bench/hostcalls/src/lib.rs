//! Two HTTP filters (root ids `guard` and `router`) doing what the smallest
//! router must (the `router` pauses for the body, copies it in, sets the
//! cluster header and clears the route cache), plus, per request, N more
//! host calls of one kind named by the plugin configuration `<kind>:<n>`.
//! The per-call cost is the difference against `none:0`, divided by N.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType, MetricType};
use std::rc::Rc;

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { op: Rc::new((String::new(), 0)) }) });
}}

struct Root {
    op: Rc<(String, usize)>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _: usize) -> bool {
        let raw = proxy_wasm::hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let text = String::from_utf8_lossy(&raw).to_string();
        let (kind, n) = text
            .split_once(':')
            .map(|(k, n)| (k.to_string(), n.trim().parse().unwrap_or(0)))
            .unwrap_or_default();
        self.op = Rc::new((kind, n));
        true
    }
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
    fn create_http_context(&self, _: u32) -> Option<Box<dyn HttpContext>> {
        let router = proxy_wasm::hostcalls::get_property(vec!["plugin_root_id"])
            .ok()
            .flatten()
            .as_deref()
            == Some(b"router");
        Some(Box::new(Filter {
            router,
            op: self.op.clone(),
        }))
    }
}

struct Filter {
    router: bool,
    op: Rc<(String, usize)>,
}

impl Context for Filter {}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _: usize, _: bool) -> Action {
        if self.router {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_http_request_body(&mut self, size: usize, end: bool) -> Action {
        if !self.router {
            return Action::Continue;
        }
        if !end {
            return Action::Pause;
        }
        use proxy_wasm::hostcalls as h;
        let _ = h::get_buffer(BufferType::HttpRequestBody, 0, size);
        let _ = h::set_map_value(MapType::HttpRequestHeaders, "x-llm-cluster", Some("region_near"));
        let _ = h::call_foreign_function("clear_route_cache", None);
        let id = h::define_metric(MetricType::Gauge, "hostcall_probe.g").unwrap_or(0);
        for i in 0..self.op.1 {
            match self.op.0.as_str() {
                "get_metric" => drop(h::get_metric(id)),
                "increment_metric" => drop(h::increment_metric(id, 1)),
                "get_header_map" => drop(h::get_map_bytes(MapType::HttpRequestHeaders)),
                "get_header" => drop(h::get_map_value_bytes(MapType::HttpRequestHeaders, "user-agent")),
                "set_header" => drop(h::set_map_value(MapType::HttpRequestHeaders, "x-tier", Some("free"))),
                "get_shared_data" => drop(h::get_shared_data(&format!("hostcall_probe.{}", i % 7))),
                "set_shared_data" => drop(h::set_shared_data(&format!("hostcall_probe.{}", i % 7), Some(&[0u8; 36]), None)),
                "get_current_time" => drop(h::get_current_time()),
                "get_property" => drop(h::get_property(vec!["response", "flags"])),
                "set_property" => drop(h::set_property(vec!["hostcall_probe.x"], Some(b"region=near"))),
                _ => {}
            }
        }
        Action::Continue
    }
}
