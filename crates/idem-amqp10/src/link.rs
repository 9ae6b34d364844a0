//! The receiving link on a task of its own: it receives into a channel and sends the
//! dispositions it is asked for, so settling never waits behind a fetch that is waiting for
//! deliveries (fe2o3's `recv` and its full set of dispositions both need the receiver).
//!
//! The task also grants the link credit itself. fe2o3's automatic mode resets the credit to the
//! full window after half of it is settled, while transfers are still on the wire; RabbitMQ
//! 3.10's AMQP 1.0 plugin then sent more transfers than the new credit allowed and fe2o3 failed
//! the link with `TransferLimitExceeded` (seen at 10,000 messages, credit 128). Here credit is
//! granted again only once the last grant is used up — so nothing is in flight when the new
//! flow goes out — and only as much as keeps the unsettled deliveries within the window.

use std::time::Duration;

use fe2o3_amqp::link::delivery::DeliveryInfo;
use fe2o3_amqp::link::{DispositionError, Receiver, RecvError};
use fe2o3_amqp::types::definitions;
use fe2o3_amqp::types::messaging::{Accepted, Body, Modified, Rejected, Released};
use fe2o3_amqp::types::primitives::Value;
use tokio::sync::{mpsc, oneshot};

use crate::delivery::Delivery;

/// A settling disposition (the AMQP 1.0 outcome sent for a delivery).
#[derive(Debug, Clone)]
pub(crate) enum Disposition {
    Accept,
    Reject(definitions::Error),
    Release,
    Modify(Modified),
}

impl Disposition {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Accept => "accepted",
            Self::Reject(_) => "rejected",
            Self::Release => "released",
            Self::Modify(_) => "modified",
        }
    }
}

enum Command {
    Dispose {
        infos: Vec<DeliveryInfo>,
        verb: Disposition,
        done: oneshot::Sender<Result<(), DispositionError>>,
    },
    /// Stop new deliveries (credit 0) and move what the client has buffered to the channel.
    Quiesce {
        done: oneshot::Sender<()>,
    },
    Close {
        bound: Duration,
        done: oneshot::Sender<()>,
    },
}

/// The handle the source keeps.
pub(crate) struct Link {
    commands: mpsc::UnboundedSender<Command>,
    deliveries: tokio::sync::Mutex<mpsc::UnboundedReceiver<Result<Delivery, RecvError>>>,
}

/// The link's task ended (its receiver is gone).
#[derive(Debug)]
pub(crate) struct Gone;

impl Link {
    /// Runs `receiver` (attached with manual credit), keeping at most `window` deliveries
    /// unsettled.
    pub(crate) fn spawn(receiver: Receiver, window: u32) -> Self {
        let (commands, rx_commands) = mpsc::unbounded_channel();
        let (tx, deliveries) = mpsc::unbounded_channel();
        tokio::spawn(run(receiver, window, rx_commands, tx));
        Self { commands, deliveries: tokio::sync::Mutex::new(deliveries) }
    }

    /// Up to `max` deliveries: the first within `wait`, then those arriving within
    /// `batch_wait` of each other. `Err` only when nothing was received.
    pub(crate) async fn fetch(
        &self,
        max: usize,
        wait: Duration,
        batch_wait: Duration,
    ) -> Result<Vec<Delivery>, Result<RecvError, Gone>> {
        let mut rx = self.deliveries.lock().await;
        let mut out = Vec::new();
        let mut limit = wait;
        while out.len() < max {
            match tokio::time::timeout(limit, rx.recv()).await {
                Err(_) => break,
                Ok(Some(Ok(m))) => out.push(m),
                Ok(Some(Err(_))) | Ok(None) if !out.is_empty() => break,
                Ok(Some(Err(e))) => return Err(Ok(e)),
                Ok(None) => return Err(Err(Gone)),
            }
            limit = batch_wait;
        }
        Ok(out)
    }

    pub(crate) async fn dispose(
        &self,
        infos: Vec<DeliveryInfo>,
        verb: Disposition,
    ) -> Result<Result<(), DispositionError>, Gone> {
        if infos.is_empty() {
            return Ok(Ok(()));
        }
        let (done, answer) = oneshot::channel();
        self.commands.send(Command::Dispose { infos, verb, done }).map_err(|_| Gone)?;
        answer.await.map_err(|_| Gone)
    }

    /// Stops new deliveries (a message released now would come straight back to this link) and
    /// moves everything received so far into the channel.
    pub(crate) async fn quiesce(&self, bound: Duration) {
        let (done, answer) = oneshot::channel();
        if self.commands.send(Command::Quiesce { done }).is_ok() {
            let _ = tokio::time::timeout(bound, answer).await;
        }
    }

