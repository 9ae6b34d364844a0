//! The entity's `$management` node: lock renewal, request and reply on a pair of links.

use std::time::Duration;

use fe2o3_amqp::link::{Receiver, Sender};
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::messaging::{
    AmqpValue, ApplicationProperties, Body, Message, MessageId, Outcome, Properties,
};
use fe2o3_amqp::types::primitives::{Array, OrderedMap, SimpleValue, Value};

use crate::error::{Error, bounded};

/// A request/reply client for `<entity>/$management`.
pub(crate) struct Management {
    sender: Sender,
    receiver: Receiver,
    reply_to: String,
    next: u64,
}

impl Management {
    pub(crate) async fn attach(
        session: &mut SessionHandle<()>,
        entity: &str,
        container: &str,
        bound: Duration,
    ) -> Result<Self, Error> {
        let node = format!("{entity}/$management");
        let reply_to = format!("{container}-management");
        let sender = bounded("attach $management sender", bound, async {
            Sender::attach(session, format!("{container}-mgmt-sender"), node.clone())
                .await
                .map_err(|source| Error::AttachSender { address: node.clone(), source })
        })
        .await?;
        let receiver = bounded("attach $management receiver", bound, async {
            Receiver::builder()
                .name(format!("{container}-mgmt-receiver"))
                .source(node.clone())
                .target(reply_to.clone())
                .attach(session)
                .await
                .map_err(|source| Error::AttachReceiver { address: node.clone(), source })
        })
        .await?;
        Ok(Self { sender, receiver, reply_to, next: 0 })
    }

    /// Sends `operation` with `body` and waits for a reply whose `statusCode` is 200.
    async fn call(
        &mut self,
        operation: &'static str,
        body: OrderedMap<Value, Value>,
    ) -> Result<Value, Error> {
        let fail = |reason: String| Error::Management { operation, reason };
        self.next += 1;
        let mut props = OrderedMap::new();
        props.insert("operation".to_owned(), SimpleValue::String(operation.to_owned()));
        let request = Message {
            header: None,
            delivery_annotations: None,
            message_annotations: None,
            properties: Some(Properties {
                message_id: Some(MessageId::Ulong(self.next)),
                reply_to: Some(self.reply_to.clone()),
                ..Properties::default()
            }),
            application_properties: Some(ApplicationProperties(props)),
            body: Body::Value(AmqpValue(Value::Map(body))),
            footer: None,
        };
        match self.sender.send(request).await {
            Ok(Outcome::Accepted(_)) => {}
            Ok(other) => return Err(fail(format!("request not accepted: {other:?}"))),
            Err(e) => return Err(fail(e.to_string())),
        }
        let reply = self.receiver.recv::<Body<Value>>().await.map_err(|e| fail(e.to_string()))?;
        self.receiver.accept(&reply).await.map_err(|e| fail(e.to_string()))?;
        let message = reply.into_message();
        let app = message.application_properties.as_ref();
        let field = |name: &str| {
            app.and_then(|a| a.0.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v))
        };
        let status = match field("statusCode").or_else(|| field("status-code")) {
            Some(SimpleValue::Int(n)) => i64::from(*n),
            Some(SimpleValue::Long(n)) => *n,
            Some(SimpleValue::Uint(n)) => i64::from(*n),
            _ => return Err(fail("reply has no statusCode".into())),
        };
        if status != 200 {
            let description =
                match field("statusDescription").or_else(|| field("status-description")) {
                    Some(SimpleValue::String(s)) => s.clone(),
                    _ => String::new(),
                };
            return Err(fail(format!("status {status} {description}")));
        }
        Ok(match message.body {
            Body::Value(AmqpValue(v)) => v,
            _ => Value::Null,
        })
    }

    /// `com.microsoft:renew-lock` for the messages' lock tokens.
    pub(crate) async fn renew_locks(&mut self, tokens: Vec<uuid::Uuid>) -> Result<(), Error> {
        if tokens.is_empty() {
            return Ok(());
        }
        let tokens: Vec<Value> = tokens
            .into_iter()
            .map(|t| Value::Uuid(fe2o3_amqp::types::primitives::Uuid::from(*t.as_bytes())))
            .collect();
        let mut body = OrderedMap::new();
        body.insert(Value::String("lock-tokens".into()), Value::Array(Array::from(tokens)));
        self.call("com.microsoft:renew-lock", body).await.map(|_| ())
    }

    /// `com.microsoft:schedule-message`: each `(message-id, session-id, encoded message)` is
    /// stored by the broker and enqueued at the message's `x-opt-scheduled-enqueue-time`.
    /// Needs Send rights on the entity.
    pub(crate) async fn schedule(
        &mut self,
        messages: Vec<(String, Option<String>, Vec<u8>)>,
    ) -> Result<(), Error> {
        let list: Vec<Value> = messages
            .into_iter()
            .map(|(id, session, encoded)| {
                let mut m = OrderedMap::new();
                m.insert(Value::String("message-id".into()), Value::String(id));
                if let Some(session) = session {
                    m.insert(Value::String("session-id".into()), Value::String(session));
                }
                m.insert(Value::String("message".into()), Value::Binary(encoded.into()));
                Value::Map(m)
            })
            .collect();
        let mut body = OrderedMap::new();
        body.insert(Value::String("messages".into()), Value::List(list));
        self.call("com.microsoft:schedule-message", body).await.map(|_| ())
    }

    /// `com.microsoft:renew-session-lock` for the session.
    pub(crate) async fn renew_session_lock(&mut self, session_id: &str) -> Result<(), Error> {
        let mut body = OrderedMap::new();
        body.insert(Value::String("session-id".into()), Value::String(session_id.to_owned()));
        self.call("com.microsoft:renew-session-lock", body).await.map(|_| ())
    }
}
