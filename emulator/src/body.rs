//! Response bodies handed to hyper: a complete body, or a paced one whose
//! bytes become available on the emulated engine's schedule (the whole body
//! after the decode time, or one SSE event per token as `pacing` says).
//!
//! A paced body carries a completion hook (the server puts the request's
//! scheduler slot in it): the hook runs when the last bytes are handed to
//! hyper, and is dropped unrun when the body is dropped early, which hyper
//! does when the client goes away or the connection fails. That drop is how
//! a cancelled stream frees its slot.

use std::convert::Infallible;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use hyper::body::{Body, Bytes, Frame, SizeHint};
use tokio::time::Sleep;

use crate::pacing::{self, Pace};

/// Runs once the last bytes of a paced body are handed over.
pub type OnDone = Box<dyn FnOnce() + Send>;

/// Renders the SSE events of tokens `range`.
pub type RenderEvents = Box<dyn Fn(Range<usize>) -> Vec<u8> + Send>;

pub struct ReplyBody(Inner);

enum Inner {
    /// Sent at once; `None` once taken (or when empty).
    Full(Option<Bytes>),
    Paced(Box<Paced>),
}

impl ReplyBody {
    pub fn full(bytes: impl Into<Bytes>) -> ReplyBody {
        let bytes = bytes.into();
        ReplyBody(Inner::Full((!bytes.is_empty()).then_some(bytes)))
    }

    /// `body` as a whole, `after_ms` after hyper first asks for it (that is,
    /// after the head went out), with a known length.
    pub fn after(after_ms: f64, body: impl Into<Bytes>, on_done: OnDone) -> ReplyBody {
        ReplyBody::paced(
            Script::Whole {
                after_ms,
                body: Some(body.into()),
            },
            on_done,
        )
    }

    /// `tokens` token events paced by `per_token_ms` (see `pacing`), then
    /// `tail`; the length is not known up front (chunked, or until close for
    /// an HTTP/1.0 client).
    pub fn events(
        tokens: usize,
        per_token_ms: f64,
        render: RenderEvents,
        tail: impl Into<Bytes>,
        on_done: OnDone,
    ) -> ReplyBody {
        ReplyBody::paced(
            Script::Events {
                tokens,
                per_token_ms,
                sent: 0,
                render,
                tail: Some(tail.into()),
            },
            on_done,
        )
    }

    fn paced(script: Script, on_done: OnDone) -> ReplyBody {
        ReplyBody(Inner::Paced(Box::new(Paced {
            script,
            start: None,
            timer: None,
            on_done: Some(on_done),
        })))
    }
}

impl Body for ReplyBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let next = match &mut self.get_mut().0 {
            Inner::Full(bytes) => Poll::Ready(bytes.take()),
            Inner::Paced(paced) => paced.poll_next(cx),
        };
        next.map(|bytes| bytes.map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Inner::Full(bytes) => bytes.is_none(),
            Inner::Paced(paced) => paced.is_done(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        let len = match &self.0 {
            Inner::Full(bytes) => bytes.as_ref().map_or(0, Bytes::len),
            Inner::Paced(paced) => match &paced.script {
                Script::Whole { body, .. } => body.as_ref().map_or(0, Bytes::len),
                Script::Events { .. } => return SizeHint::default(),
            },
        };
        SizeHint::with_exact(u64::try_from(len).unwrap_or(u64::MAX))
    }
}

enum Script {
    Whole {
        after_ms: f64,
        body: Option<Bytes>,
    },
    Events {
        tokens: usize,
        per_token_ms: f64,
        sent: usize,
        render: RenderEvents,
        tail: Option<Bytes>,
    },
}

/// What the script wants next.
enum Step {
    /// Hand over these bytes; `last` when nothing follows.
    Emit(Bytes, bool),
    /// Nothing before this many milliseconds from now.
    Wait(f64),
    Done,
}

impl Script {
    fn step(&mut self, elapsed_ms: f64) -> Step {
        match self {
            Script::Whole { after_ms, body } => match body {
                None => Step::Done,
                Some(_) if elapsed_ms < *after_ms => Step::Wait(*after_ms - elapsed_ms),
                Some(_) => body.take().map_or(Step::Done, |b| Step::Emit(b, true)),
            },
            Script::Events {
                tokens,
                per_token_ms,
                sent,
                render,
                tail,
            } => match pacing::next(*sent, *tokens, *per_token_ms, elapsed_ms) {
                Pace::Emit { from, to } => {
                    *sent = to;
                    let last = to >= *tokens && tail.is_none();
                    Step::Emit(Bytes::from(render(from..to)), last)
                }
                Pace::Wait { ms } => Step::Wait(ms),
                Pace::Done => tail.take().map_or(Step::Done, |t| Step::Emit(t, true)),
            },
        }
    }