    /// Releases what was received but never fetched, then closes the link (bounded).
    /// Returns how many deliveries it released.
    /// Call [`quiesce`](Self::quiesce) first.
    pub(crate) async fn close(&self, bound: Duration) -> u64 {
        let unfetched: Vec<DeliveryInfo> = {
            let mut rx = self.deliveries.lock().await;
            rx.close();
            let mut infos = Vec::new();
            while let Ok(d) = rx.try_recv() {
                if let Ok(m) = d {
                    infos.push(m.info().clone());
                }
            }
            infos
        };
        let n = unfetched.len() as u64;
        if let Ok(Err(e)) = self.dispose(unfetched, Disposition::Release).await {
            tracing::debug!(error = %e, "releasing unfetched deliveries failed; the broker redelivers them");
        }
        let (done, answer) = oneshot::channel();
        if self.commands.send(Command::Close { bound, done }).is_ok() {
            let _ = answer.await;
        }
        n
    }
}

/// How long a quiescing link waits for the next in-flight delivery, and for all of them.
const QUIET_GAP: Duration = Duration::from_millis(50);
const QUIESCE_BOUND: Duration = Duration::from_secs(1);

/// Credit bookkeeping: what the last grant has left, and what is received but unsettled.
struct Credit {
    window: u32,
    left: u32,
    unsettled: u32,
}

impl Credit {
    /// The credit to grant now, if any: only when the last grant is used up (nothing of it is
    /// still on the wire) and at least half the window is settled.
    fn grant(&mut self) -> Option<u32> {
        (self.window > 0 && self.left == 0 && self.unsettled <= self.window / 2).then(|| {
            self.left = self.window - self.unsettled;
            self.left
        })
    }
}

async fn run(
    mut receiver: Receiver,
    window: u32,
    mut commands: mpsc::UnboundedReceiver<Command>,
    deliveries: mpsc::UnboundedSender<Result<Delivery, RecvError>>,
) {
    let mut credit = Credit { window, left: 0, unsettled: 0 };
    let mut receiving = true;
    loop {
        if let Some(grant) = credit.grant()
            && let Err(e) = receiver.set_credit(grant).await
        {
            tracing::warn!(error = %e, "granting link credit failed; the link is unusable");
            receiving = false;
        }
        tokio::select! {
            biased;
            cmd = commands.recv() => match cmd {
                Some(Command::Dispose { infos, verb, done }) => {
                    let n = u32::try_from(infos.len()).unwrap_or(u32::MAX);
                    let result = dispose(&receiver, infos, verb).await;
                    if result.is_ok() {
                        credit.unsettled = credit.unsettled.saturating_sub(n);
                    }
                    let _ = done.send(result);
                }
                Some(Command::Quiesce { done }) => {
                    // Drain, not credit 0: a transfer already on the wire when the flow leaves
                    // still has credit and arrives as a delivery (with credit 0 the client
                    // refuses it and only the detach gives it back). The broker sends what it
                    // has, then uses up the credit. What arrives goes to the channel, to be
                    // released: Service Bus would otherwise keep it locked until its lock
                    // expires. The client does not surface the broker's drain answer, so a quiet
                    // gap ends the wait; a late straggler is returned by the detach.
                    if let Err(e) = receiver.drain().await {
                        tracing::debug!(error = %e, "draining the link failed");
                    }
                    let until = tokio::time::Instant::now() + QUIESCE_BOUND;
                    while let Ok(Ok(d)) = tokio::time::timeout_at(
                        until.min(tokio::time::Instant::now() + QUIET_GAP),
                        receiver.recv::<Body<Value>>(),
                    )
                    .await
                    {
                        let (info, message) = d.into_parts();
                        let _ = deliveries.send(Ok(Delivery::new(info, message)));
                    }
                    receiving = false;
                    credit.window = 0; // never grant again
                    let _ = done.send(());
                }
                Some(Command::Close { bound, done }) => {
                    // RabbitMQ answers a closing detach without `closed=true`, and a close was seen
                    // to wait out its whole bound: wait at most 1 s, as closing the session and the
                    // connection detaches the link anyway.
                    let bound = bound.min(Duration::from_secs(1));
                    if tokio::time::timeout(bound, receiver.close()).await.is_err() {
                        tracing::debug!("receiver close unanswered within {bound:?}");
                    }
                    let _ = done.send(());
                    return;
                }
                None => return,
            },
            // `recv` is cancel safe: a delivery is never lost to the other branch.
            d = receiver.recv::<Body<Value>>(), if receiving => {
                let failed = d.is_err();
                if !failed {
                    credit.left = credit.left.saturating_sub(1);
                    credit.unsettled = credit.unsettled.saturating_add(1);
                }
                let d = d.map(|delivery| {
                    let (info, message) = delivery.into_parts();
                    Delivery::new(info, message)
                });
                if deliveries.send(d).is_err() || failed {
                    receiving = false;
                }
            }
        }
    }
}

async fn dispose(
    receiver: &Receiver,
    infos: Vec<DeliveryInfo>,
    verb: Disposition,
) -> Result<(), DispositionError> {
    match verb {
        Disposition::Accept => receiver.dispose_all(infos, Accepted {}).await,
        Disposition::Release => receiver.dispose_all(infos, Released {}).await,
        Disposition::Reject(error) => {
            receiver.dispose_all(infos, Rejected { error: Some(error) }).await
        }
        Disposition::Modify(m) => receiver.dispose_all(infos, m).await,
    }
}
