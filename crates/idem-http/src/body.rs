//! The layer's response body, and reading a handler's body up to the storage limit.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt as _;
use pin_project_lite::pin_project;

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// The body of every response the layer returns: the handler's own body passed through,
    /// whole bytes (a replay, one of the layer's own problems, a stored response), or the part
    /// of a handler's body read before it turned out too large to store, followed by the rest.
    ///
    /// It implements [`http_body::Body`] with `Bytes` data, so axum and hyper serve it as they
    /// serve the handler's body.
    ///
    /// ```
    /// use http_body::Body as _;
    /// use idem_http::ResponseBody;
    ///
    /// let body: ResponseBody<http_body_util::Empty<bytes::Bytes>> = ResponseBody::from("paid");
    /// assert_eq!(body.size_hint().exact(), Some(4));
    /// ```
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Full { data: Option<Bytes> },
        Inner { #[pin] body: B },
        // Boxed because it was polled before being moved into the response.
        Rest { head: Option<Bytes>, rest: Pin<Box<B>> },
    }
}

impl<B> ResponseBody<B> {
    /// The handler's body, passed through untouched.
    pub(crate) fn inner(body: B) -> Self {
        Self { kind: Kind::Inner { body } }
    }

    /// Whole bytes.
    pub(crate) fn full(data: Bytes) -> Self {
        Self { kind: Kind::Full { data: (!data.is_empty()).then_some(data) } }
    }
}

impl<B> From<Bytes> for ResponseBody<B> {
    fn from(data: Bytes) -> Self {
        Self::full(data)
    }
}

impl<B> From<&'static str> for ResponseBody<B> {
    fn from(data: &'static str) -> Self {
        Self::full(Bytes::from_static(data.as_bytes()))
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Inner { body } => poll_bytes(body, cx),
            KindProj::Rest { head, rest } => match head.take() {
                Some(h) => Poll::Ready(Some(Ok(Frame::data(h)))),
                None => poll_bytes(rest.as_mut(), cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Rest { head, rest } => head.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Inner { body } => body.size_hint(),
            Kind::Rest { head, rest } => {
                let head = head.as_ref().map_or(0, |h| h.len() as u64);
                let inner = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower().saturating_add(head));
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper.saturating_add(head));
                }
                hint
            }
        }
    }
}

fn poll_bytes<B>(
    body: Pin<&mut B>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    body.poll_frame(cx).map(|frame| {
        frame.map(|f| {
            f.map(|f| f.map_data(|mut d| d.copy_to_bytes(d.remaining()))).map_err(Into::into)
        })
    })
}

/// A handler's body as read for storing.
pub(crate) enum Read<B> {
    /// All of it, within the limit (trailers are not kept: they are not stored either).
    Whole(Bytes),
    /// More than the limit: what was read, and the body to read the rest from. Reading stopped
    /// at the first frame past the limit.
    TooLarge(ResponseBody<B>),
    /// The body failed.
    Failed(BoxError),
}

/// Reads `body` frame by frame until its end, or until more than `limit` bytes were read.
pub(crate) async fn read_limited<B>(body: B, limit: usize) -> Read<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let mut body = Box::pin(body);
    // Chunks as they came (`Bytes` data is not copied), joined at the end: most handlers
    // answer in one frame, which is then stored without a copy.
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(e) => return Read::Failed(e.into()),
        };
        let Ok(mut data) = frame.into_data() else { continue };
        let chunk = data.copy_to_bytes(data.remaining());
        len = len.saturating_add(chunk.len());
        chunks.push(chunk);
        if len > limit {
            let head = Some(join(chunks, len));
            return Read::TooLarge(ResponseBody { kind: Kind::Rest { head, rest: body } });
        }
    }
    Read::Whole(join(chunks, len))
}

fn join(mut chunks: Vec<Bytes>, len: usize) -> Bytes {
    if chunks.len() == 1 {
        return chunks.pop().unwrap_or_default();
    }
    let mut buf = BytesMut::with_capacity(len);
    for c in chunks {
        buf.extend_from_slice(&c);
    }
    buf.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{Full, StreamBody};

    type Frames =
        StreamBody<futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, BoxError>>>>;

    fn frames(parts: &[&'static str]) -> Frames {
        let v: Vec<Result<Frame<Bytes>, BoxError>> =
            parts.iter().map(|p| Ok(Frame::data(Bytes::from_static(p.as_bytes())))).collect();
        StreamBody::new(futures_util::stream::iter(v))
    }

    #[tokio::test]
    async fn within_the_limit_is_read_whole() {
        let Read::Whole(b) = read_limited(frames(&["ab", "cd"]), 4).await else { panic!() };
        assert_eq!(b, "abcd");
        let Read::Whole(b) = read_limited(Full::new(Bytes::new()), 0).await else { panic!() };
        assert!(b.is_empty());
    }

    #[tokio::test]
    async fn past_the_limit_stops_and_keeps_every_byte() {
        let Read::TooLarge(body) = read_limited(frames(&["ab", "cd", "ef", "gh"]), 3).await else {
            panic!("not too large")
        };
        assert!(!body.is_end_stream());
        assert_eq!(body.collect().await.unwrap().to_bytes(), "abcdefgh");
    }
}
