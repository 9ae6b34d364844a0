//! A consumer's lanes: each fetches, decides and settles batches in a loop, pipelined so that
//! fetching the next batch (and claiming its keys ahead) overlaps deciding this one.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{BoxFuture, Consumer, Decided, Error, Report, Source};
use crate::engine::{Backend, Driver, Handler, Ticket, TicketId};
use crate::telemetry::FETCH_FAILURES_TOTAL;

impl<S: Source, B: Backend> Consumer<S, B> {
    /// Fetches, decides and settles batches until `shutdown` completes, then closes the source.
    /// In two-phase mode the handler gets a [`Context`](crate::engine::Context); in inbox
    /// mode, the batch's transaction. It gets its own copy of the message, so its future may
    /// own what it reads.
    ///
    /// # Errors
    /// [`Error::Fetch`] when the fetch-failure policy gives up, [`Error::Settle`] when the
    /// broker can no longer be told, [`Error::BrokerTimeout`] when a broker call hangs. The
    /// source is closed in every case; unacknowledged messages are redelivered.
    ///
    /// # Cancel safety
    /// Not cancel safe; stop it with `shutdown` instead. Dropped midway, nothing is lost (no
    /// message is acknowledged before its outcome is durable, so the broker redelivers the
    /// rest), but the source is not closed and in-progress claims wait for their leases.
    pub async fn run<H>(
        &self,
        handler: H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<Report, Error<S::Error>>
    where
        H: Handler<B::Ctx, S::Delivery>,
    {
        // Every lane watches the same shutdown; a lane that fails stops the others.
        let shutdown: BoxFuture<'_, ()> = Box::pin(shutdown);
        let shutdown = futures_util::FutureExt::shared(shutdown);
        let failed = AtomicBool::new(false);
        let lanes = (0..self.settings.concurrency).map(|_| {
            let (shutdown, failed) = (shutdown.clone(), &failed);
            let handler = &handler;
            async move {
                let mut report = Report::default();
                let ended = self.drive(handler, shutdown, failed, &mut report).await;
                if ended.is_err() {
                    failed.store(true, Ordering::SeqCst);
                }
                (ended, report)
            }
        });
        let mut report = Report::default();
        let mut ended = Ok(());
        for (e, r) in futures_util::future::join_all(lanes).await {
            report += r;
            if ended.is_ok() {
                ended = e;
            }
        }
        match self.close().await {
            Ok(n) => report.released += n,
            Err(e) => tracing::warn!(target: "idem", error = %e, "closing the source failed"),
        }
        ended.map(|()| report)
    }

    /// One lane: fetch, decide, settle, until shutdown (or another lane failed).
    ///
    /// Pipelined (the default), three batches overlap: while batch k is decided, batch k + 1
    /// is fetched (and, two-phase, its keys claimed ahead) and waits for its turn, kept alive
    /// at the broker, and batch k − 1 is settled. Only a decided batch is ever settled, and
    /// batches are settled in the order they were decided. A fetch is never dropped (sources
    /// need not be cancel safe): on shutdown it is awaited, and what it brought — and the batch
    /// waiting for its turn — is released, with the claims taken ahead for it.
    pub(super) async fn drive<H>(
        &self,
        handler: &H,
        mut shutdown: futures_util::future::Shared<BoxFuture<'_, ()>>,
        failed: &AtomicBool,
        report: &mut Report,
    ) -> Result<(), Error<S::Error>>
    where
        H: Handler<B::Ctx, S::Delivery>,
    {
        let pipelined = self.settings.pipelined;
        let mut lane = Lane::<'_, S>::default();
        let mut failures = 0u32;
        let mut stopping = false;
        let mut ended = Ok(());
        loop {
            if !stopping
                && (failed.load(Ordering::SeqCst) || is_ready(Pin::new(&mut shutdown)).await)
            {
                stopping = true;
            }
            if stopping {
                lane.backoff = None;
                if let Some((go, _)) = lane.go.take() {
                    // Its future releases the batch; a closed receiver means it ended already.
                    let _ = go.send(Go::Release);
                }
            }
            if lane.settling.is_none()
                && let Some(d) = lane.decided.take()
            {
                lane.settling = Some(Box::pin(self.settle(d)));
            }
            // The next batch's turn (not when told to release: its `go` is spent). Its seat for
            // claims riding on its completion is taken now, before the batch after it is
            // fetched and claimed ahead.
            if lane.current.is_none()
                && lane.decided.is_none()
                && let Some((go, ticket)) = lane.go.take()
            {
                let _ = go.send(Go::Run(B::seat(&self.engine, ticket)));
                lane.current = lane.next.take();
            }
            let room = if pipelined { lane.next.is_none() } else { lane.is_idle() };
            if !stopping && room && lane.fetching.is_none() && lane.backoff.is_none() {
                lane.fetching = Some(Box::pin(self.fetch_bounded()));
            }
            if stopping && lane.is_idle() && lane.fetching.is_none() {
                return ended;
            }
            let mut fail = |e: Error<S::Error>, stopping: &mut bool| {
                if ended.is_ok() {
                    ended = Err(e);
                }
                *stopping = true;
            };
            tokio::select! {
                biased;
                r = slot(&mut lane.settling), if lane.settling.is_some() => {
                    lane.settling = None;
                    match r {
                        Ok(r) => *report += r,
                        Err(e) => fail(e, &mut stopping),
                    }
                }
                r = slot(&mut lane.fetching), if lane.fetching.is_some() => {
                    lane.fetching = None;
                    match r {
                        Ok(batch) => {
                            failures = 0;
                            if !batch.is_empty() {
                                let (go, turn) = tokio::sync::oneshot::channel();
                                let ticket = B::ticket(&self.engine);
                                lane.go = Some((go, ticket.id()));
                                lane.next = Some(Box::pin(self.turn(batch, handler, turn, ticket)));
                            }
                        }
                        Err(Err(e)) => fail(e, &mut stopping),
                        Err(Ok(_)) if stopping => {}
                        Err(Ok(e)) => {
                            failures += 1;
                            let policy = self.settings.fetch_failures;
                            if self.source.is_fatal(&e) || failures >= policy.max_in_a_row {
                                fail(Error::Fetch { attempts: failures, source: e }, &mut stopping);
                            } else {
                                report.fetch_failures += 1;
                                metrics::counter!(FETCH_FAILURES_TOTAL, "scope" => self.engine.scope().to_owned())
                                    .increment(1);
                                tracing::warn!(target: "idem", error = %e, failures, "fetch failed; retrying");
                                lane.backoff = Some(Box::pin(tokio::time::sleep(policy.backoff)));
                            }
                        }
                    }
                }
                // After the fetch: a batch fetched now is coming (its ticket taken) before the
                // current one records its completion, which waits for its claims and carries
                // them (see `Backend::seat`). Before the batch waiting for its turn: the current
                // batch claims its keys first.
                r = slot(&mut lane.current), if lane.current.is_some() => {
                    lane.current = None;
                    match r {
                        Ok(Turned::Decided(d)) => lane.decided = Some(d),
                        Ok(Turned::Released(r)) => *report += r,
                        Err(e) => fail(e, &mut stopping),
                    }
                }
                // Only ends before its turn when told to release its batch.
                r = slot(&mut lane.next), if lane.next.is_some() => {
                    lane.next = None;
                    match r {
                        Ok(Turned::Released(r)) => *report += r,
                        Ok(Turned::Decided(d)) => lane.decided = Some(d),
                        Err(e) => fail(e, &mut stopping),
                    }
                }
                () = slot(&mut lane.backoff), if lane.backoff.is_some() => lane.backoff = None,
                () = &mut shutdown, if !stopping => stopping = true,
            }
        }
    }

    /// A fetched batch's way through a lane: claimed ahead (two-phase, pipelined) and kept
    /// alive while it waits for `turn`, then decided — or, told `false`, released.
    async fn turn<H>(
        &self,
        batch: Vec<S::Delivery>,
        handler: &H,
        turn: tokio::sync::oneshot::Receiver<Go>,
        ticket: Ticket,
    ) -> Result<Turned<S::Delivery>, Error<S::Error>>
    where
        H: Handler<B::Ctx, S::Delivery>,
    {
        let (ahead, go) = {
            let wait = std::pin::pin!(async {
                let ahead = match self.settings.pipelined {
                    true => B::claim_ahead(&self.engine, &batch, ticket).await,
                    false => None,
                };
                (ahead, turn.await.unwrap_or(Go::Release))
            });
            let beat = std::pin::pin!(self.source.keep_alive(&batch));
            match futures_util::future::select(wait, beat).await {
                futures_util::future::Either::Left((waited, _)) => waited,
                futures_util::future::Either::Right(((), wait)) => wait.await,
            }
        };
        let Go::Run(seat) = go else {
            if let Some(ahead) = ahead {
                B::drop_ahead(&self.engine, ahead).await;
            }
            return self.release(batch).await.map(Turned::Released);
        };
        self.decide_ref(batch, handler, ahead, seat).await.map(Turned::Decided)
    }
}

/// Whether `fut` is ready now (it is polled once; a ready future must not be polled again).
async fn is_ready(fut: Pin<&mut impl Future<Output = ()>>) -> bool {
    let mut fut = Some(fut);
    std::future::poll_fn(|cx| {
        let ready = fut.take().is_some_and(|f| f.poll(cx).is_ready());
        std::task::Poll::Ready(ready)
    })
    .await
}

/// What a batch waiting for its turn is told: run (with its seat for riding claims, if any), or
/// give the batch back.
enum Go {
    Run(Option<Driver>),
    Release,
}

/// What a fetched batch became when its turn came (or shutdown came first).
enum Turned<M> {
    Decided(Decided<M>),
    Released(Report),
}

type Step<'a, S> =
    BoxFuture<'a, Result<Turned<<S as Source>::Delivery>, Error<<S as Source>::Error>>>;
type Fetched<S> =
    Result<Vec<<S as Source>::Delivery>, Result<<S as Source>::Error, Error<<S as Source>::Error>>>;

/// A lane's batches in flight: at most one being fetched, one waiting for its turn (`next`,
/// told by `go`), one being decided, one decided and waiting for the broker, one being settled.
struct Lane<'a, S: Source> {
    fetching: Option<BoxFuture<'a, Fetched<S>>>,
    backoff: Option<Pin<Box<tokio::time::Sleep>>>,
    next: Option<Step<'a, S>>,
    go: Option<(tokio::sync::oneshot::Sender<Go>, TicketId)>,
    current: Option<Step<'a, S>>,
    decided: Option<Decided<S::Delivery>>,
    settling: Option<BoxFuture<'a, Result<Report, Error<S::Error>>>>,
}

impl<S: Source> Default for Lane<'_, S> {
    fn default() -> Self {
        Self {
            fetching: None,
            backoff: None,
            next: None,
            go: None,
            current: None,
            decided: None,
            settling: None,
        }
    }
}

impl<S: Source> Lane<'_, S> {
    /// Whether no batch is in the lane (a fetch may still be).
    fn is_idle(&self) -> bool {
        self.next.is_none()
            && self.current.is_none()
            && self.decided.is_none()
            && self.settling.is_none()
    }
}

/// The future in `slot`, which must be there (`select!` guards each branch with `is_some`).
async fn slot<F: Future + Unpin>(slot: &mut Option<F>) -> F::Output {
    match slot {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}