    fn is_done(&self) -> bool {
        match self {
            Script::Whole { body, .. } => body.is_none(),
            Script::Events {
                tokens, sent, tail, ..
            } => sent >= tokens && tail.is_none(),
        }
    }
}

struct Paced {
    script: Script,
    /// When hyper first asked for bytes: the head has gone out by then.
    start: Option<Instant>,
    /// Made on first use, inside the runtime.
    timer: Option<Pin<Box<Sleep>>>,
    on_done: Option<OnDone>,
}

impl Paced {
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        let start = *self.start.get_or_insert_with(Instant::now);
        loop {
            let elapsed_ms = start.elapsed().as_secs_f64() * 1000.0;
            match self.script.step(elapsed_ms) {
                Step::Emit(bytes, last) => {
                    if last {
                        if let Some(done) = self.on_done.take() {
                            done();
                        }
                    }
                    return Poll::Ready(Some(bytes));
                }
                Step::Done => return Poll::Ready(None),
                Step::Wait(ms) => {
                    let deadline = tokio::time::Instant::now() + ms_duration(ms);
                    let timer = match &mut self.timer {
                        Some(t) => {
                            t.as_mut().reset(deadline);
                            t
                        }
                        None => self
                            .timer
                            .insert(Box::pin(tokio::time::sleep_until(deadline))),
                    };
                    ready!(timer.as_mut().poll(cx));
                }
            }
        }
    }

    fn is_done(&self) -> bool {
        self.script.is_done()
    }
}

/// Milliseconds to a `Duration`, treating NaN/negative as zero and capping
/// at a day so arithmetic on `Instant` cannot overflow.
pub fn ms_duration(ms: f64) -> Duration {
    if ms.is_finite() && ms > 0.0 {
        Duration::from_secs_f64(ms.min(crate::config::MAX_MS) / 1000.0)
    } else {
        Duration::ZERO
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn counter() -> (Arc<AtomicUsize>, OnDone) {
        let n = Arc::new(AtomicUsize::new(0));
        let m = Arc::clone(&n);
        (
            n,
            Box::new(move || {
                m.fetch_add(1, Ordering::SeqCst);
            }),
        )
    }

    #[test]
    fn whole_script_waits_then_emits_once() {
        let mut s = Script::Whole {
            after_ms: 10.0,
            body: Some(Bytes::from_static(b"ok")),
        };
        assert!(matches!(s.step(4.0), Step::Wait(ms) if ms == 6.0));
        assert!(matches!(s.step(10.0), Step::Emit(b, true) if b == "ok"));
        assert!(s.is_done());
        assert!(matches!(s.step(11.0), Step::Done));
    }

    #[test]
    fn events_script_paces_tokens_then_tail() {
        let mut s = Script::Events {
            tokens: 3,
            per_token_ms: 5.0,
            sent: 0,
            render: Box::new(|r: Range<usize>| format!("{r:?};").into_bytes()),
            tail: Some(Bytes::from_static(b"done")),
        };
        assert!(matches!(s.step(0.0), Step::Emit(b, false) if b == "0..1;"));
        assert!(matches!(s.step(1.0), Step::Wait(ms) if ms == 4.0));
        assert!(matches!(s.step(12.0), Step::Emit(b, false) if b == "1..3;"));
        assert!(!s.is_done());
        assert!(matches!(s.step(12.0), Step::Emit(b, true) if b == "done"));
        assert!(s.is_done());
        assert!(matches!(s.step(13.0), Step::Done));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn paced_body_runs_hook_with_last_bytes_or_never() {
        use http_body_util::BodyExt;
        let (n, hook) = counter();
        let body = ReplyBody::events(
            4,
            10.0,
            Box::new(|r: Range<usize>| vec![b'e'; r.len()]),
            "tail",
            hook,
        );
        assert_eq!(body.size_hint().exact(), None);
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(bytes, "eeeetail");
        assert_eq!(n.load(Ordering::SeqCst), 1);

        let (n, hook) = counter();
        let mut body = ReplyBody::after(50.0, "whole", hook);
        assert_eq!(body.size_hint().exact(), Some(5));
        // Polled once (pending on its timer), then dropped: client gone.
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        assert!(Pin::new(&mut body).poll_frame(&mut cx).is_pending());
        drop(body);
        assert_eq!(n.load(Ordering::SeqCst), 0);

        let full = ReplyBody::full("");
        assert!(full.is_end_stream());
        assert_eq!(full.size_hint().exact(), Some(0));
    }
}
